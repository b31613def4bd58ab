"""Runs inside vLLM's worker processes: the reload bracket and the consumption check, driven over collective_rpc.

Start an engine that lives in a child process with
``LLM(..., worker_extension_cls="lora_stream.sinks.vllm_worker.LoraStreamWorkerExtension")``; vLLM mixes this class
into its worker, and :class:`~lora_stream.sinks.VLLMColocatedSink` calls its methods by name. Weights arrive as
safetensors bytes (msgpack carries bytes intact, and nothing needs ``VLLM_ALLOW_INSECURE_SERIALIZATION``).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import Any

__all__ = ["ConsumptionCheck", "LoraStreamWorkerExtension"]


class ConsumptionCheck:
    """Which checkpoint names vLLM consumed during one reload bracket, in vLLM's own (fused) naming.

    ``load_weights`` returns the vLLM parameter names it filled; q/k/v arrive as ``qkv_proj`` and so on. A name
    that maps to nothing that was filled was ignored (vLLM drops e.g. unexpected ``.bias`` names silently), and a
    fused module that did not get all of its shards is corrupted at finalize.
    """

    def __init__(self, model_cls: type) -> None:
        self.mapper = getattr(model_cls, "hf_to_vllm_mapper", None)
        self.packed: dict[str, list[str]] = dict(getattr(model_cls, "packed_modules_mapping", {}) or {})
        self.loaded: set[str] = set()
        self.sent: list[str] = []

    def add(self, sent: Iterable[str], loaded: Iterable[str]) -> None:
        self.sent += list(sent)
        self.loaded |= set(loaded)

    def problems(self) -> tuple[list[str], dict[str, list[str]]]:
        unconsumed: list[str] = []
        shards: dict[str, set[str]] = defaultdict(set)
        for name in self.sent:
            mapped: Any = (name, None)
            if self.mapper is not None and hasattr(self.mapper, "_map_name_with_shard"):
                mapped = self.mapper._map_name_with_shard(name)
            if mapped is None or mapped[0] not in self.loaded:
                unconsumed.append(name)
            elif mapped[1] is not None:
                shards[mapped[0]].add(str(mapped[1]))
        incomplete: dict[str, list[str]] = {}
        for vname, got in shards.items():
            parts = vname.split(".")
            need = self.packed.get(parts[-2] if len(parts) >= 2 else vname)
            if need and len(got) < len(need):
                incomplete[vname] = sorted(got)
        return unconsumed, incomplete


class LoraStreamWorkerExtension:
    """Mixed into vLLM's worker (``worker_extension_cls``); ``self.model_runner`` is the worker's."""

    model_runner: Any

    def lora_stream_begin(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        self._lora_stream_check = ConsumptionCheck(type(self.model_runner.model))
        initialize_layerwise_reload(self.model_runner.model)

    def lora_stream_load(self, blob: bytes) -> list[str]:
        from safetensors.torch import load

        weights = load(bytes(blob))
        loaded = sorted(self.model_runner.model.load_weights(iter(weights.items())))
        self._lora_stream_check.add(weights, loaded)
        return loaded

    def lora_stream_finish(self) -> tuple[list[str], dict[str, list[str]]]:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model_runner.model, self.model_runner.model_config)  # type: ignore[no-untyped-call]
        check = getattr(self, "_lora_stream_check", None)
        return check.problems() if check is not None else ([], {})
