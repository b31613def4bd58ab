"""Parameters that are already whole on every rank: a single-process model or a DDP replica."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from ..core import FullTensor, ParamRef
from .base import GathererBase, detached

__all__ = ["PlainGatherer"]


class PlainGatherer(GathererBase):
    """Nothing to gather: every parameter is already whole. No communication, so no lockstep either."""

    name = "plain"

    @contextmanager
    def gather(self, params: Sequence[ParamRef]) -> Iterator[FullTensor]:
        yield detached
