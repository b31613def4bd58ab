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
outcome is settled once, first writer wins, in the group's store: a rank whose ``all_reduce`` completed claims it
``done``; a rank that gave up claims it ``gave up``. A late peer that finds the exchange given up raises
:class:`~lora_stream.StreamAbortedError` naming the rank that left, and a rank that timed out a moment after every
peer completed takes the completed result instead of raising alone. The number rides in the exchange too: ranks that
disagree on it (an exchange issued outside this module) fail there, and number the next one alike again.
"""

from __future__ import annotations

import datetime
import threading
import time
import weakref
import zlib
from collections.abc import Sequence
from enum import IntEnum

import torch
import torch.distributed as dist

from .errors import StreamAbortedError

__all__ = ["FLAG_CAPACITY", "REASON_BYTES", "Lockstep", "Status", "describe_error", "describe_stops"]

#: Prefix of the keys that settle each exchange's outcome in the group's store (``<prefix>/<epoch>/<digest>/<n>``:
#: ``epoch`` numbers the process group objects built on that store, so that a group built again -- torch may give it
#: the same name and store -- never reads an outcome of the previous one).
OUTCOME_PREFIX = "lora_stream/lockstep"
#: How long a rank that timed out waits more for its own ``all_reduce`` once a peer claimed that exchange completed
#: (every contribution had arrived, so it completes at once unless this process is starved).
COMPLETION_GRACE_S = 10.0
#: How long a rank waits for the store to settle an exchange (the store's own timeout is 30 minutes): past it, no
#: answer is taken as the rank's own claim (see :meth:`_Outcome._settle`), so a stopped store host cannot hold a
#: peer past its deadline.
SETTLE_BOUND_S = 5.0

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
        buf = torch.zeros(3 * w + w * _REASON_WORDS, dtype=torch.int64, device=self.device)
        buf[self.rank] = int(status)
        buf[w + self.rank] = self.digest
        buf[2 * w + self.rank] = seq
        if reason:
            raw = reason.encode("utf-8")[:REASON_BYTES].ljust(REASON_BYTES, b"\0")
            words = torch.frombuffer(bytearray(raw), dtype=torch.int64)
            start = 3 * w + self.rank * _REASON_WORDS
            buf[start : start + _REASON_WORDS] = words.to(self.device)
        elif flags:  # packed into the reason's words, which an OK status leaves unused (see exchange)
            packed = [0] * _REASON_WORDS
            for i, flag in enumerate(flags):
                if flag:
                    packed[i // _FLAG_BITS] |= 1 << (i % _FLAG_BITS)
            start = 3 * w + self.rank * _REASON_WORDS
            buf[start : start + _REASON_WORDS] = torch.tensor(packed, dtype=torch.int64, device=self.device)
        outcome = _Outcome(pg, epoch, self.digest, seq, self.rank)
        failure: BaseException | None = None
        work = None
        try:
            work = dist.all_reduce(buf, group=self.group, async_op=True)  # type: ignore[arg-type]
            ok = work.wait(timeout=self.timeout)
        except Exception as exc:  # the transport failed: a peer died, or the wait timed out
            ok, failure = False, exc
        if ok is False:
            # Settle the exchange as given up, unless a peer already completed it: then every contribution had
            # arrived, and ours completes too; taking it keeps this rank's outcome the same as the peers'.
            if not (outcome.claim_gave_up() and _completes(work)):
                self.closed = True
                if failure is not None and "timed out" not in str(failure).lower():
                    raise StreamAbortedError(
                        f"rank {self.rank}: status exchange {where} failed ({type(failure).__name__}: {failure}); a "
                        "peer rank probably died or stopped iterating without closing its stream",
                        lost=True,
                    ) from failure
                raise StreamAbortedError(
                    f"rank {self.rank}: status exchange {where} timed out after {self.timeout}; this rank gave it up "
                    "(a peer that reaches it later raises too)",
                    lost=True,
                ) from failure
        else:
            gave_up = outcome.claim_done()
            if gave_up is not None:
                self.closed = True
                raise StreamAbortedError(
                    f"rank {self.rank}: status exchange {where} was given up by rank {gave_up}, which stopped "
                    f"waiting for its peers after its timeout; this rank reached it too late",
                    failed_ranks=(gave_up,),
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
        self._words = host[3 * w :].view(w, _REASON_WORDS)
        raw_reasons = host[3 * w :].numpy().tobytes()
        reasons = [
            raw_reasons[r * REASON_BYTES : (r + 1) * REASON_BYTES].rstrip(b"\0").decode("utf-8", "replace")
            for r in range(w)
        ]
        return statuses, reasons


class _Outcome:
    """One exchange's settled outcome in the group's store: ``done`` or ``gave-up:<rank>``, first writer wins.

    Without a store (torch does not expose the group's), nothing is settled: an exchange a rank gave up on can then
    still complete on a late peer, as before."""

    def __init__(self, group: object, epoch: int, digest: int, seq: int, rank: int) -> None:
        self.store = _group_store(group)
        self.key = f"{OUTCOME_PREFIX}/{epoch}/{digest}/{seq}"
        self.previous = f"{OUTCOME_PREFIX}/{epoch}/{digest}/{seq - 1}" if seq > 0 else None
        self.rank = rank

    def _settle(self, value: str) -> str | None:
        """``compare_set`` of this exchange's key, within :data:`SETTLE_BOUND_S`; ``None``: no answer (no store,
        the store is gone with its host, or its host is stopped).

        The call runs on a daemon thread: a store whose host process is stopped (``SIGSTOP``, a GC pause) accepts
        the request into its socket and answers only when the host runs again, and the store's own timeout is 30
        minutes. The request stays queued meanwhile, so the host, once it runs again, finds it settled as this
        rank claimed before it can claim anything itself (its own claim comes after its ``all_reduce``, which
        needs this rank's contribution, long in flight)."""
        if self.store is None:
            return None
        store, key = self.store, self.key
        out: list[str | None] = [None]

        def call() -> None:
            try:
                out[0] = bytes(store.compare_set(key, "", value)).decode()  # type: ignore[attr-defined]
            except Exception:  # the store is gone with its host (rank 0's process): nothing left to settle with
                out[0] = None

        thread = threading.Thread(target=call, name="lora_stream-settle", daemon=True)
        thread.start()
        thread.join(SETTLE_BOUND_S)
        return out[0]

    def claim_done(self) -> int | None:
        """This rank's ``all_reduce`` completed: the rank that gave the exchange up first, or ``None`` (done). No
        answer within the bound counts as done: every rank had contributed, and this rank's claim, queued in the
        store, settles it so for a stopped host that claims after it runs again."""
        settled = self._settle("done")
        if settled is not None and settled.startswith("gave-up:"):
            return int(settled.split(":", 1)[1])
        if settled == "done" and self.previous is not None and self.rank == 0:
            # Every rank posted this exchange, so every rank is done with the previous one: drop its key.
            try:
                self.store.delete_key(self.previous)  # type: ignore[attr-defined]
            except Exception:
                pass
        return None

    def claim_gave_up(self) -> bool:
        """This rank stops waiting: whether a peer had already completed the exchange (then it stands). No answer
        from the store within its bound is "given up": this rank raises, and its claim, queued in the store, is what
        a stopped host finds when it runs again."""
        return self._settle(f"gave-up:{self.rank}") == "done"


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
