"""FSDP1 (``FullyShardedDataParallel``): unshard one FSDP unit at a time with ``summon_full_params``."""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..core import FullTensor, ParamRef
from ..errors import UnsupportedModelError
from .base import ShardedGathererBase, nbytes

__all__ = ["Fsdp1Gatherer", "is_fsdp1_model"]


def _fsdp_class() -> type[nn.Module]:
    from torch.distributed.fsdp import FullyShardedDataParallel

    return FullyShardedDataParallel


def is_fsdp1_model(model: nn.Module) -> bool:
    fsdp = _fsdp_class()
    return any(isinstance(m, fsdp) for m in model.modules())


@dataclass(eq=False)
class _Slot:
    """An original parameter of a ``use_orig_params=False`` unit: it exists as an attribute only while unsharded."""

    module: nn.Module
    name: str


class Fsdp1Gatherer(ShardedGathererBase):
    """``FSDP.summon_full_params(unit, recurse=False, writeback=False)`` on the units that own one group.

    FSDP1 keeps each unit's parameters in one ``FlatParameter``, so the unit is the smallest thing it can unshard:
    a group holds whole units, and groups are cut so that what they unshard stays within the budget (a unit larger
    than the budget is a group of its own). ``writeback=False`` discards the unsharded copy on exit, so the local
    shards are never written. Shapes come from the ``FlatParameter``'s own records: no communication.

    With ``use_orig_params=True`` the original ``nn.Parameter`` objects are the refs; with ``use_orig_params=False``
    they do not exist between forwards, and a slot ``(module, name)`` stands in until the unit is summoned.

    Tensors are handed out as copies (FSDP1 frees unsharded storage in place on exit), so this gatherer does not
    honour "yielded without a copy"; the copies are one tensor at a time, like merged outputs.
    """

    name = "fsdp1"

    def __init__(self, model: nn.Module) -> None:
        fsdp = _fsdp_class()
        self._units: list[Any] = [m for m in model.modules() if isinstance(m, fsdp)]
        if not self._units:
            raise ValueError("Fsdp1Gatherer needs a model wrapped in torch.distributed.fsdp.FullyShardedDataParallel")
        self._root = self._units[0]
        self._group = self._root.process_group
        self._refs: dict[tuple[int, str], ParamRef] = {}
        self._by_module: dict[int, list[tuple[str, ParamRef]]] = {}
        self._unit_of: dict[int, int] = {}
        self._shape: dict[int, torch.Size] = {}
        self._dtype: dict[int, torch.dtype] = {}
        self._unit_bytes: list[int] = []
        self._flat: set[int] = set()
        for index, unit in enumerate(self._units):
            handle = unit._handle
            if handle is None:
                self._unit_bytes.append(0)
                continue
            flat = handle.flat_param
            self._flat.add(id(flat))
            self._unit_bytes.append(sum(nbytes(s, flat.dtype) for s in flat._shapes))
            for i, info in enumerate(flat._param_infos):
                ref = flat._params[i] if handle._use_orig_params else _Slot(info.module, info.param_name)
                self._refs[(id(info.module), info.param_name)] = ref
                self._by_module.setdefault(id(info.module), []).append((info.param_name, ref))
                self._unit_of[id(ref)] = index
                self._shape[id(ref)] = torch.Size(flat._shapes[i])
                self._dtype[id(ref)] = flat.dtype
            for shared in flat._shared_param_infos:
                ref = self._refs[(id(shared.prim_module), shared.prim_param_name)]
                self._refs[(id(shared.module), shared.param_name)] = ref
                self._by_module.setdefault(id(shared.module), []).append((shared.param_name, ref))
        self._held = 0

    def module_params(self, module: nn.Module) -> list[tuple[str, ParamRef]]:
        managed = self._by_module.get(id(module), [])
        names = {n for n, _ in managed}
        # Registered parameters FSDP does not manage (ignored modules) stay as they are; FlatParameters are FSDP's
        # storage, not the model's parameters.
        own = [
            (n, p)
            for n, p in module._parameters.items()
            if p is not None and n not in names and id(p) not in self._flat
        ]
        order = list(module._parameters)  # with use_orig_params=True this is the registration order
        managed = sorted(managed, key=lambda item: order.index(item[0]) if item[0] in order else len(order))
        return managed + own

    def param(self, module: nn.Module, name: str) -> ParamRef:
        ref = self._refs.get((id(module), name))
        return ref if ref is not None else super().param(module, name)

    def local_shard(self, param: ParamRef) -> torch.Tensor | None:
        """``None``: FSDP1 holds a rank's bytes in flat parameters shared by a whole unit (not traced to one
        parameter here), so every output is sent at every sync."""
        return None

    def full_shape(self, param: ParamRef) -> torch.Size:
        shape = self._shape.get(id(param))
        return shape if shape is not None else torch.Size(param.shape)

    def full_dtype(self, param: ParamRef) -> torch.dtype:
        dtype = self._dtype.get(id(param))
        return dtype if dtype is not None else super().full_dtype(param)

    def _units_of(self, params: Sequence[ParamRef]) -> list[int]:
        return sorted({self._unit_of[id(p)] for p in params if id(p) in self._unit_of})

    def gather_key(self, param: ParamRef) -> tuple[Hashable, int]:
        """A managed parameter materializes its whole FSDP unit; an unmanaged one itself."""
        unit = self._unit_of.get(id(param))
        if unit is None:
            return super().gather_key(param)
        return ("fsdp1-unit", unit), self._unit_bytes[unit]

    @contextmanager
    def gather(self, params: Sequence[ParamRef]) -> Iterator[FullTensor]:
        if self._root._is_root is None:
            raise UnsupportedModelError(
                "FSDP1 model has not run a forward pass yet: FSDP initializes lazily on the first forward, and "
                "unsharding a child unit before that breaks the next forward ('Non-root FSDP instance's _is_root "
                "should not have been set yet'). Run one forward (or one training step) before streaming."
            )
        fsdp = _fsdp_class()
        with ExitStack() as stack:
            for i in self._units_of(params):
                stack.enter_context(
                    fsdp.summon_full_params(self._units[i], recurse=False, writeback=False)  # type: ignore[attr-defined]
                )
                self._held += self._unit_bytes[i]

            def full_of(p: ParamRef) -> torch.Tensor:
                t = getattr(p.module, p.name) if isinstance(p, _Slot) else p
                # A copy, unlike every other gatherer: on exit FSDP1 frees the unsharded storage in place
                # (resize_ to 0) whatever still points at it, so a view handed to a consumer that keeps it would
                # read freed memory (a segfault, seen with list(stream)).
                whole: torch.Tensor = t.detach().clone()
                return whole

            try:
                yield full_of
            finally:
                self._held = 0
