"""Load a stream into a vLLM engine running in the trainer's process (TRL's "colocate" mode), group by group.

vLLM reloads weights given in checkpoint format inside one *layerwise reload* bracket: ``initialize_layerwise_reload``,
any number of ``model.load_weights`` calls, ``finalize_layerwise_reload``. A fused layer (``qkv_proj``,
``gate_up_proj``) is rebuilt once all of its shards have arrived, so whole layers must travel in the bracket; a
missing shard corrupts the layer silently. This sink therefore

1. checks the stream's ``metadata()`` against the checkpoint the engine was started from (safetensors headers only)
   and raises :class:`~lora_stream.sinks.CheckpointMismatchError` before touching the engine;
2. runs the bracket, loading one stream group per ``load_weights`` call, sending tied aliases (``lm_head.weight``)
   too, because vLLM on CPU keeps a separately repacked copy of a tied ``lm_head``;
3. checks that vLLM consumed every name it was sent and received every shard of every fused module;
4. resets the prefix cache (cached KV blocks were computed with the old weights) and returns a
   :class:`~lora_stream.sinks.SyncRecord`.

Three ways of running vLLM in-process are supported: one in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``),
one engine per trainer rank under ``distributed_executor_backend="external_launcher"`` (each rank loads the whole
tensors; vLLM's weight loaders take the rank's tensor-parallel shard), and an engine in a child process, reached
through ``collective_rpc`` with the worker extension :class:`~lora_stream.sinks.vllm_worker.LoraStreamWorkerExtension`
(tensors travel as safetensors bytes, so no insecure serialization is needed).
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import closing
from typing import Any

import torch

from ..errors import LoraStreamError
from ..stream import ParamStream
from .preflight import CheckpointMismatchError, checkpoint_metadata, compare_with_checkpoint, tied_output_names
from .record import SyncRecord
from .vllm_worker import ConsumptionCheck

__all__ = ["VLLMColocatedSink", "VLLMLoadError", "WORKER_EXTENSION"]

#: Pass as ``LLM(..., worker_extension_cls=WORKER_EXTENSION)`` for an engine in a child process.
WORKER_EXTENSION = "lora_stream.sinks.vllm_worker.LoraStreamWorkerExtension"

_LOCAL_MODEL_PATHS = (
    "engine_core.engine_core.model_executor.driver_worker.worker.model_runner",  # in-process engine core
    "model_executor.driver_worker.worker.model_runner",  # external_launcher
)


class VLLMLoadError(LoraStreamError):
    """vLLM did not take every tensor it was sent (unknown name, incomplete fused module, loader error).

    Raised after the reload bracket was closed, so the engine keeps running; layers loaded before the failure hold
    the new weights, the others the old ones. The next successful sync makes the engine consistent again.
    """


def _get_path(obj: Any, path: str) -> Any:
    for attr in path.split("."):
        obj = getattr(obj, attr)
    return obj


class VLLMColocatedSink:
    """Loads :class:`~lora_stream.ParamStream` passes into a ``vllm.LLM`` living in this process (or its child).

    >>> sink = VLLMColocatedSink(llm)                                     # doctest: +SKIP
    >>> record = sink.sync(ParamStream(model, group_by="layer"))          # every trainer rank calls this

    Every trainer rank must call ``sync`` with its own stream (the gathers are collectives); each rank loads into
    its own engine. ``checkpoint`` defaults to the directory the engine was started from.
    """

    def __init__(self, llm: Any, *, checkpoint: str | None = None, check_consumed: bool = True) -> None:
        self.llm = llm
        engine = llm.llm_engine
        self.model_config = engine.model_config
        self.checkpoint = checkpoint if checkpoint is not None else str(self.model_config.model)
        self._ckpt = checkpoint_metadata(self.checkpoint)
        self._tied = tied_output_names(self.checkpoint)
        self._runner = None
        for path in _LOCAL_MODEL_PATHS:
            try:
                self._runner = _get_path(engine, path)
                break
            except AttributeError:
                continue
        self.check_consumed = check_consumed

    @property
    def in_process(self) -> bool:
        """Whether the engine's model lives in this process (otherwise it is reached by ``collective_rpc``)."""
        return self._runner is not None

    def preflight(self, stream: ParamStream) -> dict[str, str]:
        """Compare ``stream.metadata()`` with the engine's checkpoint; return the aliases to send as well."""
        meta = stream.metadata()
        names = {m.name for m in meta}
        aliases = {a: p for a, p in stream.tied_aliases().items() if a in self._ckpt or a in self._tied}
        distinct_tied = sorted(n for n in self._tied if n in names)
        if distinct_tied:
            raise CheckpointMismatchError(
                f"the engine's checkpoint ties {distinct_tied} to the input embedding, but the stream yields them as "
                "separate tensors (e.g. modules_to_save on lm_head); the engine cannot serve that. Start vLLM from a "
                "checkpoint whose config has tie_word_embeddings=false.",
                unknown=[],
                missing=[],
                wrong_shape=[],
            )
        compare_with_checkpoint(meta, self._ckpt, may_be_missing=self._tied, extra_names=aliases)
        return aliases

    def sync(self, stream: ParamStream) -> SyncRecord:
        """Load one full pass of ``stream`` into the engine. Raises before touching it if the pre-flight fails."""
        aliases = self.preflight(stream)
        by_primary: dict[str, list[str]] = defaultdict(list)
        for alias, primary in aliases.items():
            by_primary[primary].append(alias)
        start = time.perf_counter()
        tensors = nbytes = groups = peak_group = 0
        check = ConsumptionCheck(type(self._runner.model) if self._runner is not None else object)
        problems: tuple[list[str], dict[str, list[str]]] = ([], {})
        self._begin()
        failed: BaseException | None = None
        try:
            try:
                with closing(stream.iter_groups()) as batches:  # a failure below ends the pass for every rank
                    for names, group in batches:
                        pairs = list(zip(names, group))
                        pairs += [(a, t) for n, t in zip(names, group) for a in by_primary.get(n, ())]
                        loaded = self._load(pairs)
                        check.add([n for n, _ in pairs], loaded)
                        groups += 1
                        group_bytes = sum(t.numel() * t.element_size() for _, t in pairs)
                        tensors += len(pairs)
                        nbytes += group_bytes
                        peak_group = max(peak_group, group_bytes)
                        del pairs, group
            except BaseException as exc:
                failed = exc
                raise
            finally:
                # Always close the bracket: an open one leaves layers on the meta device and the engine's next
                # forward kills it. Finalizing restores every layer that did not receive all its weights.
                try:
                    problems = self._finish(check)
                except Exception as finish_exc:
                    if failed is None:
                        raise
                    failed.add_note(f"lora_stream: closing vLLM's reload bracket also failed: {finish_exc!r}")
            if self.check_consumed:
                unconsumed, incomplete = problems
                if unconsumed or incomplete:
                    raise VLLMLoadError(
                        f"vLLM did not consume {len(unconsumed)} name(s) {unconsumed[:20]} and left fused modules "
                        f"incomplete {dict(list(incomplete.items())[:20])}"
                    )
        except BaseException as exc:
            failed = failed or exc
            raise
        finally:
            # Whatever happened, some layers may hold new weights now: KV blocks cached under the old ones must go.
            self._reset_prefix_cache(failed)
        record = SyncRecord(
            sink="vllm-colocated",
            tensors=tensors,
            bytes=nbytes,
            groups=groups,
            seconds=time.perf_counter() - start,
            peak_group_bytes=peak_group,
            peak_gathered_bytes=stream.last_stats.peak_gathered_bytes,
        )
        record.log()
        return record

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
        if self._runner is not None:
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

            initialize_layerwise_reload(self._runner.model)
        else:
            self._rpc("lora_stream_begin")

    def _load(self, pairs: list[tuple[str, torch.Tensor]]) -> list[str]:
        if self._runner is not None:
            return sorted(self._runner.model.load_weights(iter(pairs)))
        from safetensors.torch import save

        # The child engine gets bytes: msgpack would drop tensor data, and pickle needs insecure serialization.
        blob = save({n: t.contiguous() for n, t in pairs})
        return list(self._rpc("lora_stream_load", blob)[0])

    def _finish(self, check: ConsumptionCheck) -> tuple[list[str], dict[str, list[str]]]:
        if self._runner is not None:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            finalize_layerwise_reload(self._runner.model, self._runner.model_config)  # type: ignore[no-untyped-call]
            return check.problems()
        # Every worker checked its own bracket; report the union.
        unconsumed: list[str] = []
        incomplete: dict[str, list[str]] = {}
        for worker_unconsumed, worker_incomplete in self._rpc("lora_stream_finish"):
            unconsumed += [n for n in worker_unconsumed if n not in unconsumed]
            incomplete.update(worker_incomplete)
        return unconsumed, incomplete

    def _rpc(self, method: str, *args: Any) -> list[Any]:
        try:
            return list(self.llm.collective_rpc(method, args=args))
        except Exception as exc:
            if "has no attribute" in str(exc) and method in str(exc):
                raise LoraStreamError(
                    f"the vLLM engine runs in a child process and its workers lack lora_stream's extension; start it "
                    f"with LLM(..., worker_extension_cls={WORKER_EXTENSION!r}) (or set "
                    "VLLM_ENABLE_V1_MULTIPROCESSING=0 to keep the engine in this process)"
                ) from exc
            raise
