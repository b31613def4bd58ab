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
from enum import IntEnum

import torch
import torch.distributed as dist

from .errors import StreamAbortedError

__all__ = ["Status", "Lockstep"]


class Status(IntEnum):
    OK = 0
    STOPPED = 1  # the consumer stopped early: break, close(), or an exception in the consumer's loop body
    FAILED = 2  # the stream itself raised on that rank (gather, merge, ...)
    TIMEOUT = 3


_WHY = {
    Status.STOPPED: "stopped iterating early (break, close(), or an exception in its consumer)",
    Status.FAILED: "failed while producing the stream",
    Status.TIMEOUT: "timed out waiting for its peers",
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
        backend = dist.get_backend(group)  # type: ignore[arg-type]
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")

    def exchange(self, status: Status, where: str) -> None:
        """Contribute ``status``; raise :class:`StreamAbortedError` if another rank reported a stop."""
        if self.closed:
            return
        statuses = self.statuses(status, where)
        bad = tuple(r for r, s in enumerate(statuses) if s != Status.OK and r != self.rank)
        if bad and status == Status.OK:
            reasons = "; ".join(f"rank {r} {_WHY.get(Status(statuses[r]), 'stopped')}" for r in bad)
            raise StreamAbortedError(f"rank {self.rank}: stream aborted {where}: {reasons}", failed_ranks=bad)

    def statuses(self, status: Status, where: str) -> list[int]:
        """One exchange: every rank's status. Raises :class:`StreamAbortedError` only if the exchange itself fails
        (a peer died, the wait timed out, or the ranks planned different streams)."""
        if status != Status.OK:
            self.closed = True
        buf = torch.zeros(2 * self.world, dtype=torch.int64, device=self.device)
        buf[self.rank] = int(status)
        buf[self.world + self.rank] = self.digest
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
        statuses: list[int] = buf[: self.world].tolist()
        digests = buf[self.world :].tolist()
        if len(set(digests)) != 1:
            self.closed = True
            raise StreamAbortedError(
                f"rank {self.rank}: ranks planned different streams (metadata digests {digests}); every rank must "
                "stream the same model with the same options, or their gathers would not match"
            )
        if any(s != Status.OK for s in statuses):
            self.closed = True
        return statuses
