"""DeepSpeed ZeRO-3: gather exactly one group's partitioned parameters, then re-partition them."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from ..core import FullTensor
from .base import ShardedGathererBase, detached

__all__ = ["ZeroThreeGatherer", "is_zero3_model"]


def is_zero3_model(model: nn.Module) -> bool:
    """Whether ``model``'s parameters are ZeRO-3 partitioned (engine, its ``.module``, or built under zero.Init)."""
    return any(hasattr(p, "ds_id") for p in model.parameters())


class ZeroThreeGatherer(ShardedGathererBase):
    """``deepspeed.zero.GatheredParameters(group, modifier_rank=None)`` around one group at a time.

    ``modifier_rank=None`` makes the gather read-only: DeepSpeed re-partitions on exit without broadcasting
    anything back, and the local partition (``ds_tensor``) is never written. Shapes come from ``ds_shape``, so
    planning and ``metadata()`` communicate nothing.
    """

    name = "zero3"

    def __init__(self, model: nn.Module) -> None:
        self._params: list[Any] = [p for p in model.parameters() if hasattr(p, "ds_id")]
        if not self._params:
            raise ValueError("ZeroThreeGatherer needs a model whose parameters are ZeRO-3 partitioned")
        self._group = getattr(self._params[0], "ds_process_group", None)

    def full_shape(self, param: nn.Parameter) -> torch.Size:
        shape = getattr(param, "ds_shape", None)
        return torch.Size(shape) if shape is not None else param.shape

    @contextmanager
    def gather(self, params: Sequence[nn.Parameter]) -> Iterator[FullTensor]:
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(params), modifier_rank=None):
            yield detached

    def held_bytes(self) -> int:
        """Whole bytes of the parameters ZeRO-3 currently holds gathered, not counting persistent ones."""
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        return sum(
            p.ds_numel * p.element_size()
            for p in self._params
            if p.ds_status == ZeroParamStatus.AVAILABLE and not getattr(p, "ds_persist", False)
        )
