"""Gatherers: how one group of a (possibly sharded) model's parameters is made whole and released."""

from __future__ import annotations

from torch import nn

from .base import Gatherer
from .fsdp1 import Fsdp1Gatherer, is_fsdp1_model
from .fsdp2 import Fsdp2Gatherer, is_dtensor
from .plain import PlainGatherer
from .zero3 import ZeroThreeGatherer, is_zero3_model

__all__ = ["Fsdp1Gatherer", "Fsdp2Gatherer", "Gatherer", "PlainGatherer", "ZeroThreeGatherer", "auto_gatherer"]


def auto_gatherer(model: nn.Module) -> Gatherer:
    """The gatherer that fits how ``model``'s parameters are stored: ZeRO-3 partitions, DTensors, or whole tensors."""
    if is_zero3_model(model):
        return ZeroThreeGatherer(model)
    if any(is_dtensor(p) for p in model.parameters()):
        return Fsdp2Gatherer(model)
    if is_fsdp1_model(model):
        return Fsdp1Gatherer(model)
    return PlainGatherer()
