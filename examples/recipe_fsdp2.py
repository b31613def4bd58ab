"""Recipe: an FSDP2 (``fully_shard``) training loop with LoRA, pushing into a running vLLM server after every step.

    python examples/tiny_model.py /tmp/tiny-llama
    VLLM_SERVER_DEV_MODE=1 python -m vllm.entrypoints.openai.api_server --model /tmp/tiny-llama \\
        --port 8000 --weight-transfer-config '{"backend": "lora_stream"}' &  # the same on GPUs; docs/vllm_server.md
    torchrun --nproc-per-node 2 examples/recipe_fsdp2.py /tmp/tiny-llama http://127.0.0.1:8000

Rank 0 talks to the server and sends; every rank takes part in the gathers. Set ``VLLM_API_KEY`` on both sides
when the server runs with ``--api-key`` (and the guard middleware, docs/security.md).
"""

from __future__ import annotations

import os
import sys

# --8<-- [start:setup]
import requests
import torch
import torch.distributed as dist
from peft import LoraConfig, get_peft_model
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM, AutoTokenizer

from lora_stream import ParamStream, VLLMServerSink

model_dir, url = sys.argv[1], sys.argv[2]
on_gpu = torch.cuda.is_available()
dist.init_process_group("nccl" if on_gpu else "gloo")
rank, world = dist.get_rank(), dist.get_world_size()
if on_gpu:
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))

model = get_peft_model(
    AutoModelForCausalLM.from_pretrained(model_dir), LoraConfig(r=8, lora_alpha=16, target_modules="all-linear")
)
mesh = init_device_mesh("cuda" if on_gpu else "cpu", (world,))
for layer in model.base_model.model.model.layers:  # one FSDP unit per decoder layer, then the root
    fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
# --8<-- [end:setup]

# --8<-- [start:loop]
tokenizer = AutoTokenizer.from_pretrained(model_dir)
batch = tokenizer(["t5 t17 t42 t99 t3 t8"], return_tensors="pt").to(mesh.device_type)
sink = VLLMServerSink(
    url, rank=rank, backend="nccl" if on_gpu else "gloo", api_key=os.environ.get("VLLM_API_KEY"), timeout=120
)
for step in range(3):
    loss = model(**batch, labels=batch["input_ids"]).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    record = sink.sync(ParamStream(model, group_by="layer"), version=f"step-{step}")  # every rank
    if rank == 0:
        reply = requests.post(
            f"{url}/v1/completions",
            json={"model": model_dir, "prompt": "t5 t17 t42", "max_tokens": 8, "temperature": 0},
            headers={"Authorization": f"Bearer {os.environ['VLLM_API_KEY']}"} if "VLLM_API_KEY" in os.environ else {},
            timeout=60,
        ).json()
        print(f"step {step}: synced {record.tensors} tensors, server version {record.version}")
        print(f"step {step}: the server now generates {reply['choices'][0]['text']!r}")
sink.close()
# --8<-- [end:loop]
dist.destroy_process_group()
if not on_gpu:
    # torch 2.13's gloo process groups can abort the process at interpreter exit ("terminate called without an
    # active exception") after all the work is done; leave without that teardown.
    sys.stdout.flush()
    os._exit(0)
