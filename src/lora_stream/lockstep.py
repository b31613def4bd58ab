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
"""

from __future__ import annotations

import datetime
import zlib
from collections.abc import Sequence
from enum import IntEnum

import torch
import torch.distributed as dist

from .errors import StreamAbortedError

__all__ = ["FLAG_CAPACITY", "REASON_BYTES", "Lockstep", "Status", "describe_error", "describe_stops"]


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
        buf = torch.zeros(2 * w + w * _REASON_WORDS, dtype=torch.int64, device=self.device)
        buf[self.rank] = int(status)
        buf[w + self.rank] = self.digest
        if reason:
            raw = reason.encode("utf-8")[:REASON_BYTES].ljust(REASON_BYTES, b"\0")
            words = torch.frombuffer(bytearray(raw), dtype=torch.int64)
            start = 2 * w + self.rank * _REASON_WORDS
            buf[start : start + _REASON_WORDS] = words.to(self.device)
        elif flags:  # packed into the reason's words, which an OK status leaves unused (see exchange)
            packed = [0] * _REASON_WORDS
            for i, flag in enumerate(flags):
                if flag:
                    packed[i // _FLAG_BITS] |= 1 << (i % _FLAG_BITS)
            start = 2 * w + self.rank * _REASON_WORDS
            buf[start : start + _REASON_WORDS] = torch.tensor(packed, dtype=torch.int64, device=self.device)
        try:
            work = dist.all_reduce(buf, group=self.group, async_op=True)  # type: ignore[arg-type]
            ok = work.wait(timeout=self.timeout)
        except Exception as exc:  # the transport failed: a peer died or the wait timed out
            self.closed = True
            raise StreamAbortedError(
                f"rank {self.rank}: status exchange {where} failed ({type(exc).__name__}: {exc}); a peer rank "
                "probably died or stopped iterating without closing its stream"
            ) from exc
        if ok is False:
            self.closed = True
            raise StreamAbortedError(f"rank {self.rank}: status exchange {where} timed out after {self.timeout}")
        host = buf.cpu()
        statuses: list[int] = host[:w].tolist()
        digests = host[w : 2 * w].tolist()
        if len(set(digests)) != 1:
            self.closed = True
            raise StreamAbortedError(
                f"rank {self.rank}: ranks planned different streams (metadata digests {digests}); every rank must "
                "stream the same model with the same options, or their gathers would not match"
            )
        if any(s != Status.OK for s in statuses):
            self.closed = True
        self._words = host[2 * w :].view(w, _REASON_WORDS)
        raw_reasons = host[2 * w :].numpy().tobytes()
        reasons = [
            raw_reasons[r * REASON_BYTES : (r + 1) * REASON_BYTES].rstrip(b"\0").decode("utf-8", "replace")
            for r in range(w)
        ]
        return statuses, reasons


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
