"""FSDP2 (``fully_shard``): parameters are DTensors; a group is made whole with ``full_tensor()`` on just its params."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from ..core import FullTensor
from .base import ShardedGathererBase

__all__ = ["Fsdp2Gatherer", "is_dtensor"]


def is_dtensor(t: object) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    return isinstance(t, DTensor)


def _whole(p: Any) -> torch.Tensor:
    """All-gather one DTensor parameter into a plain tensor (a collective over its mesh)."""
    from torch.distributed.tensor import DTensor

    t = p.detach()
    local = t.to_local()
    mesh = t.device_mesh
    if local.device.type != mesh.device_type:
        # CPU offload: the shard lives on the CPU while the mesh communicates on the accelerator.
        t = DTensor.from_local(local.to(mesh.device_type), mesh, t.placements, shape=t.shape, stride=t.stride())
    full: torch.Tensor = t.full_tensor()
    return full


class Fsdp2Gatherer(ShardedGathererBase):
    """``DTensor.full_tensor()`` on each parameter of one group, never the whole model.

    ``fully_shard``'s own ``unshard()`` works on a whole FSDP unit (usually a decoder layer) and changes the module's
    state; gathering the group's DTensors leaves FSDP's state alone, needs no knowledge of the unit layout, and keeps
    the stream's groups independent of how the model was wrapped. Shapes and dtypes come from the DTensors' global
    metadata, so planning and ``metadata()`` communicate nothing.
    """

    name = "fsdp2"

    def __init__(self, model: nn.Module) -> None:
        dtensors = [p for p in model.parameters() if is_dtensor(p)]
        if not dtensors:
            raise ValueError("Fsdp2Gatherer needs a model with DTensor parameters (torch.distributed.fsdp.fully_shard)")
        mesh: Any = dtensors[0].device_mesh  # type: ignore[attr-defined]
        self._group = mesh.get_group() if mesh.ndim == 1 else None
        self._held = 0

    @contextmanager
    def gather(self, params: Sequence[nn.Parameter]) -> Iterator[FullTensor]:
        whole: dict[int, torch.Tensor] = {}
        try:
            with torch.no_grad():
                for p in params:
                    if is_dtensor(p):
                        whole[id(p)] = full = _whole(p)
                        self._held += full.numel() * full.element_size()

            def full_of(p: nn.Parameter) -> torch.Tensor:
                t = whole.get(id(p))
                return t if t is not None else p.detach()

            yield full_of
        finally:
            whole.clear()
            self._held = 0
