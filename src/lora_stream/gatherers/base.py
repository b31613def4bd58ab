"""The gatherer contract: make one group of parameters whole, then let go of it."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from ..merge import FullTensor

__all__ = ["Gatherer"]


@runtime_checkable
class Gatherer(Protocol):
    """Makes the parameters of one group whole on this rank, and releases them.

    :class:`~lora_stream.ParamStream` calls ``full_shape`` / ``full_dtype`` while planning (and from
    ``metadata()``), then, for each group in order, enters ``gather(params)`` once, reads whole tensors through the
    accessor it yields, and exits before the next group is gathered. A new gatherer (Megatron, a custom sharding)
    only has to implement this protocol.
    """

    #: Short name used in errors and logs ("plain", "zero3", "fsdp2", ...).
    name: str

    def full_shape(self, param: nn.Parameter) -> torch.Size:
        """The parameter's whole (unsharded) shape.

        Called from ``metadata()``: it must not communicate or allocate, or ``metadata()`` stops being free and,
        worse, becomes a collective that every rank must call together.
        """
        ...

    def full_dtype(self, param: nn.Parameter) -> torch.dtype:
        """The dtype the whole tensor has once gathered. Same no-communication rule as ``full_shape``."""
        ...

    def gather(self, params: Sequence[nn.Parameter]) -> AbstractContextManager[FullTensor]:
        """Make exactly ``params`` whole for the duration of the ``with`` block.

        Yields a function returning the whole tensor of any of ``params``. The tensors it returns may alias the
        trainer's storage; callers must not write to them. On exit every gathered buffer is released (re-sharded)
        so that at most one group is held; a gatherer that keeps buffers past exit breaks the stream's memory
        bound. Entering is a collective for sharded gatherers: every rank of ``process_group`` must gather the same
        groups in the same order, or they deadlock -- which is why the stream runs a status exchange before each
        group when ``collective`` is true.
        """
        ...

    @property
    def collective(self) -> bool:
        """Whether ``gather`` communicates, so ranks must iterate in lockstep."""
        ...

    @property
    def process_group(self) -> object | None:
        """The ``torch.distributed`` group ``gather`` communicates over (``None``: the default group)."""
        ...

    def held_bytes(self) -> int:
        """Bytes this gatherer currently holds whole because of the stream (a probe for tests and stats)."""
        ...
