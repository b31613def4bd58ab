"""Demo: a tiny random Llama with a non-zero LoRA adapter, streamed and checked against peft's own merge.

Run with `python3 -m nox -s demo` (sets up everything) or, in an environment that has the stack,
`python benchmarks/demo.py`.
"""

from __future__ import annotations

import copy
import warnings

import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

from lora_stream import ParamStream

warnings.filterwarnings("ignore")


def main() -> None:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=1000,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=False,
    )
    base = LlamaForCausalLM(config).to(torch.bfloat16)
    # init_lora_weights=False: lora_B is random, so the merge is not the identity.
    model = get_peft_model(
        base,
        LoraConfig(
            r=8,
            lora_alpha=16,
            target_modules="all-linear",
            use_dora=False,
            modules_to_save=["lm_head"],
            init_lora_weights=False,
        ),
    )
    reference = {n: p.detach() for n, p in copy.deepcopy(model).float().merge_and_unload().named_parameters()}

    stream = ParamStream(model, group_by="layer")
    worst = 0.0
    for name, tensor in stream:
        ref = reference[name]
        worst = max(worst, float((tensor.float() - ref).norm() / ref.norm()))
    s = stream.last_stats
    rows = [
        ("groups", f"{s.groups}"),
        ("tensors", f"{s.tensors} (peft merge has {len(reference)})"),
        ("bytes streamed", f"{s.bytes / 2**20:.2f} MiB (bf16)"),
        ("largest group", f"{max(stream.group_gathered_bytes) / 2**20:.2f} MiB"),
        ("tensors merged or cast", f"{s.computed}; the rest yielded without a copy"),
        ("max rel. error vs peft merge_and_unload (fp32)", f"{worst:.2e} (bf16 rounding: 3.9e-03)"),
        ("seconds", f"{s.seconds:.3f}"),
    ]
    width = max(len(k) for k, _ in rows)
    print("lora_stream demo: tiny Llama (4 layers) + LoRA r=8 on all linear layers, bf16")
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")
    ok = s.tensors == len(reference) and worst < 4e-3
    print("MATCH" if ok else "MISMATCH")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
