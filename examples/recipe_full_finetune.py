"""Recipe: full fine-tuning under DeepSpeed ZeRO-3, vLLM serving bfloat16 colocated in every trainer rank, synced
as element syncs: only the served elements that changed travel.

    python examples/tiny_model.py /tmp/tiny-llama
    torchrun --nproc-per-node 2 examples/recipe_full_finetune.py /tmp/tiny-llama

Every parameter trains (no LoRA) with float32 master weights and AdamW; the engine serves bfloat16. After every
optimizer step each rank diffs its own ZeRO-3 partition, cast to bfloat16, against what the engine last committed,
and sends only the elements that changed: nothing is gathered. The first sync is full. On GPUs the same script runs
over NCCL.
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
    dtype="bfloat16",  # served in bfloat16, trained in float32
    seed=0,  # every rank samples the same tokens
)
ds_config = {
    "train_micro_batch_size_per_gpu": 1,
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    "zero_allow_untested_optimizer": True,
}
model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)  # float32 master weights
optimizer = torch.optim.AdamW(model.parameters(), lr=2e-5)  # every parameter trains, at an RL-sized step
engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
# --8<-- [end:setup]

# --8<-- [start:loop]
tokenizer = AutoTokenizer.from_pretrained(model_dir)
batch = tokenizer(["t5 t17 t42 t99 t3 t8"], return_tensors="pt").to(engine.device)
sink = VLLMColocatedSink(llm, elements=True)  # only the served elements that changed
for step in range(3):
    loss = engine(**batch, labels=batch["input_ids"]).loss
    engine.backward(loss)
    engine.step()
    # Every rank, every sync. Each rank diffs its own partition, cast to what vLLM serves.
    record = sink.sync(ParamStream(engine, dtype=torch.bfloat16, group_by="layer"), version=f"step-{step}")
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=0)  # and the log-probability of what it picked
    completion = llm.generate(["t5 t17 t42"], params, use_tqdm=False)[0].outputs[0]
    if rank == 0:
        e = record.elements
        if e.get("tensors"):  # each rank sent the changed elements of its own partition: nothing gathered
            how = f"as elements ({e['tensors']} tensors, {record.element_fraction:.2%} changed)"
        else:  # whole tensors, gathered one layer at a time: record.full_because says why
            how = f"whole ({record.full_because or e.get('refused')})"
        whole = record.bytes - e.get("bytes", 0) + e.get("whole_bytes", 0)  # what whole tensors would have cost
        print(
            f"step {step}: synced {how}: sent {record.bytes} bytes of {whole} whole, "
            f"peak gathered {record.peak_gathered_bytes} bytes"
        )
        print(f"step {step}: vLLM now generates {completion.text!r} (log-prob {completion.cumulative_logprob:.4f})")
# --8<-- [end:loop]
