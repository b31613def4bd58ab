"""Step 4 of a sync, commit or roll back: every engine keeps the update, or every engine serves exactly what it
served before; then what the sink knows of its engines, and the record (the steps: :mod:`lora_stream.sinks.route`).

Who calls it: every sink, once per sync, after step 3's vote, on every rank alike. Once every rank voted to commit,
the decision is final: the route commits (:meth:`Route.commit <lora_stream.sinks.route.Route.commit>`) and nothing
rolls back what it committed. Otherwise every rank rolls its engines back
(:meth:`Route.abort <lora_stream.sinks.route.Route.abort>`) and raises the same failure: its own error, or the
:class:`~lora_stream.StreamAbortedError` naming the rank that failed.

Committed or not, the :class:`~lora_stream.sinks.memory.SinkMemory` learns the outcome: a failed sync leaves nothing
known about the engines (the next sync sends every output). What breaks if a route commits before the vote, or
rolls back after it: engines of one fleet serve different versions, or an engine serves a version the trainer
believes undone.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..transaction import Transaction
from .decide import Decision
from .memory import SinkMemory
from .record import SyncRecord
from .route import Route
from .verify import Verification

__all__ = ["commit_or_roll_back", "record_of"]


def commit_or_roll_back(tx: Transaction, route: Route, decision: Decision, memory: SinkMemory) -> None:
    """Run step 4 on this rank: return with every engine committed, or raise (on every rank alike) with every engine
    rolled back. ``memory`` remembers the outcome either way."""
    committed = False
    try:
        if tx.ok:
            route.commit(tx, decision)
        tx.conclude(lambda: None, route.abort)
        committed = True
    finally:
        memory.remember(decision, committed)
        if not committed:
            route.forget("the last sync failed (the engine was rolled back)")


def record_of(
    decision: Decision, sink: str, seconds: float, stages: dict[str, Any], verification: Verification | None
) -> SyncRecord:
    """The committed sync's record: what went out (counted as it went), step 1's and the route's stages, and the
    verification."""
    record = decision.source.record(sink, seconds)
    if decision.element_diff is not None:
        diff = decision.element_diff
        elements = {**record.elements, "baseline_bytes": diff.baseline_bytes, "whole_because": dict(diff.whole_because)}
        record = dataclasses.replace(record, elements=elements)
    return dataclasses.replace(record, stages={**decision.stages, **stages}, verification=verification)
