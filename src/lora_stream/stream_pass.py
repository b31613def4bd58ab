"""One pass of a :class:`~lora_stream.ParamStream`: what it describes (:class:`ParamMeta`, the steps a pass may
leave out: :class:`Selection`), how it is held (:class:`StreamPass`, its :class:`PassState`) and what it measured
(:class:`StreamStats`).

Who uses it: the stream, which opens a pass on each iteration; the sinks, which hold the pass they send and read how
it ended. A module of its own so that what a sink reads of a pass does not bring the whole stream with it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from enum import Enum
from types import TracebackType
from typing import Any, Generic, TypeVar

import torch

from .lockstep import describe_error

__all__ = ["InputRequest", "ParamMeta", "PassRecord", "PassState", "Selection", "StreamPass", "StreamStats"]


@dataclass(frozen=True)
class ParamMeta:
    """Name, dtype (after the stream's cast) and whole shape of one output tensor.

    Field for field what vLLM's ``weight_transfer.base.ParamMeta`` holds, so a ``ParamStream`` can be handed to
    vLLM's trainer-side engines as their ``WeightSource``.
    """

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass
class StreamStats:
    """What one pass over the stream did. Read it from :attr:`ParamStream.last_stats` after (or during) a pass."""

    #: Groups gathered and tensors / bytes yielded.
    groups: int = 0
    tensors: int = 0
    bytes: int = 0
    #: Tensors that were computed fresh (merged or cast); the rest were yielded without a copy.
    computed: int = 0
    #: Largest group gathered, in whole bytes of its parameters (what the gatherer held at once).
    peak_gathered_bytes: int = 0
    #: Largest float32 temporary footprint of one merge (block buffers and factor copies), as planned.
    peak_temp_bytes: int = 0
    #: Float32 workspace the pass held at its end (reused by every merge; bounded by a few merge blocks).
    workspace_bytes: int = 0
    #: Bytes the gatherer kept allocated when the pass ended, for the next pass (its gather buffers, when they hold
    #: at most its ``keep_bytes``; freed by ``close()``); 0 when it frees them.
    kept_bytes: int = 0
    #: Times the pass returned freed heap to the OS (``release_memory``: only once the process had grown past
    #: 1.5x the largest group; 0 in a steady state).
    heap_trims: int = 0
    #: Process resident set at the start of the pass and its peak during the pass (``measure_rss=True``, Linux).
    rss_start_bytes: int | None = None
    rss_peak_bytes: int | None = None
    #: Wall time of the pass so far, seconds.
    seconds: float = 0.0
    #: What the gatherer gathered by each of its paths during this pass, in parameters: ``{"direct": n,
    #: "fallback": m}`` parameters made whole by the direct path and by the fallback (ZeRO-3: every parameter of a
    #: group, persistent ones included, counts on the path its group took; FSDP2: every DTensor parameter); empty
    #: for gatherers with a single path. ``fallback_reason``: why the latest fallback could not take the direct path.
    gather_paths: dict[str, int] = field(default_factory=dict)
    fallback_reason: str | None = None
    #: A pass over a :class:`Selection`: the tensors and bytes it left out (their sources unchanged since the
    #: engine's version); 0 for a full pass.
    skipped_tensors: int = 0
    skipped_bytes: int = 0
    #: Whole bytes of every group this pass gathered (what each rank made whole, group after group).
    gathered_bytes: int = 0
    #: True once every group was produced and every rank agreed the pass ended.
    complete: bool = False


@dataclass(frozen=True)
class Selection:
    """Which steps of a stream's plan one pass produces (:meth:`ParamStream.iter_groups`): a partial sync's pass.

    A step is one checkpoint-format conversion (usually one tensor in, one out; ``ParamStream.steps()`` lists
    each step's output names). Every rank of a sharded stream must pass the same selection, since it decides which
    groups are gathered: build it from an agreement (:func:`lora_stream.changes.agree_on_changes`). Groups none of
    whose steps are selected are not gathered, merged or yielded at all; the others gather only what their
    selected steps read.
    """

    steps: frozenset[int]


@dataclass(frozen=True)
class InputRequest:
    """What one pass of :meth:`ParamStream.iter_inputs` sends: for every selected step (indices into
    ``steps()``), the merge inputs to make whole and yield (:class:`~lora_stream.engine_merge.InputSpec`, each
    once per pass). The merge itself runs where the base is: in the engine (:mod:`lora_stream.engine_merge`).
    Every rank of a sharded stream must pass the same request."""

    steps: frozenset[int]
    sends: dict[int, list[Any]]


T = TypeVar("T")


class PassState(str, Enum):
    """Where one pass over a stream stands."""

    #: Created, nothing gathered yet.
    NOT_STARTED = "not started"
    #: Producing groups.
    RUNNING = "running"
    #: Every group produced and, under a sharded gatherer, every rank agreed the pass ended.
    COMPLETE = "complete"
    #: Ended early by its consumer (``break``, ``close()``, an exception leaving its ``with`` block); the other
    #: ranks were told.
    STOPPED = "stopped"
    #: The stream itself raised on this rank (a gather, a merge); the other ranks were told.
    FAILED = "failed"
    #: Another rank stopped or failed, or the exchange with it failed: this rank raised ``StreamAbortedError``.
    ABORTED = "aborted"

    @property
    def ended_early(self) -> bool:
        """The pass started and ended without completing: its end was already exchanged with the other ranks."""
        return self in (PassState.STOPPED, PassState.FAILED, PassState.ABORTED)


@dataclass
class PassRecord:
    """The state one pass shares between its iterator and its producer."""

    state: PassState = PassState.NOT_STARTED
    stats: StreamStats = field(default_factory=StreamStats)
    stop_reason: str | None = None


class StreamPass(Generic[T]):
    """One pass over a :class:`ParamStream`: an iterator, and a context manager that ends the pass with its block.

    Other ranks learn that this rank stopped (and raise :class:`~lora_stream.StreamAbortedError`) when the pass
    ends: it is exhausted, ``close()`` is called, its ``with`` block exits, or it is garbage-collected. The last is
    not prompt when something keeps the pass alive -- a traceback held by an ``except`` clause or a logger, a local
    variable -- and the peers then wait out the stream's ``timeout``. Iterate inside ``with`` (every sink does) and
    an exception leaving the block ends the pass at once::

        with stream.iter_groups() as groups:
            for names, tensors in groups:
                engine.load(names, tensors)   # if this raises, peers are told before the exception goes on
    """

    def __init__(self, produce: Callable[[PassRecord], Generator[T, None, None]]) -> None:
        # The generator gets the record, not this object: a generator whose frame referred back to its own pass
        # would form a cycle, and an abandoned pass would then end (and tell the peers) only when the cyclic
        # garbage collector ran, not when the last reference went.
        self.record = PassRecord()
        self._gen = produce(self.record)

    @property
    def state(self) -> PassState:
        """Where the pass stands."""
        return self.record.state

    @property
    def stats(self) -> StreamStats:
        """What this pass did so far (the stream's ``last_stats`` while it is the latest pass)."""
        return self.record.stats

    @property
    def stop_reason(self) -> str | None:
        """Sent to the other ranks with this rank's stop: the exception that ended the pass, if any."""
        return self.record.stop_reason

    def __iter__(self) -> StreamPass[T]:
        return self

    def __next__(self) -> T:
        return next(self._gen)

    @property
    def active(self) -> bool:
        """Whether the pass is still open (started or not, and neither exhausted nor closed)."""
        return inspect.getgeneratorstate(self._gen) != inspect.GEN_CLOSED

    def close(self) -> None:
        """End the pass now: release what it holds and tell the other ranks (a no-op once ended)."""
        self._gen.close()

    def __enter__(self) -> StreamPass[T]:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc is not None and self.record.stop_reason is None:
            self.record.stop_reason = describe_error(exc)
        self.close()
