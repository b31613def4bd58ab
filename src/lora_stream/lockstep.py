"""Keeping ranks in lockstep so that one rank's failure can never turn into everyone else's hang.

Sharded gathers are collectives: if rank 1's consumer raises and rank 0 goes on to gather the next group, rank 0
waits in that gather until the collective times out (30 minutes by default), long after the real error scrolled
by. So before each group, and once after the last, every rank contributes its status to one tiny ``all_reduce``.
A rank that stops -- its consumer raised, broke out of the loop, called ``close()``, or the stream itself failed --
sends "stopped" in the next exchange instead of silently leaving; every other rank then raises
:class:`~lora_stream.StreamAbortedError` naming it, at the latest one group later. After an exchange that reports a
stop nobody exchanges again, so the counts always match.

A rank whose *process* died cannot send anything; its peers see the transport's own error (gloo reports the closed
connection at once) or, at worst, this exchange's timeout, which is the stream's ``timeout`` and defaults to
five minutes rather than the collective's thirty.

An exchange one rank gave up on is never completed as a success. gloo cannot cancel a posted ``all_reduce``: a rank
that stops waiting leaves its contribution (its OK) in flight, and a late peer would complete the exchange with it
and go on to gather alone. So every exchange is numbered (per process group, the same on every rank), and its
outcome is settled in the group's store, by compare-and-set on one key (:class:`_Outcome`): each rank whose
``all_reduce`` completed adds its confirmation, and the exchange is *done* only once every rank's is in; a rank that
timed out before any peer confirmed it settles it *given up*, and so does a rank that completed it but still lacks
a peer's confirmation when the settlement's bound runs out (:data:`SETTLE_BOUND_S` after the last rank reached the
exchange, by the wall-clock times the ranks send along). Both outcomes are final, so no rank can take one while
another takes the other from the store. A late peer that finds the exchange given up raises
:class:`~lora_stream.StreamAbortedError` naming the rank that left, and a rank that timed out a moment after a peer
completed it waits for its own completion and confirms it instead of raising alone.

A rank returns only once it learned from the store that the exchange is done, within the bound -- or after it, if
a peer took it done in time (recorded in the store), which is how a rank that was itself stopped learns that its
peers went on. A rank that cannot hear the store (its host is stopped or gone) never takes anything on its own: it
cannot know what the others confirmed, so it raises, and so does every peer, because none of them can learn that
the exchange is done in time either (see :meth:`_Outcome.confirm` for the one window that remains). The number
rides in the exchange too: ranks that disagree on it (an exchange issued outside this module) fail there, and
number the next one alike again.
"""

from __future__ import annotations

import datetime
import threading
import time
import weakref
import zlib
from collections.abc import Callable, Sequence
from enum import IntEnum

import torch
import torch.distributed as dist

from .errors import StreamAbortedError

__all__ = ["FLAG_CAPACITY", "REASON_BYTES", "Lockstep", "Status", "describe_error", "describe_stops"]

#: Prefix of the keys that settle each exchange's outcome in the group's store (``<prefix>/<epoch>/<digest>/<n>``:
#: ``epoch`` numbers the process group objects built on that store, so that a group built again -- torch may give it
#: the same name and store -- never reads an outcome of the previous one).
OUTCOME_PREFIX = "lora_stream/lockstep"
#: How long a rank that timed out waits more for its own ``all_reduce`` once a peer confirmed that it completed
#: (every contribution had arrived, so it completes at once unless this process is starved).
COMPLETION_GRACE_S = 10.0
#: The settlement's bound (the store's own timeout is 30 minutes): every rank must have confirmed an exchange in the
#: group's store within this many seconds after the last rank reached it (confirmations take milliseconds), or it is
#: given up; a rank that has not learned the outcome by then waits as long again, then raises. So a rank settles
#: within ``2 x SETTLE_BOUND_S`` after the last rank reached the exchange, and a rank that timed out within
#: ``3 x SETTLE_BOUND_S`` plus :data:`COMPLETION_GRACE_S` after its timeout, whatever the store's host does.
SETTLE_BOUND_S = 3.0
#: How long a rank polls the store back to back once it confirmed, before it sleeps :data:`_POLL_S` between polls:
#: confirmations normally arrive within this, and a tight poll keeps short the one window the settlement leaves
#: (see :meth:`_Outcome.confirm`).
_FAST_POLL_S = 0.05
_POLL_S = 0.001
#: Values of an exchange's key in the store: ``c:<hex mask of the ranks that confirmed>``, then ``done`` once every
#: rank did, or ``gave-up:<rank>``; the last two are final.
_CLAIMS, _DONE, _GAVE_UP = "c:", "done", "gave-up:"
#: What :meth:`_Outcome._read` compares with: never a value of the key, so the compare-and-set never writes.
_ABSENT = "\0absent"

_sequence_lock = threading.Lock()
#: Per process group object (held weakly: a destroyed group takes its numbering with it): ``[epoch, exchanges
#: issued so far]``.
_sequences: weakref.WeakKeyDictionary[object, list[int]] = weakref.WeakKeyDictionary()


def _numbering(group: object, world: int) -> list[int]:
    entry = _sequences.get(group)
    if entry is None:
        # Every rank adds 1 once per group object, before its first exchange on it, which no rank completes without
        # the others: the k-th group object built on this store gets epoch k on every rank.
        store = _group_store(group)
        epoch = 0
        if store is not None:
            try:
                epoch = (int(store.add(f"{OUTCOME_PREFIX}/epochs", 1)) - 1) // world  # type: ignore[attr-defined]
            except Exception:
                epoch = 0
        entry = _sequences[group] = [epoch, 0]
    return entry


def _next_sequence(group: object, world: int) -> tuple[int, int]:
    """This exchange's ``(epoch, number)`` on ``group``."""
    with _sequence_lock:
        entry = _numbering(group, world)
        entry[1] += 1
        return entry[0], entry[1] - 1


def _resync_sequence(group: object, world: int, next_n: int) -> None:
    with _sequence_lock:
        _numbering(group, world)[1] = next_n


def _group_store(group: object) -> object | None:
    """The store ``group`` was built on (a prefixed view for a subgroup), or ``None`` if torch does not say."""
    try:
        from torch.distributed import distributed_c10d as c10d

        return c10d._get_process_group_store(group)  # type: ignore[arg-type]
    except Exception:
        return None


class Status(IntEnum):
    OK = 0
    STOPPED = 1  # the consumer stopped early: break, close(), or an exception in the consumer's loop body
    FAILED = 2  # the stream itself raised on that rank (gather, merge, ...)
    TIMEOUT = 3
    REFUSED = 4  # a sink on that rank could not go on (its agreement, outside or between passes)


#: Bytes of the reason a stopping rank sends along (UTF-8, truncated): enough to name the error and the tensors.
REASON_BYTES = 1024
_REASON_WORDS = REASON_BYTES // 8
_FLAG_BITS = 62
#: Flags a rank in a pass's exchange can send along its OK status (in its reason's words, which an OK status does
#: not use): what a gatherer needs every rank to agree on before a group (ZeRO-3's path agreement), so that it needs
#: no collective of its own. The buffer's size never changes, so a rank in a pass's exchange still pairs with a rank
#: in a sink's agreement.
FLAG_CAPACITY = _REASON_WORDS * _FLAG_BITS

_WHY = {
    Status.STOPPED: "stopped iterating early (break, close(), or an exception in its consumer)",
    Status.FAILED: "failed while producing the stream",
    Status.TIMEOUT: "timed out waiting for its peers",
    Status.REFUSED: "could not go on",
}


class Lockstep:
    """One status exchange per group boundary over ``group``.

    ``plan_digest`` (a hash of the stream's metadata) rides along, so ranks whose plans differ -- a different
    ``group_by`` or model on one rank -- fail at the first exchange with a clear error instead of mismatching
    gathers.
    """

    def __init__(self, group: object | None, plan_digest: str, timeout: datetime.timedelta) -> None:
        self.group = group
        self.rank = dist.get_rank(group)  # type: ignore[arg-type]
        self.world = dist.get_world_size(group)  # type: ignore[arg-type]
        self.digest = zlib.crc32(plan_digest.encode()) & 0x7FFFFFFF
        self.timeout = timeout
        self.closed = False
        self._words = torch.zeros(self.world, _REASON_WORDS, dtype=torch.int64)
        backend = dist.get_backend(group)  # type: ignore[arg-type]
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")

    def exchange(
        self, status: Status, where: str, reason: str = "", flags: Sequence[bool] | None = None
    ) -> list[bool] | None:
        """Contribute ``status`` (and, when stopping, ``reason``); raise :class:`StreamAbortedError` if another rank
        reported a stop, with that rank's reason.

        ``flags`` (with ``Status.OK`` only, at most :data:`FLAG_CAPACITY`; every rank passes as many) ride along in
        the same ``all_reduce``: returns each flag ANDed over every rank (``None`` without ``flags``)."""
        if self.closed:
            return None
        if flags is not None and (status != Status.OK or reason or len(flags) > FLAG_CAPACITY):
            raise ValueError(f"flags go with an OK status and no reason, at most {FLAG_CAPACITY} of them")
        statuses, reasons = self.statuses(status, where, reason, flags)
        bad = tuple(r for r, s in enumerate(statuses) if s != Status.OK and r != self.rank)
        if bad and status == Status.OK:
            raise StreamAbortedError(
                f"rank {self.rank}: stream aborted {where}: {describe_stops(statuses, reasons, bad)}", failed_ranks=bad
            )
        if flags is None:
            return None
        words = self._words[0].clone()
        for r in range(1, self.world):
            words &= self._words[r]
        agreed = words.tolist()
        return [bool(agreed[i // _FLAG_BITS] >> (i % _FLAG_BITS) & 1) for i in range(len(flags))]

    def statuses(
        self, status: Status, where: str, reason: str = "", flags: Sequence[bool] | None = None
    ) -> tuple[list[int], list[str]]:
        """One exchange: every rank's status and reason. Raises :class:`StreamAbortedError` only if the exchange
        itself fails (a peer died, the wait timed out, or the ranks planned different streams).

        One ``all_reduce`` of a fixed-size buffer, whatever the caller: a rank in a pass's exchange and a rank in a
        sink's agreement (:class:`~lora_stream.coordination.Coordinator`) pair up and both learn the outcome, so no
        second collective is ever needed to carry the reason.
        """
        if status != Status.OK:
            self.closed = True
        w = self.world
        pg = self.group if self.group is not None else dist.distributed_c10d._get_default_group()
        epoch, seq = _next_sequence(pg, w)
        buf = torch.zeros(4 * w + w * _REASON_WORDS, dtype=torch.int64, device=self.device)
        buf[self.rank] = int(status)
        buf[w + self.rank] = self.digest
        buf[2 * w + self.rank] = seq
        # When this rank reached the exchange (wall clock, comparable across hosts): the settlement's bound counts
        # from the last rank's, the same instant on every rank.
        buf[3 * w + self.rank] = time.time_ns()
        if reason:
            raw = reason.encode("utf-8")[:REASON_BYTES].ljust(REASON_BYTES, b"\0")
            words = torch.frombuffer(bytearray(raw), dtype=torch.int64)
            start = 4 * w + self.rank * _REASON_WORDS
            buf[start : start + _REASON_WORDS] = words.to(self.device)
        elif flags:  # packed into the reason's words, which an OK status leaves unused (see exchange)
            packed = [0] * _REASON_WORDS
            for i, flag in enumerate(flags):
                if flag:
                    packed[i // _FLAG_BITS] |= 1 << (i % _FLAG_BITS)
            start = 4 * w + self.rank * _REASON_WORDS
            buf[start : start + _REASON_WORDS] = torch.tensor(packed, dtype=torch.int64, device=self.device)
        outcome = _Outcome(pg, epoch, self.digest, seq, self.rank, w)
        failure: BaseException | None = None
        work = None
        try:
            work = dist.all_reduce(buf, group=self.group, async_op=True)  # type: ignore[arg-type]
            ok = work.wait(timeout=self.timeout)
        except Exception as exc:  # the transport failed: a peer died, or the wait timed out
            ok, failure = False, exc
        if ok is False:
            # Settle the exchange as given up, unless a peer already confirmed completing it: then every
            # contribution had arrived, and ours completes too; confirming it keeps this rank's outcome the peers'.
            state = outcome.give_up()
            if not (state is not None and state.startswith(_CLAIMS) and _completes(work)):
                if state is not None and state.startswith(_CLAIMS):
                    outcome.abandon(state)  # its peers must not wait for a confirmation that never comes
                self.closed = True
                if failure is not None and "timed out" not in str(failure).lower():
                    raise StreamAbortedError(
                        f"rank {self.rank}: status exchange {where} failed ({type(failure).__name__}: {failure}); a "
                        "peer rank probably died or stopped iterating without closing its stream",
                        lost=True,
                    ) from failure
                unheard = state is None and outcome.store is not None
                unheard_note = " (the group's store did not answer: its host is stopped or gone)" if unheard else ""
                raise StreamAbortedError(
                    f"rank {self.rank}: status exchange {where} timed out after {self.timeout}; this rank gave it up "
                    f"(a peer that reaches it later raises too){unheard_note}",
                    lost=True,
                ) from failure
        posted = buf[3 * w : 4 * w].cpu()
        # Capped by this rank's own clock: a peer's clock far ahead must not stretch this rank's wait.
        settle_by = min(float(posted.max()) / 1e9, time.time()) + SETTLE_BOUND_S
        verdict, detail = outcome.confirm(settle_by)
        if verdict != _DONE:
            self.closed = True
            if verdict == _GAVE_UP and detail == self.rank:
                missing = tuple(r for r in range(w) if not outcome.seen >> r & 1)
                raise StreamAbortedError(
                    f"rank {self.rank}: status exchange {where} completed here, but rank(s) {list(missing)} did not "
                    f"confirm it within {SETTLE_BOUND_S} s of the last rank reaching it (stopped, or starved); this "
                    "rank gave it up, and every rank raises",
                    failed_ranks=missing,
                    lost=True,
                )
            if verdict == _GAVE_UP:
                raise StreamAbortedError(
                    f"rank {self.rank}: status exchange {where} was given up by rank {detail}, which stopped "
                    f"waiting for its peers (its timeout, or their confirmations); this rank reached it too late",
                    failed_ranks=(int(str(detail)),),
                    lost=True,
                )
            raise StreamAbortedError(
                f"rank {self.rank}: status exchange {where} completed on this rank, but its outcome could not be "
                f"settled within the bound ({detail}); this rank cannot know what its peers concluded, so it gives "
                "the exchange up, as every peer does that cannot learn it was done in time",
                lost=True,
            )
        host = buf.cpu()
        statuses: list[int] = host[:w].tolist()
        digests = host[w : 2 * w].tolist()
        sequences = host[2 * w : 3 * w].tolist()
        if len(set(sequences)) != 1:
            # Ranks ran different numbers of exchanges on this group: fail here, on every rank alike, and number
            # the next exchange the same everywhere.
            _resync_sequence(pg, w, max(sequences) + 1)
            self.closed = True
            raise StreamAbortedError(
                f"rank {self.rank}: ranks reached this status exchange {where} at different points (exchange "
                f"numbers {sequences}): a sink or stream ran a different number of agreements on some rank"
            )
        if len(set(digests)) != 1:
            self.closed = True
            raise StreamAbortedError(
                f"rank {self.rank}: ranks planned different streams (metadata digests {digests}); every rank must "
                "stream the same model with the same options, or their gathers would not match"
            )
        if any(s != Status.OK for s in statuses):
            self.closed = True
        self._words = host[4 * w :].view(w, _REASON_WORDS)
        raw_reasons = host[4 * w :].numpy().tobytes()
        reasons = [
            raw_reasons[r * REASON_BYTES : (r + 1) * REASON_BYTES].rstrip(b"\0").decode("utf-8", "replace")
            for r in range(w)
        ]
        return statuses, reasons


class _Outcome:
    """One exchange's outcome in the group's store: every rank's confirmation, then ``done``; or ``gave-up:<rank>``.

    Every change is a compare-and-set of one key, so the two outcomes exclude each other: ``done`` needs every rank's
    confirmation, and once a rank gave the exchange up, no confirmation is added. A rank's calls to the store run on
    a thread of their own (:func:`_bounded`, :meth:`confirm`): a store whose host process is stopped (``SIGSTOP``, a
    GC pause) accepts requests into its socket and answers only when the host runs again, and the store's own
    timeout is 30 minutes.

    Without a store (torch does not expose the group's), nothing is settled: an exchange a rank gave up on can then
    still complete on a late peer, as before."""

    def __init__(self, group: object, epoch: int, digest: int, seq: int, rank: int, world: int) -> None:
        self.store = _group_store(group)
        self.key = f"{OUTCOME_PREFIX}/{epoch}/{digest}/{seq}"
        self.previous = f"{OUTCOME_PREFIX}/{epoch}/{digest}/{seq - 1}" if seq > 0 else None
        self.rank = rank
        self._bit = 1 << rank
        self._full = (1 << world) - 1
        self._world = world
        #: The confirmations seen when this rank gave the exchange up (for its error's message).
        self.seen = 0

    def _cas(self, expected: str, desired: str) -> str:
        return bytes(self.store.compare_set(self.key, expected, desired)).decode()  # type: ignore[attr-defined]

    def _read(self) -> str:
        """The key's value, ``""`` if unset (a compare-and-set that never matches: it only reads)."""
        got = self._cas(_ABSENT, _ABSENT)
        return "" if got == _ABSENT else got

    def _claim(self) -> str:
        """Add this rank's confirmation: the state after it, or the final state that refused it."""
        state = ""
        while not _final(state):
            mask = _mask(state) | self._bit
            desired = _DONE if mask == self._full else f"{_CLAIMS}{mask:x}"
            got = self._cas(state, desired)
            if got == desired:  # only this rank adds its own bit, so this value is this rank's write
                return got
            state = got
        return state

    def _veto(self, state: str) -> str:
        """Settle the exchange given up by this rank, unless it is already final: the final state."""
        mine = f"{_GAVE_UP}{self.rank}"
        while not _final(state):
            self.seen = _mask(state)
            got = self._cas(state, mine)
            if got == mine:
                return got
            state = got
        return state

    def give_up(self) -> str | None:
        """This rank's ``all_reduce`` timed out: settle the exchange given up, unless a peer confirmed it (then
        every contribution had arrived: the caller waits for its own completion and confirms it too). The state:
        ``gave-up:<rank>`` (this rank's, or a peer's first), peers' confirmations, or ``None``: no answer within
        :data:`SETTLE_BOUND_S` (no store, or its host is stopped or gone): this rank raises. Its request stays
        queued in a stopped store, and it can only settle the exchange given up, never add a confirmation, so no
        peer can take it done: a done exchange needs this rank's confirmation."""
        if self.store is None:
            return None
        mine = f"{_GAVE_UP}{self.rank}"
        return _bounded(lambda: self._cas("", mine), SETTLE_BOUND_S)

    def abandon(self, state: str) -> None:
        """Give up an exchange some peers confirmed but this rank never completed (best effort, bounded): they
        raise at once instead of at their bound."""
        if self.store is not None:
            _bounded(lambda: self._veto(state), SETTLE_BOUND_S)

    def confirm(self, settle_by: float) -> tuple[str, object]:
        """This rank's ``all_reduce`` completed: ``("done", None)``: return; ``("gave-up", rank)``: given up by
        ``rank`` (this rank's own when a peer's confirmation was missing at ``settle_by``); ``("unsettled",
        why)``: raise. ``settle_by`` (wall clock) is :data:`SETTLE_BOUND_S` after the last rank reached the
        exchange, the same instant on every rank.

        On a thread of its own, this rank confirms, then polls the store until the state is final; at
        ``settle_by`` it gives the exchange up if it still is not. The caller waits until ``settle_by``; a rank
        that learned ``done`` by then returns, and records that it did (the key's ``/returned`` counter). Past it,
        the caller waits :data:`SETTLE_BOUND_S` more: a rank that learns ``done`` only now returns if a peer
        recorded it returned in time -- a rank that was itself stopped after confirming, while its peers went on --
        and raises otherwise; a rank that learns nothing raises.

        Why every rank ends alike when the store's host is stopped, however long: a rank that cannot hear the store
        raises, and no rank can have learned ``done`` in time while that rank was left unheard, unless the host
        stopped after settling ``done`` and before answering every peer's next poll. That is the one window: the
        stop must begin within one poll (back to back for :data:`_FAST_POLL_S`, then every :data:`_POLL_S`) after
        the last confirmation, and last past the bound; then the ranks answered before it return and the others
        raise. A rank that learns ``done`` late because its host was stopped (rank 0's process hosts the store
        under ``env://``) finds no peer that returned in time, and raises with them."""
        if self.store is None:
            return _DONE, None
        lock = threading.Lock()
        ready = threading.Event()
        drained = threading.Event()
        box: dict[str, object] = {"verdict": None, "late": False, "abandoned": False}
        returned_key = f"{self.key}/returned"

        def decide(verdict: tuple[str, object]) -> bool:
            with lock:
                if box["abandoned"] or box["verdict"] is not None:
                    return False
                box["verdict"] = verdict
            ready.set()
            return True

        def returned() -> None:
            """Record that this rank returned (a peer that learns ``done`` late returns on it). Rank 0, whose
            process hosts the store under ``env://``, then waits (bounded) until every rank recorded it: a rank
            still polling for ``done`` must not find the store gone because rank 0 returned and its program ended."""
            count = int(self.store.add(returned_key, 1))  # type: ignore[attr-defined]
            if self.rank == 0:
                began = time.monotonic()
                while count < self._world and time.monotonic() - began < SETTLE_BOUND_S:
                    time.sleep(_POLL_S)
                    count = int(self.store.add(returned_key, 0))  # type: ignore[attr-defined]
                self._forget_previous()
            drained.set()

        def run() -> None:
            try:
                state = self._claim()
                began = time.monotonic()
                while not _final(state):
                    if time.time() >= settle_by:
                        state = self._veto(state)
                        break
                    if time.monotonic() - began > _FAST_POLL_S:
                        time.sleep(_POLL_S)
                    state = self._read()
                if state.startswith(_GAVE_UP):
                    decide((_GAVE_UP, int(state[len(_GAVE_UP) :])))
                    return
                with lock:
                    # Decided under the lock that the caller takes when the bound runs out: in time, or late.
                    in_time = not box["late"] and not box["abandoned"] and time.time() <= settle_by
                if in_time:
                    decide((_DONE, None))
                    returned()
                    return
                learned = time.monotonic()
                while time.monotonic() - learned < SETTLE_BOUND_S and not box["abandoned"]:
                    if int(self.store.add(returned_key, 0)) > 0:  # type: ignore[attr-defined]
                        if decide((_DONE, None)):
                            returned()
                        return
                    time.sleep(_POLL_S)
                decide(
                    (
                        "unsettled",
                        "it was done, but this rank learned it only after the bound, and no rank had "
                        "returned it in time",
                    )
                )
            except Exception as exc:  # the store is gone with its host: nothing left to settle with
                decide(("unsettled", f"the group's store failed: {type(exc).__name__}: {exc}"))

        threading.Thread(target=run, name="lora_stream-settle", daemon=True).start()
        ready.wait(max(0.0, settle_by - time.time()))
        with lock:
            if box["verdict"] is None:
                box["late"] = True
        if box["verdict"] is None:
            ready.wait(SETTLE_BOUND_S)
        with lock:
            if box["verdict"] is None:
                box["abandoned"] = True
                return "unsettled", (
                    f"the group's store did not answer within {SETTLE_BOUND_S} s of the last rank reaching it, and "
                    "as long again: its host is stopped or unreachable"
                )
            verdict = box["verdict"]
        if verdict[0] == _DONE and self.rank == 0:  # type: ignore[index]
            drained.wait(SETTLE_BOUND_S)
        return verdict  # type: ignore[return-value]

    def _forget_previous(self) -> None:
        """Every rank posted this exchange, so every rank is done with the previous one: drop its keys (rank 0)."""
        if self.previous is not None and self.rank == 0:
            try:
                self.store.delete_key(self.previous)  # type: ignore[attr-defined]
                self.store.delete_key(f"{self.previous}/returned")  # type: ignore[attr-defined]
            except Exception:
                pass


def _final(state: str) -> bool:
    return state == _DONE or state.startswith(_GAVE_UP)


def _mask(state: str) -> int:
    return int(state[len(_CLAIMS) :], 16) if state.startswith(_CLAIMS) else 0


def _bounded(call: Callable[[], str], bound: float) -> str | None:
    """``call()`` on a daemon thread, waited for ``bound`` seconds: ``None`` if it did not answer by then or
    failed (the store is gone with its host). The request stays queued in a stopped store meanwhile."""
    out: list[str | None] = [None]

    def run() -> None:
        try:
            out[0] = call()
        except Exception:
            out[0] = None

    thread = threading.Thread(target=run, name="lora_stream-settle", daemon=True)
    thread.start()
    thread.join(bound)
    return out[0]


def _completes(work: object | None) -> bool:
    """Wait a little more for an ``all_reduce`` a peer found complete; ``False`` if it still does not complete."""
    if work is None:
        return False
    deadline = time.monotonic() + COMPLETION_GRACE_S
    try:
        while not work.is_completed():  # type: ignore[attr-defined]
            if time.monotonic() > deadline:
                return False
            time.sleep(0.001)
        work.wait()  # type: ignore[attr-defined]
    except Exception:
        return False
    return True


def describe_error(error: BaseException | None) -> str:
    """The reason a rank sends when ``error`` stopped it (``""`` for none); the exchange truncates it to
    :data:`REASON_BYTES`."""
    return "" if error is None else f"{type(error).__name__}: {error}"


def describe_stops(statuses: list[int], reasons: list[str], ranks: tuple[int, ...]) -> str:
    """``rank 1 failed while producing the stream (ValueError: ...)``, for each of ``ranks``."""
    parts = []
    for r in ranks:
        why = _WHY.get(Status(statuses[r]), "stopped")
        parts.append(f"rank {r} {why}" + (f" ({reasons[r]})" if reasons[r] else ""))
    return "; ".join(parts)
