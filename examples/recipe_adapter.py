"""Recipe: adapter sync. Only the LoRA factors go into vLLM's LoRA manager after each step; the base stays put.

    python examples/tiny_model.py /tmp/tiny-llama && python examples/recipe_adapter.py /tmp/tiny-llama

The engine serves the trainer's base checkpoint with ``enable_lora=True``; generation passes the ``LoRARequest`` the
sync returns. Valid when the base does not train (docs/adapter_sync.md says when and what it costs).
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

# --8<-- [start:setup]
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer
from vllm import LLM, SamplingParams

from lora_stream import AdapterStream, ParamStream, VLLMColocatedSink, VLLMLoRASink

model_dir = sys.argv[1]
llm = LLM(model=model_dir, enable_lora=True, max_lora_rank=16, enforce_eager=True, max_model_len=128, dtype="float32")
model = get_peft_model(
    AutoModelForCausalLM.from_pretrained(model_dir),
    LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", use_rslora=True),  # any scaling: sent pre-applied
)
optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
# --8<-- [end:setup]

# --8<-- [start:base_once]
# Only when the engine's base is not the trainer's (a changed base, a resumed run): push the base once, merged
# stream under disable_adapter(). Adapter syncs never send the base.
with model.disable_adapter():
    VLLMColocatedSink(llm).sync(ParamStream(model, group_by="layer"))
# --8<-- [end:base_once]

# --8<-- [start:loop]
tokenizer = AutoTokenizer.from_pretrained(model_dir)
batch = tokenizer(["t5 t17 t42 t99 t3 t8"], return_tensors="pt")
sink = VLLMLoRASink(llm, lora_name="policy")
greedy = SamplingParams(temperature=0, max_tokens=8)
for step in range(3):
    loss = model(**batch, labels=batch["input_ids"]).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    record = sink.sync(AdapterStream(model), version=f"step-{step}")  # a few MiB, not the model
    out = llm.generate(["t5 t17 t42"], greedy, lora_request=record.lora_request, use_tqdm=False)
    print(
        f"step {step}: synced {record.tensors} LoRA tensors ({record.bytes} bytes) as {record.lora_request.lora_name}"
    )
    print(f"step {step}: vLLM through the adapter generates {out[0].outputs[0].text!r}")
# --8<-- [end:loop]
