"""Recipe: one training loop keeps a fleet of vLLM servers in sync, one transaction per step.

    python examples/tiny_model.py /tmp/tiny-llama
    for port in 8000 8001; do
        VLLM_SERVER_DEV_MODE=1 python -m vllm.entrypoints.openai.api_server --model /tmp/tiny-llama \\
            --port $port --weight-transfer-config '{"backend": "lora_stream"}' &   # docs/vllm_server.md
    done
    torchrun --nproc-per-node 2 examples/recipe_fleet.py /tmp/tiny-llama http://127.0.0.1:8000 http://127.0.0.1:8001

Server ``i`` is fed by trainer rank ``i % 2``: each rank sends the model once per step. A server that fails is left
out of that step (``on_replica_failure="exclude"``) and readmitted at the next one.
"""

from __future__ import annotations

import os
import sys

import requests
import torch
import torch.distributed as dist
from peft import LoraConfig, get_peft_model
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM

from lora_stream import ParamStream, VLLMServerSink

model_dir, urls = sys.argv[1], sys.argv[2:]
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
model = get_peft_model(
    AutoModelForCausalLM.from_pretrained(model_dir), LoraConfig(r=8, lora_alpha=16, target_modules="all-linear")
)
mesh = init_device_mesh("cpu", (world,))
for layer in model.base_model.model.model.layers:
    fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
ids = torch.tensor([[5, 17, 42, 99, 3, 8]])

# --8<-- [start:loop]
sink = VLLMServerSink(
    urls,  # every server of the fleet
    api_key=os.environ.get("VLLM_API_KEY"),
    on_replica_failure="exclude",  # a server that fails is left out; the others commit
    timeout=120,
)
for step in range(3):
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    record = sink.sync(ParamStream(model, group_by="layer"), version=f"step-{step}")  # every rank
    healthy = record.replicas  # route generation to these; record.excluded says why the others are not
    if rank == 0:
        print(
            f"step {step}: synced {record.tensors} tensors ({record.skipped_tensors} unchanged, skipped) to "
            f"{len(healthy)} servers, version {record.version}"
        )
sink.close()
# --8<-- [end:loop]
if rank == 0:
    for url in urls:
        served = requests.get(f"{url}/weight_info", timeout=10).json()["weight_version"]
        print(f"{url} serves {served}")
dist.destroy_process_group()
sys.stdout.flush()
os._exit(0)  # torch 2.13's gloo groups can abort the process at interpreter exit after all the work is done
