"""Rank worker: a model returned by accelerator.prepare(...) is streamed with the right gatherer, chosen by itself.

Usage: accelerate_stream.py SETUP     (SETUP: zero3, fsdp2, fsdp1, ddp)

Accelerate 1.15 on a CPU-only machine does not honour a DeepSpeed or FSDP plugin as-is: with cpu=False it finds no
accelerator and sets distributed_type=NO (every rank reports 1 process and prepare() returns the bare model); with
cpu=True it sets MULTI_CPU and silently drops the plugin (DDP). The closest real path, used here: initialise
PartialState(cpu=True) (gloo, correct ranks) and, for FSDP, present the state as MULTI_GPU so that AcceleratorState
applies the FSDP plugin; ACCELERATE_TORCH_DEVICE=cpu gives FSDP1 a device_id it accepts. prepare() then runs the
real DeepSpeed / FSDP wrapping.
"""

from __future__ import annotations

import copy
import os
import sys

os.environ.setdefault("ACCELERATE_TORCH_DEVICE", "cpu")

import deepspeed
import torch
import torch.distributed as dist
from helpers import ZERO3_CONFIG, assert_matches, finish, lora, oracle, report, tiny_llama

from lora_stream import (
    Fsdp1Gatherer,
    Fsdp2Gatherer,
    ParamStream,
    PlainGatherer,
    ZeroThreeGatherer,
)

deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
DS = ZERO3_CONFIG


def make_accelerator(setup: str):  # type: ignore[no-untyped-def]
    from accelerate import Accelerator
    from accelerate.state import PartialState
    from accelerate.utils import DeepSpeedPlugin, DistributedType, FullyShardedDataParallelPlugin

    if setup == "ddp":
        return Accelerator(cpu=True)
    PartialState(cpu=True)
    if setup == "zero3":
        return Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=DS))
    PartialState._shared_state["distributed_type"] = DistributedType.MULTI_GPU
    if setup == "fsdp2":
        return Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))
    return Accelerator(
        fsdp_plugin=FullyShardedDataParallelPlugin(
            fsdp_version=1, use_orig_params=True, auto_wrap_policy="transformer_based_wrap"
        )
    )


def full_weights(prepared: torch.nn.Module, setup: str) -> dict[str, torch.Tensor]:
    """The prepared model's current weights, whole, keyed by the PeftModel's own names (for the oracle)."""
    from torch.distributed.tensor import DTensor

    if setup == "zero3":
        with deepspeed.zero.GatheredParameters(list(prepared.parameters()), modifier_rank=None):
            return {n: p.detach().clone() for n, p in prepared.module.named_parameters()}
    if setup == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with FSDP.summon_full_params(prepared, writeback=False):
            return {n.replace("_fsdp_wrapped_module.", ""): p.detach().clone() for n, p in prepared.named_parameters()}
    out = {}
    for n, p in prepared.named_parameters():
        t = p.full_tensor() if isinstance(p, DTensor) else p.detach()
        out[n.removeprefix("module.")] = t.clone()
    return out


def main() -> None:
    setup = sys.argv[1]
    accelerator = make_accelerator(setup)
    assert accelerator.num_processes == 2, accelerator.state
    pm = lora(tiny_llama(layers=2), target_modules=["q_proj", "v_proj"])
    template = copy.deepcopy(pm)
    opt = torch.optim.AdamW([p for p in pm.parameters() if p.requires_grad], lr=1e-2)
    prepared, opt = accelerator.prepare(pm, opt)
    ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(dist.get_rank()))
    accelerator.backward(prepared(input_ids=ids, labels=ids).loss)
    opt.step()
    weights = full_weights(prepared, setup)
    with torch.no_grad():
        for n, p in template.named_parameters():
            p.copy_(weights[n])
    stream = ParamStream(prepared)
    expected = {"zero3": ZeroThreeGatherer, "fsdp2": Fsdp2Gatherer, "fsdp1": Fsdp1Gatherer, "ddp": PlainGatherer}
    assert type(stream.gatherer) is expected[setup], (type(prepared), stream.gatherer)
    assert_matches(list(stream), oracle(template))
    report(
        rank=dist.get_rank(),
        event="match",
        setup=setup,
        wrapper=type(prepared).__name__,
        gatherer=stream.gatherer.name,
    )


if __name__ == "__main__":
    main()
    finish()
