"""Quickstart: a LoRA model trained in this process, its merged weights streamed into a vLLM engine after each step.

    python examples/tiny_model.py /tmp/tiny-llama && python examples/quickstart.py /tmp/tiny-llama

One process, no distributed setup. The same two lines work unchanged under DeepSpeed ZeRO-3, FSDP or DDP (see the
recipes); only the model you pass changes.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # keep the engine in this process
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache when vLLM runs on a CPU


def main(model_dir: str) -> None:
    # --8<-- [start:setup]
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import LLM, SamplingParams

    from lora_stream import ParamStream, VLLMColocatedSink, stream_merged_params

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
        LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"),
    )
    llm = LLM(model=model_dir, dtype="float32", enforce_eager=True, max_model_len=128)
    # --8<-- [end:setup]

    # --8<-- [start:iterate]
    with stream_merged_params(model) as weights:  # LoRA merged out of place; the model is never written to
        for name, tensor in weights:  # the base model's checkpoint names: "model.layers.0.self_attn.q_proj.weight"
            assert not name.startswith("base_model") and "lora_" not in name
    # --8<-- [end:iterate]

    # --8<-- [start:loop]
    sink = VLLMColocatedSink(llm)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    batch = tokenizer(["t5 t17 t42 t99 t3 t8"], return_tensors="pt")
    greedy = SamplingParams(temperature=0, max_tokens=8)
    for step in range(3):
        loss = model(**batch, labels=batch["input_ids"]).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        record = sink.sync(ParamStream(model, group_by="layer"), version=f"step-{step}")  # the merged weights
        completion = llm.generate(["t5 t17 t42"], greedy, use_tqdm=False)[0].outputs[0].text
        print(
            f"step {step}: loss {loss.item():.3f}, synced {record.tensors} tensors "
            f"({record.skipped_tensors} unchanged, skipped) in {record.seconds:.3f} s"
        )
        print(f"step {step}: vLLM now generates {completion!r}")
    # --8<-- [end:loop]


if __name__ == "__main__":
    main(sys.argv[1])
