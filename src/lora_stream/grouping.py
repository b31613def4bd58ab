"""How units are coalesced into groups: the unit of gathering, of release, and of ``iter_groups()``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from .core import Output, ParamRef, Step, Unit

__all__ = ["GroupBy", "DEFAULT_BUDGET_BYTES", "Group", "partition", "stack_key"]

GroupBy = Literal["budget", "layer", "module"]
"""How a stream cuts the model into groups (``group_by=``): ``"budget"`` packs consecutive modules up to
``budget_bytes``; ``"layer"`` makes one group per decoder layer (what vLLM's layerwise reload wants); ``"module"``
one per module. A module (a LoRA layer with its base) is never split."""

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
    if group_by == "budget" and budget_bytes <= 0:
        raise ValueError(f"budget_bytes must be positive, got {budget_bytes}")
    groups: list[list[Unit]] = []
    current: list[Unit] = []
    current_key: object = object()
    for unit in units:
        if group_by == "module":
            split = bool(current)
        elif group_by == "budget":
            # Ask the gatherer what the group would hold with this unit added: units can share what is gathered
            # (tied weights; FSDP1 units), so sizes do not simply add up.
            split = bool(current) and gather_bytes([p for u in (*current, unit) for p in u.params]) > budget_bytes
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
