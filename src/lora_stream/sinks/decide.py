"""Step 1 of a sync, decide: what this sync sends and why, agreed by every trainer rank before any byte reaches an
engine (the steps: :mod:`lora_stream.sinks.route`).

Who calls it: every sink that loads a :class:`~lora_stream.ParamStream` into engines -- a server, a colocated
engine, an engine in a child process -- once per sync, first, inside the sync's transaction. It runs, on this rank:

* the route's pre-flight (:meth:`Route.preflight <lora_stream.sinks.route.Route.preflight>`: the stream against
  every engine's checkpoint; a refusal refuses on every rank, with every engine untouched);
* the verification's probe, an adapter sync's staging place, the engine-side merge's recipes (what the engines
  cannot merge exactly is refused here);
* for a sync that may be partial, this rank's fingerprints of every frozen shard, and what each engine proves it
  holds (:meth:`Route.engine_states <lora_stream.sinks.route.Route.engine_states>`);

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
from ..changes import Changes, agree_on_changes, takes_selection
from ..stream import ParamStream
from ..stream_pass import Selection
from ..transaction import Transaction
from .decision import Decision
from .memory import SinkMemory
from .route import Route
from .source import ElementSource, SyncSource, source_for
from .verify import VerifyPolicy, model_vocab_size, probe_ids

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
    probe: bool = False,
    lora_name: str | None = None,
) -> Decision:
    """:func:`decide` with ``sink``'s own options (whether this sync verifies, under its policy and ``memory``; a
    partial sync; where the merge runs; element syncs): what every sink that loads a stream into engines calls."""
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
        probe=probe,
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
    probe: bool = False,
    lora_name: str | None = None,
    elements: bool = False,
) -> Decision:
    """Decide this sync on every rank (see the module docstring); raise on every rank if any rank refused.

    ``verifying``: step 3 verifies (the same on every rank: :meth:`SinkMemory.verifying`); ``probe``: the probe's
    token ids are chosen here (a server's workers probe before loading); ``lora_name``: an
    :class:`~lora_stream.AdapterStream` is staged under this name (a route that loads adapters); ``merge``:
    ``"trainer"`` or ``"engine"``; ``skip_unchanged``: a merged sync may be partial; ``elements``: a merged sync's
    trainable outputs may travel as the elements that changed (:mod:`lora_stream.elements`)."""
    stages: dict[str, Any] = {}

    def check() -> tuple[Any, ...]:
        aliases = route.preflight(stream, verifying)
        ids = probe_ids(model_vocab_size(stream.model)) if verifying and probe else None
        adapter = None
        if lora_name is not None and isinstance(stream, AdapterStream):
            adapter = {"path": _staging_path(lora_name), "config": stream.adapter_config()}
        t = time.perf_counter()
        merge_plan = memory.base.plan(stream) if adapter is None and merge == "engine" else None
        base_fps = merge_plan.base_fingerprints(stream) if merge_plan is not None else None
        skipping = skip_unchanged and adapter is None and takes_selection(stream)
        fingerprints = stream.fingerprints() if skipping else None
        stages["fingerprint_s"] = time.perf_counter() - t
        diff = None
        if skipping and elements and merge_plan is None:
            from ..elements import diff_shards, eligible_steps

            eligible = eligible_steps(stream)
            diff = diff_shards(stream, [i for i, why in eligible.items() if why is None], memory.elements)
            for why in eligible.values():
                if why is not None:
                    diff.whole_because[why] = diff.whole_because.get(why, 0) + 1
            stages["element_diff_s"] = diff.seconds
        engines = None
        if fingerprints is not None:  # the proof reads every weight: only for a sync that may be partial
            t = time.perf_counter()
            engines = route.engine_states()
            stages["state_check_s"] = time.perf_counter() - t
        return aliases, ids, adapter, merge_plan, base_fps, fingerprints, engines, diff

    aliases, ids, adapter, merge_plan, base_fps, fingerprints, engines, diff = tx.prepare(check)
    changes = None
    sends = None
    if fingerprints is not None:
        force = memory.base.reason(base_fps, fingerprints, memory.synced) if merge_plan is not None else None
        changes = agree_on_changes(
            tx,
            stream,
            fingerprints,
            memory.synced,
            engines,
            aliases,
            force_full=force,
            element_changed=diff.changed if diff is not None else None,
            elements_refused=_element_refusal(stream, diff, memory) if diff is not None else None,
        )
        if not changes.agreed:
            assert tx.error is not None
            raise tx.error
        stages.update(changes.stages)
        if changes.elements:
            assert diff is not None
            sends = _exchange(tx, stream, changes, diff, stages)
    selection = changes.selection if changes is not None else None
    full_because = changes.full_because if changes is not None else None
    if changes is None and adapter is None:
        full_because = "skip_unchanged=False"
    if diff is not None:
        refused = changes.elements_refused if changes is not None else None
        if sends is not None:  # the element steps travel as elements; the pass sends the rest it needs
            assert changes is not None
            needed = changes.needed if changes.needed is not None else frozenset(range(len(stream.steps())))
            selection, refused, full_because = Selection(needed - frozenset(sends)), None, None
        source: SyncSource = ElementSource(
            stream,
            aliases,
            version,
            selection,
            sends or {},
            shadow=_shadowed(stream, diff),
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
    return Decision(source, aliases, changes, adapter, verifying, ids, merge_plan, base_fps, stages, diff)


#: An element sync sends elements only while their encoded bytes stay at most this fraction of the element steps'
#: whole bytes on every rank; past it, the whole tensors cost about the same and need no exchange between ranks.
ELEMENT_BUDGET = 0.5


def _element_refusal(stream: ParamStream, diff: Any, memory: SinkMemory) -> str | None:
    """Why this rank cannot send elements this sync (``None``: it can)."""
    if not memory.elements.valid_for(stream.plan_digest):
        return "no element baseline of the engines' version on this rank yet (the last sync was full or failed)"
    if not diff.segments:
        return "no output can travel as elements (see docs: element syncs)"
    whole = sum(s.hi - s.lo for s in diff.segments.values())
    sent = sum(s.encoded.blob.numel() for s in diff.segments.values())
    itemsize = max(1, max(s.encoded.dtype.itemsize for s in diff.segments.values()))
    if sent > ELEMENT_BUDGET * whole * itemsize:
        return f"too many elements changed: {sent / max(1, whole * itemsize):.0%} of the bytes as elements"
    return None


def _shadowed(stream: ParamStream, diff: Any) -> list[str]:
    """The output names the engines keep a copy of, for the next element sync: every element step's."""
    steps = stream.steps()
    return [steps[i][0] for i in diff.segments]


def _exchange(tx: Transaction, stream: ParamStream, changes: Changes, diff: Any, stages: dict[str, Any]) -> Any:
    """Every rank's changes of the element steps this sync sends, on every rank (one all-gather of the encoded
    changes over the stream's group, right after the agreement that every rank reached)."""
    from ..elements import exchange

    needed = changes.needed if changes.needed is not None else frozenset(range(len(stream.steps())))
    steps = sorted(i for i in diff.segments if i in needed)
    t = time.perf_counter()
    g = stream.gatherer
    with tx.attempt():
        out = exchange(g.process_group, g.collective, diff.segments, steps, stream.agreement_timeout.total_seconds())
    stages["element_exchange_s"] = time.perf_counter() - t
    if tx.error is not None:
        raise tx.error
    return out


def _staging_path(lora_name: str) -> str:
    from ..engine.adapter_staging import adapter_path

    return adapter_path(lora_name, uuid.uuid4().hex[:12])
