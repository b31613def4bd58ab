"""Trainer side: which outputs a sync must send, given what the engines hold -- agreed by every rank.

A LoRA step changes the adapter and nothing else, so most of a merged model's outputs (embeddings, norms, an
untied ``lm_head``; with LoRA on attention only, the whole MLP) are what the engine already holds. A sink that
skips them must *prove* them unchanged, never assume it:

* **The sources are the same bytes.** Each rank fingerprints its own shard of every frozen source
  (:meth:`~lora_stream.ParamStream.fingerprints`: no communication) and compares with the fingerprints it recorded
  when the engine's version was committed. A trainable source (``requires_grad``), a quantized base, or a gatherer
  that cannot say (FSDP1) makes its outputs change at every sync. ``param.data.copy_()``, an EMA, DeepSpeed's own
  ``.data`` writes and a new ``requires_grad`` are all seen, on whichever rank's shard they happen.
* **The engine holds that version.** The sink checks, per engine, that it still holds the weights of this sink's
  last committed sync (a server's lease reports which sync last wrote its weights and since when it runs; a
  colocated engine carries the committing sync's token), and that the engine can tell which checkpoint tensors
  each of its modules reads (:mod:`lora_stream.engine.holding`). Otherwise -- a fresh, restarted or readmitted
  server, one another sink wrote to, a rolled-back or failed sync -- everything is sent.
* **Every rank decides alike.** Two fixed-size agreements (:meth:`~lora_stream.transaction.Transaction.any_of`),
  the same number on every path: which steps changed on any rank; then which steps must go because they share an
  engine module with a changed one (q, k and v feed vLLM's one ``qkv_proj``). The stream then gathers, merges and
  sends only those (:class:`~lora_stream.stream_pass.Selection`); the engine loads and snapshots only the modules they
  feed, and refuses the update if it does not hold the version the trainer compared against.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from .stream_pass import Selection
from .transaction import Transaction
from .units import Partition

__all__ = ["Changes", "EngineState", "SyncedSources", "agree_on_changes"]


@dataclass(frozen=True)
class SyncedSources:
    """What this rank's shards of every step's sources were when the engines' current version was committed."""

    #: The stream's plan (:attr:`ParamStream.plan_digest`): fingerprints of another plan say nothing.
    plan: str
    fingerprints: tuple[int | None, ...]


@dataclass(frozen=True)
class EngineState:
    """One engine this rank feeds, as the sink found it in its pre-flight."""

    #: Why it must get every output (``None``: it holds this sink's last committed version).
    full_because: str | None
    #: The checkpoint names its modules read together (``LoadReport.units``); ``None``: unknown.
    units: tuple[tuple[str, ...], ...] | None = None


@dataclass(frozen=True)
class Changes:
    """The agreed outcome: the same on every rank."""

    #: What the pass produces (``None``: everything).
    selection: Selection | None
    #: This rank's fingerprints now (recorded when the sync commits).
    sources: SyncedSources
    #: Why every output is sent (``None`` for a partial sync).
    full_because: str | None
    #: Steps that changed on some rank, and steps sent besides because an engine module reads them with one.
    changed: int = 0
    joined: int = 0
    #: Every agreement completed (``False``: the transaction recorded the failure).
    agreed: bool = True
    stages: dict[str, float] = field(default_factory=dict)
    #: Every step this sync sends (``None``: all of them); ``selection`` is the same set, or ``None`` when it is all.
    needed: frozenset[int] | None = None
    #: An element sync (:mod:`lora_stream.elements`): every rank's element steps may travel as changed elements;
    #: otherwise why not (``None`` with ``elements`` false: the sink sends no elements).
    elements: bool = False
    elements_refused: str | None = None


def agree_on_changes(
    tx: Transaction,
    steps: Sequence[Sequence[str]],
    plan: str,
    fingerprints: Sequence[int | None],
    last: SyncedSources | None,
    engines: Sequence[EngineState],
    aliases: Mapping[str, str] | None = None,
    force_full: str | None = None,
    element_changed: Mapping[int, bool] | None = None,
    elements_refused: str | None = None,
) -> Changes:
    """Decide, with every other rank, which steps of a stream this sync produces (see the module docstring).

    ``steps``: the output names of each step of the stream's plan (:meth:`ParamStream.steps`), whose digest is
    ``plan`` (:attr:`ParamStream.plan_digest`); ``fingerprints``: this rank's (:meth:`ParamStream.fingerprints`,
    taken in the sync's pre-flight so that a failure refuses on every rank); ``last``: what this rank recorded at the
    engines' committed version (``None``: nothing); ``engines``: the engines this rank feeds (none: it only
    gathers); ``aliases``: tied alias -> primary output name, for the engines' units; ``force_full``: this rank needs
    every output sent, for this reason (the engine-side merge's base must travel again). Every rank calls it with a
    stream of the same plan: it runs the same two agreements (:meth:`Transaction.any_of`) on every path.

    An element sync: ``element_changed`` says, for each element step, whether any of this rank's elements changed
    (its sources are trainable, so no fingerprint can say it); ``elements_refused``, why this rank cannot send
    elements this time (no baseline of the engines' version, too many changed). One more bit of the first
    agreement makes that common: refused on any rank, every element step is sent whole, as without elements."""
    import time

    t = time.perf_counter()
    n = len(steps)
    sources = SyncedSources(plan, tuple(fingerprints))
    reason: str | None = force_full
    for e in engines:
        if e.full_because is not None:
            reason = reason or e.full_because
        elif e.units is None:
            reason = reason or "the engine cannot tell which of its modules read which tensors"
    if last is None:
        reason = reason or "no sync committed by this sink yet (or the last one failed)"
    elif last.plan != sources.plan:
        reason = reason or "the stream's plan differs from the last committed sync's"
    if reason is None:
        assert last is not None
        local = [fp is None or fp != old for fp, old in zip(fingerprints, last.fingerprints, strict=True)]
        for i, moved in (element_changed or {}).items():
            local[i] = moved
    else:
        local = [True] * n
    # Which steps an engine module reads together (this rank's engines' units): known before any agreement.
    step_of: dict[str, int] = {name: i for i, names in enumerate(steps) for name in names}
    for alias, primary in (aliases or {}).items():
        if primary in step_of:
            step_of.setdefault(alias, step_of[primary])
    together: Partition[int] = Partition()
    for e in engines:
        for unit in e.units or ():
            together.join(step_of[name] for name in unit if name in step_of)
    unit_of = [together.find(i) for i in range(n)]
    offered = element_changed is not None
    # Elements need every rank able to send them, and every rank's engines proven to hold the last commit.
    cannot = elements_refused is not None or reason is not None
    flags = tx.any_of(local + ([cannot] if offered else []), "agreeing on what changed")
    if flags is None:
        return Changes(None, sources, "the agreement failed", agreed=False)
    changed = flags[:n]
    elements = offered and not flags[n]
    refused: str | None = None
    if offered and not elements:
        refused = reason or elements_refused or "another trainer rank cannot send elements, or its engines need all"
        for i in element_changed or {}:
            changed[i] = True  # trainable: sent whole, as without elements
    # Steps an engine module reads together with a changed one go too.
    hot = {unit_of[i] for i in range(n) if changed[i]}
    needed_local = [unit_of[i] in hot for i in range(n)]
    needed = tx.any_of(needed_local, "agreeing on what to send")
    if needed is None:
        return Changes(None, sources, "the agreement failed", agreed=False)
    n_changed = sum(changed)
    n_needed = sum(needed)
    stages = {"decide_s": time.perf_counter() - t}
    if n_needed == n:
        why = reason or (
            "every output changed"
            if all(changed)
            else "every output changed, or shares an engine module with one that did, on some rank"
        )
        if reason is None and all(changed) and not all(local):
            why = "another trainer rank's engine needs every output, or its shards all changed"
        if reason is None and refused is not None:
            why = f"the trainable outputs go whole: {refused}"
        return Changes(
            None,
            sources,
            why,
            n_changed,
            n_needed - n_changed,
            stages=stages,
            elements=elements,
            elements_refused=refused,
        )
    chosen = frozenset(i for i in range(n) if needed[i])
    return Changes(
        Selection(chosen),
        sources,
        None,
        n_changed,
        n_needed - n_changed,
        stages=stages,
        needed=chosen,
        elements=elements,
        elements_refused=refused,
    )
