"""Recipe: a plain PyTorch + DeepSpeed ZeRO-3 training loop with LoRA, vLLM colocated in every trainer rank.

    python examples/tiny_model.py /tmp/tiny-llama
    torchrun --nproc-per-node 2 examples/recipe_zero3.py /tmp/tiny-llama

Every rank runs one vLLM engine slice (``external_launcher``: tensor parallel across the trainer's ranks, in the
trainer's processes) and, after every optimizer step, streams the merged weights into it one decoder layer at a
time. No rank ever holds the whole model gathered. On GPUs the same script runs over NCCL.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine lives in this process
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

# --8<-- [start:setup]
import deepspeed
import torch
import torch.distributed as dist
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer
from vllm import LLM, SamplingParams

from lora_stream import ParamStream, VLLMColocatedSink

model_dir = sys.argv[1]
on_gpu = torch.cuda.is_available()
if not on_gpu:
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # DeepSpeed's CPU shared-memory op is not built
deepspeed.init_distributed(dist_backend="nccl" if on_gpu else "gloo")
rank, world = dist.get_rank(), dist.get_world_size()

# Before the trainer takes its memory: vLLM sizes its KV cache from what is free.
llm = LLM(
    model=model_dir,
    distributed_executor_backend="external_launcher",  # one engine slice per trainer rank
    tensor_parallel_size=world,
    enforce_eager=True,
    max_model_len=128,
    dtype="bfloat16" if on_gpu else "float32",
    seed=0,  # every rank samples the same tokens
)
ds_config = {
    "train_micro_batch_size_per_gpu": 1,
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    "zero_allow_untested_optimizer": True,
}
model = get_peft_model(
    AutoModelForCausalLM.from_pretrained(model_dir), LoraConfig(r=8, lora_alpha=16, target_modules="all-linear")
)
trainable = [p for p in model.parameters() if p.requires_grad]
engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(trainable, lr=1e-2), config=ds_config)
# --8<-- [end:setup]

# --8<-- [start:loop]
tokenizer = AutoTokenizer.from_pretrained(model_dir)
batch = tokenizer(["t5 t17 t42 t99 t3 t8"], return_tensors="pt").to(engine.device)
sink = VLLMColocatedSink(llm)
for step in range(3):
    loss = engine(**batch, labels=batch["input_ids"]).loss
    engine.backward(loss)
    engine.step()
    # Every rank, every sync: each group's gather is a collective. One decoder layer at a time.
    record = sink.sync(ParamStream(engine, group_by="layer"), version=f"step-{step}")
    completion = llm.generate(["t5 t17 t42"], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    if rank == 0:
        print(
            f"step {step}: synced {record.tensors} tensors ({record.skipped_tensors} unchanged, skipped), "
            f"peak gathered {record.peak_gathered_bytes} bytes"
        )
        print(f"step {step}: vLLM now generates {completion[0].outputs[0].text!r}")
# --8<-- [end:loop]
