"""Rank worker: LoHa, LoKr, LoRA/DoRA on convolutions and LoRA on MoE experts (target_parameters) under a sharded
gatherer equal peft's merge.

Usage: sharded_tuners.py zero3|fsdp2

Each rank builds the same perturbed peft models (same seeds), takes the oracle from an unsharded copy, shards the
model (DeepSpeed ZeRO-3 engine, or ``fully_shard``), streams it and compares. Prints one ``RESULT {json}`` line.
"""

from __future__ import annotations

import copy
import sys
import warnings

import torch
import torch.distributed as dist
from helpers import assert_matches, finish, oracle, perturb_adapters, report, zero3_engine, zoo

from lora_stream import ParamStream


def configs() -> dict[str, object]:
    from peft import LoHaConfig, LoKrConfig, LoraConfig

    conv = ["c1", "c2", "c2_1x1", "c3"]
    return {
        "loha": LoHaConfig(target_modules=["lin", "c2", "c1"], init_weights=False, r=4),
        "loha-effective-conv": LoHaConfig(target_modules=["c2"], init_weights=False, use_effective_conv2d=True),
        "lokr": LoKrConfig(target_modules=["lin", "c2", "c1"], init_weights=False, r=4),
        "lora-conv": LoraConfig(target_modules=conv, init_lora_weights=False, r=4, lora_bias=True),
        "dora-conv": LoraConfig(target_modules=[*conv, "lin"], init_lora_weights=False, r=4, use_dora=True),
        "lora-experts": LoraConfig(
            target_modules=["lin"],
            target_parameters=["moe.gate_up", "moe.down", "moe.router", "moe_t.gate_up"],
            init_lora_weights=False,
            r=4,
        ),
    }


def shard(model: torch.nn.Module, how: str) -> torch.nn.Module:
    if how == "zero3":
        engine = zero3_engine(model)
        assert all(p.numel() == 0 or getattr(p, "ds_persist", False) for p in engine.module.parameters())
        return engine  # type: ignore[no-any-return]
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    assert all(isinstance(p, DTensor) for p in model.parameters())
    return model


def main() -> None:
    how = sys.argv[1]
    dist.init_process_group("gloo")
    from peft import get_peft_model

    results: dict[str, object] = {}
    for case, config in configs().items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pm = get_peft_model(zoo(), config)  # type: ignore[arg-type]
        perturb_adapters(pm)
        ref = oracle(copy.deepcopy(pm))
        sharded = shard(pm, how)
        stream = ParamStream(sharded, group_by="module")
        assert stream.gatherer.name == how, stream.gatherer.name
        try:
            assert_matches(stream, ref)
            results[case] = "match"
        except Exception as exc:  # report every case, not only the first failure
            results[case] = f"{type(exc).__name__}: {str(exc)[:300]}"
    report(rank=dist.get_rank(), gatherer=how, cases=results)
    finish(0 if all(v == "match" for v in results.values()) else 1)


if __name__ == "__main__":
    main()
