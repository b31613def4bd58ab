"""The trainer ranks' agreement on a sink's decisions: can every rank go on?

A sink talks to its engine from one rank (the server sink's sender) or from every rank (the colocated sink), but the
stream's gathers are collectives on every rank. When rank 0 finds the server down before a sync, or the server
refuses the update after it, every other rank must learn it -- with the reason -- instead of gathering on, or
waiting at the next collective for a partner that will not come. :class:`Coordinator` is that one agreement, outside
any pass over the stream; the stream's own per-group exchanges (:mod:`lora_stream.lockstep`) cover what happens
inside a pass.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence

import torch.distributed as dist

from .errors import StreamAbortedError
from .lockstep import FLAG_CAPACITY, REASON_BYTES, Lockstep, Status, describe_stops

__all__ = ["Coordinator", "this_rank"]


def this_rank() -> int:
    """This process's rank in ``torch.distributed``'s default group, or 0 when it is not initialized."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class Coordinator:
    """Agreement between the ranks of one process group, with the reasons of the ranks that cannot go on.

    ``group=None`` with ``torch.distributed`` not initialized, or a group of one rank, makes every call a no-op: a
    single process has no one to tell.

    Args:
        group: the process group of the stream's gatherer (what ``ParamStream.coordinator`` passes).
        digest: a description of what the ranks are about to do (the stream's plan); ranks that disagree on it fail
            at once instead of mismatching collectives later.
        timeout: how long a rank waits for the others.
    """

    def __init__(self, group: object | None, digest: str, timeout: datetime.timedelta, *, active: bool = True) -> None:
        self.group = group
        self.digest = digest
        self.timeout = timeout
        self.active = (
            active and dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1  # type: ignore[arg-type]
        )

    def over_default_group(self) -> Coordinator:
        """The same agreement (digest, timeout) over ``torch.distributed``'s default group, taking part wherever that
        group has peers: what a sync of a stream whose gatherer does not communicate agrees over (one process per
        rank under DDP may share one engine, so a rank that refused must stop the others too)."""
        return Coordinator(None, self.digest, self.timeout)

    def agree(self, ok: bool, what: str, reason: str = "") -> None:
        """Every rank says whether it can go on; if any cannot, every *other* rank raises.

        Called by every rank, in the same order (it is a collective). A rank passing ``ok=False`` returns normally
        -- it raises its own error afterwards -- and its ``reason`` reaches the others inside their
        :class:`~lora_stream.StreamAbortedError`, whose ``failed_ranks`` names it (first :data:`REASON_BYTES` of
        it). The exchange is the stream's own status exchange, so a peer that is still inside a pass over the stream
        learns the outcome there, reason included. A peer that died or never calls makes this raise after
        ``timeout``.
        """
        if not self.active:
            return
        lock = Lockstep(self.group, self.digest, self.timeout)
        statuses, reasons = lock.statuses(Status.OK if ok else Status.REFUSED, what, "" if ok else reason)
        bad = tuple(r for r, s in enumerate(statuses) if s != Status.OK and r != lock.rank)
        if bad and ok:
            raise StreamAbortedError(
                f"rank {lock.rank}: stopped {what}: {describe_stops(statuses, reasons, bad)}", failed_ranks=bad
            )

    def any_of(self, bits: Sequence[bool], what: str) -> list[bool]:
        """Every rank contributes the same number of ``bits`` (at most :data:`~lora_stream.lockstep.FLAG_CAPACITY`);
        returns, for each, whether it was set on any rank. A collective of a fixed size whatever the bits say (one
        status exchange), so it never overflows and pairs with any other agreement. Inactive: ``bits``."""
        if len(bits) > FLAG_CAPACITY:
            raise ValueError(f"any_of: {len(bits)} bits, more than the exchange carries ({FLAG_CAPACITY})")
        if not self.active:
            return list(bits)
        lock = Lockstep(self.group, self.digest, self.timeout)
        # The exchange ANDs its flags: OR is the complement of the AND of the complements.
        agreed = lock.exchange(Status.OK, what, flags=[not b for b in bits]) or []
        return [not b for b in agreed]

    def share(self, text: str, what: str = "sharing a sink's outcome") -> list[str]:
        """Every rank contributes ``text`` (at most :data:`~lora_stream.lockstep.REASON_BYTES` of UTF-8) and gets
        every rank's, by rank. A collective, like :meth:`agree`; inactive (one process): ``[text]``."""
        if not self.active:
            return [text]
        lock = Lockstep(self.group, self.digest, self.timeout)
        if len(text.encode("utf-8")) > REASON_BYTES:
            raise ValueError(f"share: {len(text.encode())} bytes, more than the exchange carries ({REASON_BYTES})")
        _, texts = lock.statuses(Status.OK, what, text)
        return texts
