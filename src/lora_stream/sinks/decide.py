"""Step 1 of a sync, decide: what this sync sends and why, agreed by every trainer rank before any byte reaches an
engine (the steps: :mod:`lora_stream.sinks.route`).

Who calls it: every sink that loads a :class:`~lora_stream.ParamStream` into engines -- a server, a colocated
engine, an engine in a child process -- once per sync, first, inside the sync's transaction. It runs, on this rank:

* the route's pre-flight (:meth:`Route.preflight <lora_stream.sinks.route.Route.preflight>`: the stream against
  every engine's checkpoint; a refusal refuses on every rank, with every engine untouched);
* an adapter sync's staging place, the engine-side merge's recipes (what the engines cannot merge exactly is
  refused here);
* for a sync that may be partial, one read of this rank's local shards (:meth:`ParamStream.read_steps
  <lora_stream.ParamStream.read_steps>`: the fingerprints of every frozen shard and, for element syncs, the diff of
  every trainable one), and what each engine proves it holds (:meth:`Route.engine_states
  <lora_stream.sinks.route.Route.engine_states>`);

then the transaction's pre-flight agreement, and the agreement on what changed
(:func:`~lora_stream.changes.agree_on_changes`). The :class:`Decision` is the same on every rank (but for this rank's
own fingerprints and timings); its :attr:`~Decision.source` is what step 2 sends.

What breaks if it is bypassed: a partial sync decided on one rank only would leave the engines mixed; a fingerprint
taken after the transfer began would prove nothing about what was sent.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Protocol

from ..adapter import AdapterStream
from ..changes import agree_on_changes
from ..stream import ParamStream
from ..stream_pass import Selection
from ..transaction import Transaction
from .decision import Decision
from .memory import SinkMemory
from .route import Route
from .source import ElementSource, SyncSource, source_for
from .verify import VerifyPolicy

__all__ = ["Decision", "DecideOptions", "decide", "decide_for"]


class DecideOptions(Protocol):
    """The options of a sink that step 1 reads (:func:`decide_for`)."""

    verify: VerifyPolicy
    skip_unchanged: bool
    merge: str
    elements: bool


def decide_for(
    sink: DecideOptions,
    tx: Transaction,
    stream: ParamStream,
    route: Route,
    memory: SinkMemory,
    *,
    version: str | None,
    lora_name: str | None = None,
) -> Decision:
    """:func:`decide` with ``sink``'s own options (whether this sync verifies, under its policy and ``memory``; a
    partial sync; where the merge runs; element syncs): what every sink that loads a stream into engines calls."""
    # Step 1 touches no engine: whatever fails in it leaves the element baseline its read advanced as it was.
    with memory.elements.restored_on_failure():
        return decide(
            tx,
            stream,
            route,
            memory,
            version=version,
            verifying=memory.verifying(sink.verify),
            skip_unchanged=sink.skip_unchanged,
            merge=sink.merge,
            elements=sink.elements,
            lora_name=lora_name,
        )


def decide(
    tx: Transaction,
    stream: ParamStream,
    route: Route,
    memory: SinkMemory,
    *,
    version: str | None,
    verifying: bool,
    skip_unchanged: bool,
    merge: str,
    lora_name: str | None = None,
    elements: bool = False,
) -> Decision:
    """Decide this sync on every rank (see the module docstring); raise on every rank if any rank refused.

    ``verifying``: step 3 verifies (the same on every rank: :meth:`SinkMemory.verifying`); ``lora_name``: an
    :class:`~lora_stream.AdapterStream` is staged under this name (a route that loads adapters); ``merge``:
    ``"trainer"`` or ``"engine"``; ``skip_unchanged``: a merged sync may be partial; ``elements``: a merged sync's
    trainable outputs may travel as the elements that changed (:mod:`lora_stream.elements`)."""
    stages: dict[str, Any] = {}

    def check() -> tuple[Any, ...]:
        aliases = route.preflight(stream, verifying)
        adapter = None
        if lora_name is not None and isinstance(stream, AdapterStream):
            adapter = {"path": _staging_path(lora_name), "config": stream.adapter_config()}
        t = time.perf_counter()
        merge_plan = memory.base.plan(stream) if adapter is None and merge == "engine" else None
        base_fps = merge_plan.base_fingerprints(stream) if merge_plan is not None else None
        skipping = skip_unchanged and adapter is None and stream.takes_selection()
        steps = stream.steps()
        stages["fingerprint_s"] = time.perf_counter() - t
        fingerprints = read = None
        if skipping:
            reads = stream.read_steps(memory.elements if elements and merge_plan is None else None)
            fingerprints, read = reads.fingerprints, reads.elements
            stages["fingerprint_s"] += reads.fingerprint_s
            if read is not None:
                stages["element_diff_s"] = read.diff.seconds
        engines = None
        if fingerprints is not None:  # the proof reads every weight: only for a sync that may be partial
            t = time.perf_counter()
            engines = route.engine_states()
            stages["state_check_s"] = time.perf_counter() - t
        return aliases, adapter, merge_plan, base_fps, fingerprints, engines, read, steps

    aliases, adapter, merge_plan, base_fps, fingerprints, engines, read, steps = tx.prepare(check)
    changes = None
    sends = None
    if fingerprints is not None:
        force = memory.base.reason(base_fps, fingerprints, memory.synced) if merge_plan is not None else None
        changes = agree_on_changes(
            tx,
            steps,
            stream.plan_digest,
            fingerprints,
            memory.synced,
            engines,
            aliases,
            force_full=force,
            element_changed=read.diff.changed if read is not None else None,
            elements_refused=read.refused if read is not None else None,
        )
        if not changes.agreed:
            assert tx.error is not None
            raise tx.error
        stages.update(changes.stages)
        if changes.elements:
            assert read is not None
            # Every rank's changes of the element steps this sync sends, right after the agreement every rank
            # reached: a rank missing from the exchange has failed.
            t = time.perf_counter()
            with tx.attempt():
                sends = read.exchange(changes.needed)
            stages["element_exchange_s"] = time.perf_counter() - t
            if tx.error is not None:
                raise tx.error
    selection = changes.selection if changes is not None else None
    full_because = changes.full_because if changes is not None else None
    if changes is None and adapter is None:
        full_because = "skip_unchanged=False"
    if read is not None:
        refused = changes.elements_refused if changes is not None else None
        if sends is not None:  # the element steps travel as elements; the pass sends the rest it needs
            assert changes is not None
            needed = changes.needed if changes.needed is not None else frozenset(range(len(steps)))
            selection, refused, full_because = Selection(needed - frozenset(sends)), None, None
        source: SyncSource = ElementSource(
            stream,
            aliases,
            version,
            selection,
            sends or {},
            shadow=read.shadow,
            refused=refused,
            full_because=full_because,
        )
    else:
        source = source_for(
            stream,
            aliases,
            version,
            adapter=adapter,
            selection=selection,
            full_because=full_because,
            merge_plan=merge_plan,
            base_fp=memory.base.sent,
        )
    diff = read.diff if read is not None else None
    return Decision(source, aliases, changes, adapter, verifying, merge_plan, base_fps, stages, diff)


def _staging_path(lora_name: str) -> str:
    from ..engine.adapter_staging import adapter_path

    return adapter_path(lora_name, uuid.uuid4().hex[:12])
