"""What a sink knows, between syncs, about what its engines hold: the fingerprints of the last committed sync, the
engine-side merge's base, and how many syncs committed (what ``verify=N`` and the verification's history count).

Step 1 (:mod:`lora_stream.sinks.decide`) reads it; step 4 (:mod:`lora_stream.sinks.conclude`) writes it, after every
sync, committed or not: a failed sync leaves nothing known, so the next one sends every output. One per sink; it is
this rank's view (every rank keeps its own, and the agreements in step 1 make the decision common).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..changes import SyncedSources
from ..elements import ElementBaseline
from .engine_base import EngineBaseRecord
from .verify import ProbeHistory, VerifyPolicy, should_verify

if TYPE_CHECKING:
    from .decision import Decision

__all__ = ["SinkMemory"]


class SinkMemory:
    """This rank's knowledge of its engines since the sink's last committed sync."""

    def __init__(self) -> None:
        #: This rank's fingerprints at the last committed merged sync (``None``: none, or the last one failed).
        self.synced: SyncedSources | None = None
        #: ``merge="engine"``: which base the engines hold from this sink.
        self.base = EngineBaseRecord()
        #: Committed syncs (what ``verify=N`` counts; the same on every rank, since commits are agreed).
        self.syncs = 0
        self.history = ProbeHistory()
        #: ``elements=True``: this rank's shards of the element outputs as the engines hold them.
        self.elements = ElementBaseline()

    def verifying(self, policy: VerifyPolicy) -> bool:
        """Whether the next sync is verified under ``policy``: the same answer on every rank."""
        return should_verify(policy, self.syncs)

    def remember(self, decision: Decision, committed: bool) -> None:
        """After a sync: a committed one leaves its fingerprints (and, merged in the engine, its base) known; a
        failed one leaves nothing. An adapter sync leaves the base weights, and so this knowledge, as they were."""
        if committed:
            self.history.committed(self.syncs)
            self.syncs += 1
        if decision.adapter is not None:
            return
        changes = decision.changes
        self.synced = changes.sources if committed and changes is not None else None
        diff = decision.element_diff
        if committed and diff is not None and changes is not None:
            # Every element output went (as elements or whole) or was unchanged: the new shards are what the
            # engines hold. A reference swap, after the vote.
            self.elements.stage(decision.source.stream.plan_digest, diff.new)
            self.elements.commit()
        else:
            self.elements.forget()
        self.base.remember(committed and decision.merge_plan is not None, decision.source, decision.base_fps)

    def forget(self) -> None:
        """Trust nothing: the next sync sends every output (and the engine-side merge's base)."""
        self.synced = None
        self.base.forget()
        self.elements.forget()
