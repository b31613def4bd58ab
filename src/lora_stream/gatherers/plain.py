"""Parameters that are already whole on every rank: a single-process model or a DDP replica."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn

from ..merge import FullTensor

__all__ = ["PlainGatherer"]


def _whole(param: nn.Parameter) -> torch.Tensor:
    # detach() shares storage (no copy) and keeps the consumer out of the trainer's autograd graph.
    return param.detach()


class PlainGatherer:
    """Nothing to gather: every parameter is already whole. No communication, so no lockstep either."""

    name = "plain"

    def full_shape(self, param: nn.Parameter) -> torch.Size:
        return param.shape

    def full_dtype(self, param: nn.Parameter) -> torch.dtype:
        return param.dtype

    @contextmanager
    def gather(self, params: Sequence[nn.Parameter]) -> Iterator[FullTensor]:
        yield _whole

    @property
    def collective(self) -> bool:
        return False

    @property
    def process_group(self) -> object | None:
        return None

    def held_bytes(self) -> int:
        return 0
