"""vLLM's layerwise reload bracket around a model, with the check that vLLM reloaded every module it holds.

One object, used wherever the model lives: by :class:`~lora_stream.VLLMColocatedSink` for an engine in the trainer's
process, by the worker extension for an engine in a child process, and by the ``gloo`` worker engine inside a vLLM
server. Only the transport differs between them.

vLLM reloads checkpoint-format weights inside ``initialize_layerwise_reload`` ... ``finalize_layerwise_reload``. Each
module counts the elements its weight loaders wrote and is rebuilt when the count reaches its size. At
``finalize``, a module that got nothing gets its old weights back, and one that got *some* of its weights (a fused
``qkv_proj`` that missed ``k``) is rebuilt anyway, its missing part left uninitialized.

The check asks vLLM rather than predicting it: just before ``finalize`` it reads those per-module counts, which
are what vLLM itself acts on. No name mapping is involved, so it holds for every architecture and every loader
(fused shards, experts, the Transformers backend's per-instance mapper). A module that got only part of its weights
is put back to its old weights before ``finalize`` instead of being rebuilt from garbage.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import LoraStreamError
from ..units import merge_units
from .holding import BatchIndex, LoadMap, Proof, hold, loaded_tensor, proof_stands
from .snapshot import EngineSnapshot
from .state_digest import advance, first_difference, install, measure, record, recorded_state
from .vllm_reload import (
    RELAYOUT_REPEATED,
    _class_key,
    _expected_numel,
    _experts_relaid_after_load,
    _reload_bookkeeping,
    _what_it_got,
)

__all__ = ["LoadReport", "ReloadBracket", "VLLMLoadError"]


#: Prefix of a :class:`VLLMLoadError` message, so that the server sink can tell one apart in an HTTP error body.
LOAD_ERROR_TAG = "[lora_stream VLLMLoadError]"


class VLLMLoadError(LoraStreamError):
    """vLLM did not reload every module it holds, or its loader raised.

    Raised after the reload bracket was closed, so the engine keeps running. The sinks then roll the update back
    (every module serves what it served before the sync), unless they were built with ``rollback=False``: then
    modules that received all their weights serve the new ones, the others their old ones, until the next
    successful sync. ``stale`` lists the vLLM modules that received none of their weights; ``incomplete`` maps each
    module that received only part of them to what it got.
    """

    def __init__(
        self, message: str, *, stale: list[str] | None = None, incomplete: dict[str, list[str]] | None = None
    ) -> None:
        super().__init__(message)
        self.stale = stale or []
        self.incomplete = incomplete or {}


@dataclass
class LoadReport:
    """What one bracket reloaded: vLLM modules left with their old weights (``stale``) or rolled back after getting
    only part of them (``incomplete``: module -> the weights and shards it got, and how many elements of how many).
    ``checked`` is false when this vLLM has no per-module reload bookkeeping to read."""

    stale: list[str] = field(default_factory=list)
    incomplete: dict[str, list[str]] = field(default_factory=dict)
    checked: bool = True
    #: What the engine learned of its loaders (:class:`~lora_stream.engine.holding.LoadMap`): the checkpoint names
    #: that must travel together, or ``None`` when it cannot tell (then it takes full syncs only).
    units: list[list[str]] | None = None

    @property
    def ok(self) -> bool:
        return not self.stale and not self.incomplete

    def merge(self, other: LoadReport) -> None:
        """Add another worker's report (tensor-parallel workers each run their own bracket)."""
        self.stale += [n for n in other.stale if n not in self.stale]
        self.incomplete.update(other.incomplete)
        self.checked = self.checked and other.checked
        self.units = merge_units(self.units, other.units)

    def error(self, where: str = "") -> VLLMLoadError | None:
        """The error to raise for this report, the same text whichever sink or worker found it."""
        if self.ok:
            return None
        return VLLMLoadError(
            f"{LOAD_ERROR_TAG} vLLM{where} did not reload {len(self.stale)} module(s) {self.stale[:20]} (they keep "
            f"their old weights) and got only part of the weights of {dict(list(self.incomplete.items())[:20])} "
            "(rolled back to their old weights); the engine keeps serving, with every other module updated",
            stale=list(self.stale),
            incomplete=dict(self.incomplete),
        )

    def to_wire(self) -> tuple[list[str], dict[str, list[str]], bool, list[list[str]] | None]:
        return list(self.stale), dict(self.incomplete), self.checked, self.units

    @classmethod
    def from_wire(cls, wire: Any) -> LoadReport:
        stale, incomplete, checked, units = wire
        return cls(
            list(stale),
            {str(k): list(v) for k, v in dict(incomplete).items()},
            bool(checked),
            None if units is None else [list(u) for u in units],
        )


class ReloadBracket:
    """``begin()``, any number of ``load(pairs)``, then ``finish()`` -- or ``abort()`` -- on a vLLM model.

    Contract, relied on by every sink:

    * ``begin`` opens vLLM's layerwise reload; from then on the model's layers are in reload state and **must** be
      closed by ``finish`` or ``abort``, or the engine's next forward fails (layers left on the meta device).
    * ``load`` hands one batch to ``model.load_weights``. Send whole layers in layer order: a module is rebuilt when
      its last weight arrives. A name sent twice in one bracket raises :class:`VLLMLoadError` before vLLM sees it
      (vLLM counts elements, so a duplicate would complete a module whose other shards never came). Names in
      ``optional`` (tied aliases such as ``lm_head.weight``) are sent only if the model has a parameter of that
      name: vLLM's Gemma 2 computes logits from the embedding and has no ``lm_head`` at all. An error vLLM's
      loader raises becomes a :class:`VLLMLoadError` naming the batch and the model class.
    * ``finish`` reads vLLM's per-module reload counts, rolls back modules that got only part of their weights,
      closes the bracket and returns the :class:`LoadReport` (empty when nothing was sent at all; otherwise every
      module vLLM holds must have been reloaded whole); it never raises for a bad report (the caller decides,
      so that the same error text reaches the user whichever process found it). ``abort`` rolls back every module
      still waiting for weights and closes the bracket without checking. Both are idempotent.
    * ``begin(keep_previous=True)`` first takes an :class:`EngineSnapshot`; after ``finish`` the caller then either
      ``commit()``s (the snapshot is released) or ``rollback()``s (every module serves exactly what it served before
      ``begin``). Between ``finish`` and one of them the engine serves the new weights: a caller that wants no
      request to see them keeps generation paused until it has decided. Without ``keep_previous`` a failed update
      cannot be undone: modules that received all their weights keep the new ones.
    """

    def __init__(self, model: torch.nn.Module, model_config: Any) -> None:
        self.model: Any = model
        self.model_config = model_config
        self._open = False
        self._sent: set[str] = set()
        self._param_names: set[str] = set()
        self._relaid: list[tuple[str, Any, Any]] = []
        self._rolled_back: set[int] = set()
        #: The MoE layers (by ``id``) whose experts vLLM itself re-laid out inside the open bracket.
        self._relaid_by_vllm: set[int] = set()
        self._previous: EngineSnapshot | None = None
        #: ``begin(restore=...)``: what a rollback loads back instead of a copy -- the update's names, the sync
        #: the model held, and the tensors recomputed (:meth:`~lora_stream.engine.merger.EngineMerger.restorer`).
        self._restore: tuple[list[str], str, Any, Collection[str]] | None = None
        #: What this model's loaders read (shared by every bracket on the model).
        self.load_map = LoadMap.of(model)
        #: A partial update (``begin(expect=...)``): the modules it must leave untouched, by qualified name.
        self._untouched: set[str] = set()
        self._partial = False
        self._batch: BatchIndex | None = None
        #: The modules the update opened by the latest ``begin`` may have changed, whose state a commit records
        #: (``None``: every module, a full update); ``False`` when no update is pending a commit.
        self._to_record: set[str] | bool | None = False
        self._moves: Callable[[], Mapping[str, Mapping[str, Any]]] | None = None
        self._written: set[str] = set()
        #: The record of the update :meth:`finish` closed, measured there (before the vote): ``(modules, digests)``,
        #: which :meth:`commit` only installs.
        self._measured: tuple[set[str] | None, dict[str, Any]] | None = None

    @property
    def open(self) -> bool:
        return self._open

    @property
    def kept_bytes(self) -> int:
        """Host bytes held to undo the open or unresolved update (0 without ``keep_previous``): what a commit frees.

        Read after ``finish`` (what the sinks record as ``stages["kept_bytes"]``), it is everything the snapshot
        keeps alive once the reload has replaced what it replaces (:meth:`EngineSnapshot.kept_bytes`): the copies
        of the parameters and buffers and the old packed kernels. Measured against the resident set the commit gives
        back (``tests/test_kept_bytes.py``)."""
        return self._previous.kept_bytes(settled=not self._open) if self._previous is not None else 0

    def commit(self, token: str | None = None) -> None:
        """The update stands: release what ``begin(keep_previous=True)`` kept, and mark the model as holding the
        weights of the sync ``token`` (what a later partial update must name, :mod:`lora_stream.engine.holding`).
        With a token, also record the digest of what the model holds now
        (:func:`~lora_stream.engine.state_digest.record`: every module after a full update; after a partial one,
        every module it was not barred from touching -- the others were proven unchanged when it began), which the
        next partial update is checked against. Idempotent (a repeated commit records nothing again)."""
        if self._open:
            raise RuntimeError("commit() with the reload bracket still open: call finish() first")
        self._restore = None
        previous, self._previous = self._previous, None
        if previous is not None:
            previous.drop()
        if token is not None:
            self._record(token)
            hold(self.model, token)

    def _record(self, token: str) -> None:
        """Record the digest for a commit of ``token`` (see :meth:`commit`)."""
        from .holding import held_by

        pending, self._to_record = self._to_record, False
        measured, self._measured = self._measured, None
        if pending is False:
            if held_by(self.model) == token:
                return  # a repeated commit: the record was taken by the first one
            pending = None  # a commit with no update of this bracket before it: prove nothing less than all
        only = pending if isinstance(pending, set) else None
        if measured is not None and measured[0] == only:
            install(self.model, measured[1], only)  # measured by finish(), before the vote
            return
        record(self.model, only)

    def rollback(self) -> bool:
        """Undo the update: close the bracket if it is open, then put back, bit for bit, what every module held at
        ``begin(keep_previous=True)``. Returns whether anything was restored (``False`` when nothing was kept).
        Idempotent."""
        self.abort()
        self._to_record = False  # the update does not stand: nothing of it is recorded
        self._measured = None
        previous, self._previous = self._previous, None
        restore, self._restore = self._restore, None
        if previous is not None:
            previous.restore()
            previous.drop()
            return True
        if restore is None:
            return False
        self._reload(*restore)
        return True

    def _reload(self, names: list[str], token: str, produce: Any, optional: Collection[str]) -> None:
        """Roll back by loading again what the model held: a partial update onto sync ``token`` with the tensors
        ``produce()`` recomputes for ``names``, checked like any update (its ``begin`` proves the modules it leaves
        untouched against the record). Every module the failed update touched is reloaded whole from the same
        values it was loaded from before, so it serves exactly what it served; their digest is recorded again, so
        that the next partial update can be proven against sync ``token``."""
        hold(self.model, token)
        self.begin(expect=names, base=token, optional=optional)
        try:
            self.load(produce(), optional)
        except BaseException:
            self.abort()
            self._to_record = False
            hold(self.model, None)
            raise
        report = self.finish()
        error = report.error(" (recomputing the previous weights)")
        if error is not None:
            self._to_record = False
            hold(self.model, None)
            raise error
        self._record(token)
        hold(self.model, token)

    def begin(
        self,
        *,
        keep_previous: bool = False,
        expect: Collection[str] | None = None,
        base: str | None = None,
        optional: Collection[str] = (),
        restore: Any = None,
        record: bool = True,
        written: Collection[str] = (),
        moves: Callable[[], Mapping[str, Mapping[str, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]]]
        | None = None,
        proven: Proof | None = None,
    ) -> None:
        """Open the bracket. ``expect``: a partial update, which sends exactly these checkpoint names onto the
        weights of the committed sync ``base``; every module they do not feed is left untouched (not snapshotted,
        and guarded against receiving anything). Names in ``optional`` that no module ever read (tied aliases the
        model does not hold, see :meth:`load`) feed nothing. Refused (:class:`VLLMLoadError`, nothing opened) when
        the model does not hold ``base``'s weights or cannot tell which modules the names feed.

        ``restore``: instead of ``keep_previous``'s copy, a callable that recomputes, for a rollback, every tensor a
        partial update sends (``expect``) as the model holds it now
        (:meth:`~lora_stream.engine.merger.EngineMerger.restorer`). Taken only for a partial update onto a
        committed sync, on a model that can tell which modules the names feed; otherwise the copy is kept as
        asked.

        ``record=False``: the commit will name no sync (a sink that never sends a partial update), so :meth:`finish`
        measures no digest of the model's state for it (a commit that names one anyway records it then).

        ``written``: modules this update writes outside the bracket (an element sync's writes in place,
        :class:`~lora_stream.engine.elements.ElementShadow`), by qualified name. The bracket leaves them as it leaves
        the untouched ones (proven against the record now, guarded against every loader, not kept), and
        :meth:`finish` measures them with the modules it reloaded, so that a commit records what they hold.
        ``moves`` (:meth:`~lora_stream.engine.elements.ElementShadow.moves`), called by :meth:`finish`: the writes
        into written modules, by module and parameter; a module found there is recorded by moving its record by them
        (:func:`~lora_stream.engine.state_digest.advance`, ``O(changed)``: it was proven against the record just
        above, and nothing else writes it) instead of reading it again.

        ``proven`` (:func:`~lora_stream.engine.holding.take_proof`): the pre-flight's proof of every module, made in
        the same sync with nothing run on the engine since (the colocated sink's; never a server's). Where it stands
        (:func:`~lora_stream.engine.holding.proof_stands`), a partial update is not read again here: the pre-flight's
        read is the only one before the load."""
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        from .holding import held_by

        if self._open:
            raise RuntimeError("a reload bracket is already open on this model")
        untouched: set[str] = set()
        if expect is not None:
            held = held_by(self.model)
            if base is None or held != base:
                raise VLLMLoadError(
                    f"{LOAD_ERROR_TAG} a partial update computed against the weights of sync {base!r} reached an "
                    f"engine that holds {'those of sync ' + repr(held) if held else 'other weights'} (restarted, "
                    "rolled back, or written by another update); nothing was loaded, and the next sync sends every "
                    "tensor"
                )
            loads = [n for n in expect if n not in optional or n in self.load_map.receivers]
            touched = self.load_map.modules_of(loads) if self.load_map.complete else None
            if touched is None or _reload_bookkeeping() is None:
                raise VLLMLoadError(
                    f"{LOAD_ERROR_TAG} a partial update reached an engine that cannot tell which of its modules "
                    "the tensors feed (no traced full reload, or a loader that copies what it reads); nothing was "
                    "loaded, and the next sync sends every tensor"
                )
            known = set().union(*self.load_map.receivers.values()) if self.load_map.receivers else set()
            untouched = known - touched
            # The check of state, not of writers: every module this update leaves (those the map knows and every
            # module it does not, attention and rotary caches included) must hold what the commit of ``base`` left.
            why = None if proof_stands(self.model, proven) else first_difference(self.model, skip=touched)
            if why is not None:
                hold(self.model, None)
                raise VLLMLoadError(
                    f"{LOAD_ERROR_TAG} a partial update onto sync {base!r} cannot be proven exact: {why}; nothing "
                    "was loaded, and the next sync sends every tensor"
                )
        self._relaid = _experts_relaid_after_load(self.model)
        unknown = [(n, e) for n, _, e in self._relaid if _class_key(e) not in RELAYOUT_REPEATED]
        if unknown:
            name, experts = unknown[0]
            raise VLLMLoadError(
                f"{LOAD_ERROR_TAG} vLLM's MoE layer {name!r} uses {_class_key(experts)}, which re-lays its weights out "
                "after loading; vLLM skips that step on a weight update, so a reload would serve wrongly laid out "
                "expert weights. lora_stream repeats it only for the implementations it verified "
                f"({sorted(RELAYOUT_REPEATED)}); nothing was sent"
            )
        if self._relaid and _reload_bookkeeping() is None:
            # Without vLLM's reload counts, a layer that kept its old (already laid out) weights cannot be told from
            # one that got new ones, and re-laying out the former would corrupt it.
            raise VLLMLoadError(
                f"{LOAD_ERROR_TAG} this vLLM has MoE layers that re-lay their weights out after loading but no "
                "per-module reload bookkeeping to read; nothing was sent"
            )
        # Names as the loaded model holds them, tied ones included; taken before the bracket swaps in meta tensors.
        self._param_names = {n for n, _ in self.model.named_parameters(remove_duplicate=False)}
        self._sent = set()
        modules = dict(self.model.named_modules())
        skip = {id(modules[m]) for m in untouched if m in modules}
        self._restore = None
        held_now = held_by(self.model)
        if restore is not None and expect is not None and held_now is not None and self.load_map.complete:
            self._restore = (list(expect), held_now, restore, tuple(optional))
            keep_previous = False
        self._previous = EngineSnapshot.take(self.model, skip) if keep_previous else None
        hold(self.model, None)  # from here on, until a commit, the model holds no committed sync's weights
        self._untouched, self._partial = untouched, expect is not None
        self._moves = moves if expect is not None else None
        self._written = set(written) & untouched if expect is not None else set()
        # What a commit of this update records: after a partial update, every module but those it was barred from
        # touching (they were proven just above); after a full one, everything.
        self._to_record = {n for n in modules if n not in untouched or n in written} if expect is not None else None
        if not record:
            # The caller commits with no token (a sink that never sends a partial sync): no digest is recorded,
            # so finish() measures none (one read of every weight, for a proof nobody will ask for).
            self._to_record = False
        self._measured = None
        self._watch_relayouts()
        try:
            initialize_layerwise_reload(self.model)
        except BaseException:
            self._unwatch_relayouts()
            raise
        self._open = True
        self._trace(modules)

    def _trace(self, modules: dict[str, torch.nn.Module]) -> None:
        """Record every weight a module's loader buffers (see :mod:`lora_stream.engine.holding`)."""
        vllm = _reload_bookkeeping()
        if vllm is None:
            self.load_map.traced = False
            return
        layerwise = vllm[0]
        for name, module in modules.items():
            info = layerwise.LAYERWISE_INFO.get(module)
            if info is not None and info.can_load():
                info.loaded_weights = _TracedLoads(self, name, info.loaded_weights)

    def _buffered(self, module: str, item: Any) -> None:
        """A loader of ``module`` buffered one weight (before vLLM counts or processes it)."""
        if module in self._untouched:
            raise VLLMLoadError(
                f"{LOAD_ERROR_TAG} module {module!r} received a weight in a partial update that was to leave it "
                "untouched (it was not kept for a rollback); the update was stopped before vLLM processed it"
            )
        names = self._batch.names_of(loaded_tensor(item[1])) if self._batch is not None else []
        if not names:
            self.load_map.traced = False
        for n in names:
            self.load_map.receivers.setdefault(n, set()).add(module)

    def has_parameter(self, name: str) -> bool:
        """Whether the loaded model holds a parameter that checkpoint name ``name`` maps to (through the model's
        own ``hf_to_vllm_mapper``, which vLLM's Transformers backend builds per instance)."""
        mapper = getattr(self.model, "hf_to_vllm_mapper", None)
        mapped = name
        if mapper is not None and hasattr(mapper, "_map_name"):
            mapped = mapper._map_name(name)
        return mapped is not None and mapped in self._param_names

    def load(self, pairs: list[tuple[str, torch.Tensor]], optional: Collection[str] = ()) -> list[str]:
        if not self._open:
            raise RuntimeError("load() outside a reload bracket: call begin() first")
        pairs = [(n, t) for n, t in pairs if n not in optional or self.has_parameter(n)]
        if not pairs:  # every tensor of the batch was written in place (or is an alias the model does not hold)
            return []
        names = [n for n, _ in pairs]
        again = sorted({n for n in names if n in self._sent} | {n for n in names if names.count(n) > 1})
        if again:
            raise VLLMLoadError(f"{LOAD_ERROR_TAG} {again[:20]} sent twice in one sync; this batch was not loaded")
        self._sent.update(names)
        self._batch = BatchIndex(pairs)
        try:
            loaded = self.model.load_weights(iter(pairs))
        except VLLMLoadError:
            raise
        except Exception as exc:
            raise VLLMLoadError(
                f"{LOAD_ERROR_TAG} vLLM's {type(self.model).__name__}.load_weights raised on the batch {names[:20]}: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        finally:
            self._batch = None
        return sorted(loaded or ())

    def finish(self) -> LoadReport:
        if not self._open:
            return LoadReport()
        report = self._check_and_roll_back()
        if self._partial:
            # Left untouched on purpose: they keep the weights they hold, which the trainer proved unchanged.
            report.stale = [m for m in report.stale if m not in self._untouched]
        elif self._sent and report.ok:
            self.load_map.full_seen = True
        if not self._sent:
            report = LoadReport()  # nothing was sent (an empty stream): every module kept its weights, as asked
        report.units = self.load_map.units() if self.load_map.complete else None
        self._finalize()
        pending = self._to_record
        if report.ok and pending is not False:
            # Reading every module it may have changed takes time (and may find a tensor it cannot read): done here,
            # while the update can still fail, so that the commit after the vote only installs it.
            only = pending if isinstance(pending, set) else None
            moved = self._advanced(only)
            found = measure(self.model, None if only is None else only - set(moved))[0]
            self._measured = (only, {**found, **moved})
        return report

    def _advanced(self, only: set[str] | None) -> dict[str, Any]:
        """The written modules' records moved by this update's writes (:meth:`begin`'s ``moves``), by module:
        those :meth:`finish` need not read. Empty after a full update."""
        if only is None or self._moves is None:
            return {}
        out: dict[str, Any] = {}
        for module, by_param in self._moves().items():
            if module not in self._written or module not in only:
                continue
            before = recorded_state(self.model, module)
            after = None if before is None else advance(before, dict(by_param))
            if after is not None:
                out[module] = after
        return out

    def abort(self) -> None:
        if self._open:
            self._check_and_roll_back()
            self._finalize()

    def _watch_relayouts(self) -> None:
        """Until :meth:`_unwatch_relayouts`, note every MoE layer whose experts vLLM re-lays out itself: each
        experts object of :attr:`_relaid` gets an instance attribute shadowing its ``process_weights_after_loading``
        that records the layer and calls the class's method. vLLM calls it as
        ``moe_kernel.fused_experts.process_weights_after_loading(layer)`` (tests/vllm_contract.py checks that call
        in every supported release), so the watch sees it wherever vLLM runs it during the bracket."""
        self._relaid_by_vllm = set()
        seen = self._relaid_by_vllm
        for _, _, experts in self._relaid:
            method = type(experts).process_weights_after_loading

            def watched(layer: Any, _experts: Any = experts, _method: Any = method) -> Any:
                seen.add(id(layer))
                return _method(_experts, layer)

            experts.process_weights_after_loading = watched

    def _unwatch_relayouts(self) -> None:
        for _, _, experts in self._relaid:
            experts.__dict__.pop("process_weights_after_loading", None)

    def _relayout_reloaded_experts(self) -> None:
        """Repeat the experts' post-load re-layout on every MoE layer that received new weights in this bracket
        (not on one that kept or got back its old, already laid out weights), unless vLLM re-laid it out itself
        during the bracket: its experts' method ran (watched), or the layer's kernel was rebuilt (a new experts
        object: vLLM's kernel set-up re-lays the weights out as it builds one). Asked of the running vLLM, so a
        release whose reload does the re-layout is not laid out twice."""
        self._unwatch_relayouts()
        for _, module, experts in self._relaid:
            current = getattr(getattr(getattr(module, "quant_method", None), "moe_kernel", None), "fused_experts", None)
            by_vllm = id(module) in self._relaid_by_vllm or current is not experts
            if id(module) not in self._rolled_back and not by_vllm:
                experts.process_weights_after_loading(module)

    def _check_and_roll_back(self) -> LoadReport:
        """Every module still waiting for weights: report it, and put a partly loaded one back to its old weights
        (``finalize`` would otherwise rebuild it with its missing part uninitialized)."""
        vllm = _reload_bookkeeping()
        self._rolled_back = set()
        if vllm is None:
            return LoadReport(checked=False)
        layerwise, meta, utils = vllm
        report = LoadReport()
        for mname, module in self.model.named_modules():
            info = layerwise.LAYERWISE_INFO.get(module)
            if info is None or not info.can_load():
                continue  # rebuilt during the bracket, or not part of the reload
            params = {n: p for n, p in module._parameters.items() if p is not None and n not in meta.SKIP_LOAD_TENSORS}
            if not params:
                continue  # buffers only (attention scales, rotary caches): nothing the checkpoint holds
            expected = _expected_numel(module, params, utils)
            if info.load_numel >= expected:
                continue  # every checkpoint element arrived (the rest is declared padding)
            name = mname or type(module).__name__
            self._rolled_back.add(id(module))
            if info.load_numel == 0:
                report.stale.append(name)  # finalize puts the old weights back
                continue
            report.incomplete[name] = [*_what_it_got(info), f"{info.load_numel} of {expected} elements"]
            if info.kernel_tensors is not None:
                layerwise._place_kernel_tensors(module, info)
                info.reset()
        return report

    def _finalize(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        self._open = False
        self._sent = set()
        quiet = _QuietUntouched() if self._partial else None
        self._untouched, self._partial = set(), False
        log = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
        if quiet is not None:
            log.addFilter(quiet)  # vLLM warns for every module a partial update left untouched on purpose
        try:
            finalize_layerwise_reload(self.model, self.model_config)  # type: ignore[no-untyped-call]
        except BaseException:
            self._unwatch_relayouts()
            raise
        finally:
            if quiet is not None:
                log.removeFilter(quiet)
        self._relayout_reloaded_experts()


class _TracedLoads(list):  # type: ignore[type-arg]
    """A module's list of buffered weight-loader calls (vLLM's ``LayerReloadingInfo.loaded_weights``) that tells
    the bracket of each one as it is buffered."""

    def __init__(self, bracket: ReloadBracket, module: str, items: Any) -> None:
        super().__init__(items)
        self._bracket = bracket
        self._module = module

    def append(self, item: Any) -> None:
        self._bracket._buffered(self._module, item)
        super().append(item)


class _QuietUntouched(logging.Filter):
    """Drops vLLM's "Failed to load weights" warning, which a partial update's untouched modules all raise."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Failed to load weights" not in record.getMessage()
