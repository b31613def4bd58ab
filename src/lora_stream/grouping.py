"""How units are coalesced into groups: the unit of gathering, of release, and of ``iter_groups()``."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Literal

from .core import Output, ParamRef, Step, Unit
from .gatherers.base import GathererBase

__all__ = ["GroupBy", "DEFAULT_BUDGET_BYTES", "Group", "partition", "stack_key"]

GroupBy = Literal["budget", "layer", "module"]
"""How a stream cuts the model into groups (``group_by=``): ``"budget"`` packs consecutive modules up to
``budget_bytes``; ``"layer"`` (:class:`~lora_stream.ParamStream`'s default) makes one group per decoder layer
(what vLLM's layerwise reload wants); ``"module"`` one per module. A module (a LoRA layer with its base) is never
split."""

DEFAULT_BUDGET_BYTES = 128 * 1024 * 1024
"""Default byte budget of one group (whole bytes of the parameters gathered for it). 128 MiB is one decoder layer
of a 1-3B model, well below a GPU's free memory, and large enough that per-group overheads vanish."""


@dataclass
class Group:
    units: list[Unit]
    params: list[ParamRef]
    gathered_bytes: int

    @property
    def steps(self) -> list[Step]:
        return [s for u in self.units for s in u.steps]

    @property
    def outputs(self) -> list[Output]:
        return [o for s in self.steps for o in s.outputs]


def stack_key(name: str) -> tuple[str, int] | None:
    """``(prefix, index)`` of the outermost integer segment of ``name`` (vLLM's ``layerwise_groups`` key)."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[:i]), int(part)
    return None


def _unique(params: Sequence[ParamRef]) -> list[ParamRef]:
    seen: set[int] = set()
    out = []
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


class _Budget:
    """The gathered bytes of the group being built, for ``group_by="budget"``.

    When ``gather_bytes`` is :class:`~lora_stream.gatherers.base.GathererBase`'s (the sum over the distinct
    ``gather_key`` of the parameters), the group's bytes are kept incrementally: each unit costs its own parameters'
    keys, so grouping a model is linear in its parameters. Any other ``gather_bytes`` is asked for the whole group
    with the unit added, as before (exact, quadratic in a group's size).
    """

    def __init__(self, gather_bytes: Callable[[Sequence[ParamRef]], int], budget: int) -> None:
        self.gather_bytes = gather_bytes
        self.budget = budget
        owner = getattr(gather_bytes, "__self__", None)
        self.key_of: Callable[[ParamRef], tuple[Hashable, int]] | None = None
        if isinstance(owner, GathererBase) and type(owner).gather_bytes is GathererBase.gather_bytes:
            self.key_of = owner.gather_key
        self.keys: dict[Hashable, int] = {}
        self.total = 0
        self.params: list[ParamRef] = []
        #: The unit ``admits`` last looked at, with its keys not yet in the group (reused by ``add``).
        self._last: tuple[Unit, dict[Hashable, int]] | None = None

    def _new_keys(self, unit: Unit) -> dict[Hashable, int]:
        assert self.key_of is not None
        new: dict[Hashable, int] = {}
        for p in unit.params:
            key, n = self.key_of(p)
            if key not in self.keys:
                new.setdefault(key, n)
        return new

    def admits(self, unit: Unit) -> bool:
        if self.key_of is None:
            return self.gather_bytes([*self.params, *unit.params]) <= self.budget
        self._last = (unit, self._new_keys(unit))
        return self.total + sum(self._last[1].values()) <= self.budget

    def add(self, unit: Unit) -> None:
        if self.key_of is None:
            self.params += unit.params
            return
        last = self._last
        new = last[1] if last is not None and last[0] is unit else self._new_keys(unit)
        self._last = None
        self.keys.update(new)
        self.total += sum(new.values())

    def reset(self) -> None:
        self.keys, self.total, self.params, self._last = {}, 0, [], None


def partition(
    units: list[Unit], group_by: GroupBy, budget_bytes: int, gather_bytes: Callable[[Sequence[ParamRef]], int]
) -> list[Group]:
    """Coalesce consecutive units into groups; a unit is never split.

    * ``"module"``: one unit per group.
    * ``"budget"``: consecutive units while the group's gathered bytes stay within ``budget_bytes``; a unit larger
      than the budget forms a group of its own.
    * ``"layer"``: one group per decoder layer, keyed like vLLM's ``layerwise_groups`` on the outermost integer
      segment of the names (``model.layers.3``), so a fused layer's shards always travel together. Runs of
      un-indexed units (embeddings before the layers, norm and ``lm_head`` after) form one group each.
    """
    if group_by not in ("budget", "layer", "module"):
        raise ValueError(f"group_by must be 'budget', 'layer' or 'module', got {group_by!r}")
    if budget_bytes <= 0:  # refused whatever the grouping: a bad option is caught where it is written
        raise ValueError(f"budget_bytes must be positive, got {budget_bytes}")
    groups: list[list[Unit]] = []
    current: list[Unit] = []
    current_key: object = object()
    fits = _Budget(gather_bytes, budget_bytes) if group_by == "budget" else None
    for unit in units:
        if group_by == "module":
            split = bool(current)
        elif fits is not None:
            # What the group would hold with this unit added: units can share what is gathered (tied weights;
            # FSDP1 units), so sizes do not simply add up.
            split = bool(current) and not fits.admits(unit)
            if split:
                fits.reset()
            fits.add(unit)
        else:
            key = stack_key(unit.steps[0].outputs[0].name)
            split = bool(current) and key != current_key
            current_key = key
        if split:
            groups.append(current)
            current = []
        current.append(unit)
    if current:
        groups.append(current)
    out = []
    for us in groups:
        params = _unique([p for u in us for p in u.params])
        out.append(Group(us, params, gather_bytes(params)))
    return out
