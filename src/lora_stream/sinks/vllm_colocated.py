"""Load a stream into a vLLM engine running in the trainer's process (TRL's "colocate" mode), group by group.

vLLM reloads weights given in checkpoint format inside one *layerwise reload* bracket: ``initialize_layerwise_reload``,
any number of ``model.load_weights`` calls, ``finalize_layerwise_reload``. A fused layer (``qkv_proj``,
``gate_up_proj``) is rebuilt once all of its shards have arrived, so whole layers must travel in the bracket; a
missing shard corrupts the layer silently. This sink therefore

1. runs the pre-flight (:func:`~lora_stream.sinks.preflight.preflight`: names, shapes and tied weights against the
   checkpoint the engine was started from) and raises :class:`~lora_stream.sinks.CheckpointMismatchError` before
   touching the engine;
2. opens the reload bracket (:class:`~lora_stream.sinks.reload.ReloadBracket`) and loads one group of the
   :class:`~lora_stream.sinks.source.SyncSource` per ``load_weights`` call (tied aliases such as ``lm_head.weight``
   included: vLLM on CPU keeps a separately repacked copy of a tied ``lm_head``);
3. closes the bracket and raises :class:`~lora_stream.sinks.reload.VLLMLoadError` if vLLM did not reload every module
   or fill every shard of a fused module;
4. resets the prefix cache (cached KV blocks were computed with the old weights), whatever happened, and returns
   the :class:`~lora_stream.sinks.SyncRecord` of what was sent.

The server sink runs the same pre-flight, source and bracket; only the transport differs.

Three ways of running vLLM in-process are supported: one in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``),
one engine per trainer rank under ``distributed_executor_backend="external_launcher"`` (each rank loads the whole
tensors; vLLM's weight loaders take the rank's tensor-parallel shard), and an engine in a child process, reached
through ``collective_rpc`` with the worker extension :class:`~lora_stream.sinks.vllm_worker.LoraStreamWorkerExtension`
(tensors travel as safetensors bytes, so no insecure serialization is needed).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from ..errors import LoraStreamError
from ..stream import ParamStream
from .preflight import EngineCheckpoint, preflight
from .record import SyncRecord
from .reload import LoadReport, ReloadBracket, VLLMLoadError
from .source import SyncSource

__all__ = ["VLLMColocatedSink", "VLLMLoadError", "WORKER_EXTENSION"]

#: Pass as ``LLM(..., worker_extension_cls=WORKER_EXTENSION)`` for an engine in a child process.
WORKER_EXTENSION = "lora_stream.sinks.vllm_worker.LoraStreamWorkerExtension"

_LOCAL_MODEL_PATHS = (
    "engine_core.engine_core.model_executor.driver_worker.worker.model_runner",  # in-process engine core
    "model_executor.driver_worker.worker.model_runner",  # external_launcher
)


def _get_path(obj: Any, path: str) -> Any:
    for attr in path.split("."):
        obj = getattr(obj, attr)
    return obj


def local_model_runner(engine: Any) -> Any | None:
    """The model runner of ``engine`` (an ``LLM.llm_engine``) when its worker lives in this process: an in-process
    engine core or ``external_launcher``. ``None`` when the engine runs in a child process."""
    for path in _LOCAL_MODEL_PATHS:
        try:
            return _get_path(engine, path)
        except AttributeError:
            continue
    return None


def engine_checkpoint(engine: Any, checkpoint: str | bool | None) -> EngineCheckpoint | None:
    """What the pre-flight compares with: ``checkpoint``'s safetensors headers, by default those of the directory
    the engine was started from; ``None`` for ``checkpoint=False`` (no pre-flight)."""
    if checkpoint is False:
        return None
    return EngineCheckpoint.read(checkpoint if isinstance(checkpoint, str) else str(engine.model_config.model))


class VLLMColocatedSink:
    """Loads :class:`~lora_stream.ParamStream` passes into a ``vllm.LLM`` living in this process (or its child).

    >>> sink = VLLMColocatedSink(llm)  # doctest: +SKIP
    >>> record = sink.sync(ParamStream(model, group_by="layer"), version=f"step-{step}")  # every trainer rank

    Every trainer rank must call ``sync`` with its own stream (the gathers are collectives); each rank loads into
    its own engine. ``checkpoint`` is where the pre-flight reads the served model's safetensors headers: by default
    the directory the engine was started from; ``False`` skips the pre-flight (the reload check after loading
    still runs unless ``check_consumed=False``). Implements :class:`~lora_stream.sinks.base.Sink`.
    """

    name = "vllm-colocated"

    def __init__(self, llm: Any, *, checkpoint: str | bool | None = None, check_consumed: bool = True) -> None:
        self.llm = llm
        engine = llm.llm_engine
        self.model_config = engine.model_config
        self._ckpt = engine_checkpoint(engine, checkpoint)
        self.checkpoint = self._ckpt.path if self._ckpt is not None else None
        runner = local_model_runner(engine)
        self._bracket = ReloadBracket(runner.model, runner.model_config) if runner is not None else None
        self.check_consumed = check_consumed
        self.version: str | None = None

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
        """Load one full pass of ``stream`` into the engine. Raises before touching it if the pre-flight fails."""
        start = time.perf_counter()
        source = SyncSource(stream, self.preflight(stream), version)
        failed: BaseException | None = None
        self._begin()
        try:
            try:
                with source.batches() as batches:  # a failure below ends the pass for every rank, with its reason
                    for names, tensors in batches:
                        self._load(list(zip(names, tensors)), source.aliases)
            except BaseException as exc:
                failed = exc
                raise
            finally:
                # Always close the bracket: an open one leaves layers on the meta device and the engine's next
                # forward kills it. Closing restores every layer that did not receive all its weights.
                report = self._finish(failed)
            error = report.error() if self.check_consumed else None
            if error is not None:
                raise error
        except BaseException as exc:
            failed = failed or exc
            raise
        finally:
            # Whatever happened, some layers may hold new weights now: KV blocks cached under the old ones must go.
            self._reset_prefix_cache(failed)
        self.version = version
        record = source.record(self.name, time.perf_counter() - start)
        record.log()
        return record

    def close(self) -> None:
        """Nothing is held between syncs."""

    def _reset_prefix_cache(self, failed: BaseException | None) -> None:
        try:
            self.llm.reset_prefix_cache()
        except Exception as exc:
            if failed is None:
                raise
            # The sync's own error is the one to report; say that the cache may be stale too.
            failed.add_note(f"lora_stream: resetting vLLM's prefix cache after the failure also failed: {exc!r}")

    # -- the bracket, in process or over collective_rpc ------------------------------------------------------------
    def _begin(self) -> None:
        if self._bracket is not None:
            self._bracket.begin()
        else:
            self._rpc("lora_stream_begin")

    def _load(self, pairs: list[tuple[str, torch.Tensor]], optional: list[str]) -> None:
        if self._bracket is not None:
            self._bracket.load(pairs, optional)
            return
        from safetensors.torch import save

        # The child engine gets bytes: msgpack would drop tensor data, and pickle needs insecure serialization.
        self._rpc("lora_stream_load", save({n: t.contiguous() for n, t in pairs}), optional)

    def _finish(self, failed: BaseException | None) -> LoadReport:
        """Close the bracket: checked after a complete pass, unchecked after a failure (whose error is reported)."""
        try:
            if self._bracket is not None:
                if failed is None:
                    return self._bracket.finish()
                self._bracket.abort()
                return LoadReport()
            if failed is None:
                report = LoadReport()
                for wire in self._rpc("lora_stream_finish"):  # every worker checked its own bracket
                    report.merge(LoadReport.from_wire(wire))
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


def engine_rpc(llm: Any, method: str, *args: Any) -> list[Any]:
    """Call lora_stream's worker extension ``method`` on every worker of an engine that runs in a child process."""
    try:
        return list(llm.collective_rpc(method, args=args))
    except Exception as exc:
        if "has no attribute" in str(exc) and method in str(exc):
            raise LoraStreamError(
                f"the vLLM engine runs in a child process and its workers lack lora_stream's extension; start it "
                f"with LLM(..., worker_extension_cls={WORKER_EXTENSION!r}) (or set "
                "VLLM_ENABLE_V1_MULTIPROCESSING=0 to keep the engine in this process)"
            ) from exc
        raise
