"""Every sync is one transaction across the trainer ranks and the engines they feed.

A sync has three phases, the same in every sink; only the transport differs:

1. **prepare** -- every rank runs its pre-flight (names, shapes, tied weights, the engine's limits, the server's
   reachability) and the ranks agree. If any rank refuses, every rank raises before a byte moves: the refusing
   rank its own error, the others :class:`~lora_stream.StreamAbortedError` naming it and its reason.
2. **transfer** -- the stream's pass, the engine's load, its reload check, the opt-in verification, the prefix-cache
   reset. A failure on any rank ends the pass for every rank at the next group boundary (the stream's lockstep) or
   is recorded until the vote.
3. **vote, then commit or abort** -- one agreement: every rank says whether its side succeeded. If all did, every
   rank commits (the engine drops what it kept to undo the update, the version moves). If any did not, every rank
   aborts (the engine puts back, bit for bit, what it served before) and raises.

Hence the two promises every sink keeps: when ``sync`` returns, it has returned on every rank; when it raises, it
raises on every rank. A version moves on every engine or on none.

Agreements are the stream's own status exchange (:class:`~lora_stream.coordination.Coordinator`), so a rank still
inside the stream's pass learns the outcome there. A rank whose *process* died cannot vote; its peers fail the
exchange after the stream's ``timeout`` (or at once, when the transport reports the closed connection) and abort.

Every path runs the same agreements on every rank: which ones follow depends only on what the previous ones
decided, and that is the same everywhere. An exchange a rank gave up on is settled as given up for every rank
(:mod:`lora_stream.lockstep`), so a slow rank arriving later raises too instead of going on alone. Once a peer is
known lost in a sync, this rank's later agreements of that sync wait :data:`LOST_WAIT_S` only: their outcome is a
failure either way, and the late peer finds them given up.

Fault points. For tests of these promises, :func:`set_fault_hook` installs a callable that every sink calls, on
every rank, at each named point of its transaction (:data:`FAULT_POINTS`); raising from it fails the sync there, as
a real failure at that point would. Tests import both from :mod:`lora_stream.testing`.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

from .coordination import Coordinator
from .lockstep import FLAG_CAPACITY, describe_error

__all__ = ["FAULT_POINTS", "LOST_WAIT_S", "FaultHook", "Transaction", "fault_point", "set_fault_hook"]

#: Seconds a rank waits at each later agreement of a sync once a peer was lost in it (see the module docstring).
LOST_WAIT_S = 2.0

T = TypeVar("T")

#: Where a sink calls the fault hook, in order: the pre-flight; before loading each group (``"group:<k>"``,
#: k counted from 0 over the stream's whole plan: a sync that sends only what changed passes the points of the
#: groups it skips too, in their place, so that a point fires on every sync whatever changed); after the engine's
#: reload check; after the verification probe; after the prefix-cache reset; just before the commit vote. The server
#: route adds ``"decision-recorded"``: after the vote, once this rank recorded the decision at its servers and before
#: the vote that every server did (:meth:`ServerRoute.commit <lora_stream.sinks.server_route.ServerRoute.commit>`);
#: and, for an element sync, ``"staged"``: once its servers received, decoded and checked the payload, before they
#: are paused (:meth:`ServerRoute.transfer <lora_stream.sinks.server_route.ServerRoute.transfer>`).
FAULT_POINTS = ("prepare", "group:<k>", "reload-check", "verify", "prefix-cache", "commit")

FaultHook = Callable[[str], None]
_fault_hook: FaultHook | None = None


def set_fault_hook(hook: FaultHook | None) -> FaultHook | None:
    """Install ``hook`` (``None`` removes it); returns the previous one.

    Meant for tests of the transaction guarantees: ``hook(point)`` is called in this process at each of
    :data:`FAULT_POINTS`, and an exception it raises is treated exactly like a failure of the sink at that point.
    Never install one in production.
    """
    global _fault_hook
    previous, _fault_hook = _fault_hook, hook
    return previous


def fault_point(point: str) -> None:
    """Call the installed fault hook, if any, at ``point``."""
    if _fault_hook is not None:
        _fault_hook(point)


class Transaction:
    """One sync's phases on one rank: :meth:`prepare`, any number of :meth:`attempt` blocks, :meth:`vote`, then
    :meth:`conclude`.

    Every rank of ``coordinator``'s group builds one per sync and calls the same methods in the same order (the
    agreements are collectives). The first failure on this rank is kept in :attr:`error`; once a vote saw a failure
    anywhere, :attr:`error` is set on every rank and later :meth:`attempt` blocks are skipped.

    Args:
        coordinator: the stream's (``stream.coordinator``): the trainer ranks that iterate it.
        what: the sink's name, used in the agreement's messages.
        lockstep: the stream's gatherer communicates, and the agreements run in lockstep with its passes over its
            group; ``False``: it does not (one process, DDP), and they run over ``torch.distributed``'s default group
            instead (:meth:`Coordinator.over_default_group
            <lora_stream.coordination.Coordinator.over_default_group>`).
    """

    def __init__(self, coordinator: Coordinator, what: str, *, lockstep: bool = True) -> None:
        # Not in lockstep: the gatherer does not communicate, and the sync agrees over the default group instead.
        self.coordinator = coordinator if lockstep else coordinator.over_default_group()
        self.what = what
        self.lockstep = lockstep
        self.error: BaseException | None = None
        #: A peer could not be heard from in this sync (see the module docstring).
        self.lost = False
        #: The stream the sync reads (set by :meth:`for_stream`): its plan is checked again in :meth:`prepare`.
        self.stream: Any = None
        self._previous_wait: Any = None

    def _record(self, exc: BaseException) -> None:
        if getattr(exc, "lost", False):
            self.lost = True
        if self.error is None:
            self.error = exc
        elif exc is not self.error:
            self.error.add_note(f"lora_stream: then also {describe_error(exc)}")

    def _coordinator(self) -> Coordinator:
        if not self.lost:
            return self.coordinator
        c = self.coordinator
        brief = Coordinator(c.group, c.digest, min(c.timeout, datetime.timedelta(seconds=LOST_WAIT_S)))
        brief.active = c.active
        return brief

    @classmethod
    def for_stream(cls, stream: Any, what: str, *, wait_s: float | None = None) -> Transaction:
        """The transaction of one sync of ``stream`` (a :class:`~lora_stream.ParamStream`).

        A sharded stream (ZeRO-3, FSDP) agrees over its gatherer's group, in lockstep with its passes. A stream
        whose gatherer does not communicate (one process, DDP) still agrees over ``torch.distributed``'s default
        group when there is one: under DDP the ranks may share one engine (``external_launcher``, a server), so a
        rank that refused must stop the others too. Every rank of that group must then call ``sync``.

        ``wait_s``: a sink whose own steps between two agreements can take longer than the stream's timeout gives
        how long every exchange of the sync (the stream's passes included) waits for the peers at least, the same
        on every rank, so that no rank gives up on a peer still within its bounds. Use the transaction as a context
        manager then (``with Transaction.for_stream(...) as tx:``): leaving it gives the stream its own wait back.
        """
        previous = stream._agreement_timeout
        if wait_s is not None:  # before the coordinator is built: a non-collective one reads it
            stream._agreement_timeout = max(stream.timeout, datetime.timedelta(seconds=wait_s))
        tx = cls(stream.coordinator, what, lockstep=stream.gatherer.collective)
        tx.stream = stream
        tx._previous_wait = previous
        return tx

    def __enter__(self) -> Transaction:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.stream is not None:
            self.stream._agreement_timeout = self._previous_wait

    @property
    def ok(self) -> bool:
        """No failure so far, on this rank or (as of the latest vote) on any other."""
        return self.error is None

    def prepare(self, check: Callable[[], T]) -> T:
        """Run this rank's pre-flight ``check`` and agree; return its result on every rank, or raise on every rank.

        Nothing may have reached an engine yet: a refusal here leaves every engine untouched. The stream's plan is
        checked first (:meth:`ParamStream.check_plan <lora_stream.ParamStream.check_plan>`): a model whose adapters
        changed since is refused before any engine is contacted.
        """
        result: T | None = None
        try:
            fault_point("prepare")
            if self.stream is not None:
                self.stream.check_plan()
            result = check()
        except BaseException as exc:
            self.error = exc
        try:
            self._coordinator().agree(
                self.error is None, f"in the pre-flight of {self.what}", describe_error(self.error)
            )
        except BaseException as exc:
            self._record(exc)
        if self.error is not None:
            raise self.error
        return result  # type: ignore[return-value]

    @contextmanager
    def attempt(self) -> Iterator[bool]:
        """``with tx.attempt() as go: if go: ...`` -- runs the block's work only while nothing failed; an exception
        raised inside is recorded (the first one wins) instead of propagating, so that this rank still votes."""
        try:
            yield self.ok
        except BaseException as exc:
            self._record(exc)

    def vote(self, stage: str, *, known: bool = False) -> bool:
        """Agree on whether every rank succeeded so far; return it (the same on every rank).

        ``known=True`` skips the exchange when every rank already learned the outcome otherwise (a stream pass that
        ended early told every rank, and none would join one more exchange); this rank's :attr:`error` is then
        already set. A failed exchange (a peer died, or timed out) counts as a failure.
        """
        if known and self.lockstep:  # without lockstep, the peers' passes did not learn of this one's end
            return self.ok
        try:
            self._coordinator().agree(self.ok, f"{stage} ({self.what})", describe_error(self.error))
        except BaseException as exc:  # StreamAbortedError naming the failed ranks, or the exchange itself failed
            self._record(exc)
        return self.ok

    def any_of(self, bits: Sequence[bool], stage: str) -> list[bool] | None:
        """Agreements of fixed size on every path: for each of ``bits`` (as many on every rank), whether any rank
        set it, in as many agreements of :data:`~lora_stream.lockstep.FLAG_CAPACITY` bits as it takes (one at the
        least); ``None`` (recorded as this rank's error) if an exchange failed. Unlike :meth:`vote` it decides
        nothing by itself; a peer's failure reported in it is recorded too."""
        out: list[bool] = []
        for start in range(0, max(1, len(bits)), FLAG_CAPACITY):
            try:
                out += self._coordinator().any_of(list(bits[start : start + FLAG_CAPACITY]), f"{stage} ({self.what})")
            except BaseException as exc:
                self._record(exc)
                return None
        return out

    def conclude(self, commit: Callable[[], None], abort: Callable[[BaseException], None]) -> None:
        """After the last vote: ``commit()`` if every rank succeeded; otherwise ``abort(error)`` and raise ``error``
        (this rank's own failure, or the :class:`StreamAbortedError` naming the ranks that failed).

        ``commit`` must not fail for a reason another rank could not see (it runs after the vote): it only releases
        what the update kept and moves versions. A failure of ``abort`` is added to the error as a note.
        """
        if self.error is None:
            commit()
            return
        error = self.error
        try:
            abort(error)
        except BaseException as exc:
            error.add_note(f"lora_stream: rolling the update back also failed: {describe_error(exc)}")
        raise error
