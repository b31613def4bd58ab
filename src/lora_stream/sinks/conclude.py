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

import torch

from ..transaction import Transaction
from .decision import Decision
from .memory import SinkMemory
from .record import SyncRecord
from .route import Route
from .verify import Verification

__all__ = ["cast_note", "commit_or_roll_back", "record_of"]


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
    decision: Decision,
    sink: str,
    seconds: float,
    stages: dict[str, Any],
    verification: Verification | None,
    served_dtype: torch.dtype | None = None,
) -> SyncRecord:
    """The committed sync's record: what went out (counted as it went), step 1's and the route's stages, the
    verification, and a cast between the dtypes sent and ``served_dtype`` (the engine's, where the sink knows it)."""
    record = decision.source.record(sink, seconds)
    cast = cast_note(decision, served_dtype)
    if cast is not None:
        record = dataclasses.replace(record, cast=cast)
    if decision.element_diff is not None:
        diff = decision.element_diff
        elements = {**record.elements, "baseline_bytes": diff.baseline_bytes, "whole_because": dict(diff.whole_because)}
        record = dataclasses.replace(record, elements=elements)
    return dataclasses.replace(record, stages={**decision.stages, **stages}, verification=verification)


def cast_note(decision: Decision, served_dtype: torch.dtype | None) -> str | None:
    """What a sync's line says when the floating dtypes it sent are not the one the engine serves (``None`` when they
    agree or the served dtype is unknown). Sent wider than served: vLLM casts each tensor as it loads it (the bytes
    served are right), the wider dtype costs bytes on the wire, and an element sync compares the values sent, so a
    change that rounds away in the served dtype still travels. Sent narrower: the engine serves the narrower values,
    widened exactly (the trainer's precision beyond them is not served)."""
    if served_dtype is None or not served_dtype.is_floating_point:
        return None
    sent = {m.dtype for m in decision.source.stream.metadata() if m.dtype.is_floating_point}
    served = str(served_dtype)[6:]
    if not sent or sent == {served_dtype}:
        return None
    names = ", ".join(sorted(str(d)[6:] for d in sent))
    wider = sorted(str(d)[6:] for d in sent if d.itemsize > served_dtype.itemsize)
    if not wider:
        return f"sent {names} into an engine that serves {served}: it serves the values sent, widened exactly"
    note = f"sent {names} into an engine that serves {served}, which casts each tensor as it loads it"
    if decision.element_diff is not None:
        note += f"; elements compare the {', '.join(wider)} values, so changes that round away in {served} travel too"
    return note
