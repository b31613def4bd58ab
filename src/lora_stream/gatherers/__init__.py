"""Gatherers: how one group of a (possibly sharded) model's parameters is made whole and released."""

from __future__ import annotations

from torch import nn

from ..errors import UnsupportedModelError
from .base import Gatherer
from .fsdp2 import Fsdp2Gatherer, is_dtensor
from .plain import PlainGatherer
from .zero3 import ZeroThreeGatherer, is_zero3_model

__all__ = ["Fsdp2Gatherer", "Gatherer", "PlainGatherer", "ZeroThreeGatherer", "auto_gatherer"]


def auto_gatherer(model: nn.Module) -> Gatherer:
    """The gatherer that fits how ``model``'s parameters are stored: ZeRO-3 partitions, DTensors, or whole tensors."""
    if is_zero3_model(model):
        return ZeroThreeGatherer(model)
    if any(is_dtensor(p) for p in model.parameters()):
        return Fsdp2Gatherer(model)
    for name, p in model.named_parameters():
        if type(p).__name__ == "FlatParameter":
            raise UnsupportedModelError(
                f"parameter {name!r} is an FSDP1 FlatParameter; no gatherer for it is installed yet"
            )
    return PlainGatherer()
