"""One rank of one FSDP2 benchmark variant (started by bench_fsdp2.py; not meant to be run by hand)."""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RssSampler, add_model_args, llama_config, rss


def build(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from peft import LoraConfig, get_peft_model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaForCausalLM

    cfg = llama_config(args)
    torch.manual_seed(0)
    model = get_peft_model(
        LlamaForCausalLM(cfg).to(torch.bfloat16),
        LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules="all-linear", init_lora_weights=False),
    )
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.base_model.model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def whole_full_tensor_sync(model, dest: dict[str, torch.Tensor]) -> int:  # type: ignore[no-untyped-def]
    """The whole-model baseline: full_tensor() of every parameter at once, then merge each LoRA module in float32."""
    from peft.tuners.lora import LoraLayer
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        full = {id(p): (p.full_tensor() if isinstance(p, DTensor) else p) for p in model.parameters()}
        held = sum(t.numel() * t.element_size() for t in full.values())
        merged_weights = set()
        for name, module in model.named_modules():
            if isinstance(module, LoraLayer) and hasattr(module, "lora_A"):
                w = full[id(module.base_layer.weight)].float()
                for a in module.active_adapters:
                    w += (
                        full[id(module.lora_B[a].weight)].float() @ full[id(module.lora_A[a].weight)].float()
                    ) * module.scaling[a]
                hf = name.removeprefix("base_model.model.") + ".weight"
                dest[hf].copy_(w)
                merged_weights.add(id(module.base_layer.weight))
                del w
        for name, p in model.named_parameters():
            if "lora_" in name or id(p) in merged_weights:
                continue
            dest[name.removeprefix("base_model.model.").replace(".base_layer", "")].copy_(full[id(p)])
        del full
    return held


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("variant")
    p.add_argument("--budget", type=int, default=0)
    p.add_argument("--group-by", default="budget")
    p.add_argument("--syncs", type=int, default=10)
    p.add_argument("--no-release", action="store_true", help="release_memory=False")
    p.add_argument("--fallback", action="store_true", help="Fsdp2Gatherer(direct=False): full_tensor()")
    p.add_argument("--coalesce-bytes", type=int, default=None, help="Fsdp2Gatherer(coalesce_bytes=...)")
    p.add_argument("--adapter", action="store_true", help="AdapterStream: only the LoRA factors")
    p.add_argument("--keep-bytes", type=int, default=None, help="Fsdp2Gatherer(keep_bytes=...)")
    p.add_argument("--ab", default="", help="adapter A/B: labels of adapter_floors.AB, run interleaved (no RSS)")
    add_model_args(p)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    dist.init_process_group("gloo")
    model = build(args)
    from lora_stream import AdapterStream, Fsdp2Gatherer, ParamStream

    budget = {"budget_bytes": args.budget} if args.budget else {}
    if args.ab:
        from adapter_floors import ab_run, fsdp2_pieces

        def make(**kw: object) -> ParamStream:
            return AdapterStream(model, group_by=args.group_by, gatherer=Fsdp2Gatherer(model, **kw), **budget)

        ab_run(args, make, fsdp2_pieces)
        return
    coalesce = {} if args.coalesce_bytes is None else {"coalesce_bytes": args.coalesce_bytes}
    if args.keep_bytes is not None:
        coalesce["keep_bytes"] = args.keep_bytes
    elif args.adapter:  # what AdapterStream(model) does with the gatherer it builds
        from lora_stream.gatherers.base import KEEP_BYTES

        coalesce["keep_bytes"] = KEEP_BYTES
    gatherer = Fsdp2Gatherer(model, direct=not args.fallback, **coalesce)
    if args.adapter:
        stream: ParamStream = AdapterStream(model, gatherer=gatherer, group_by=args.group_by, **budget)
    else:
        stream = ParamStream(
            model, gatherer=gatherer, group_by=args.group_by, release_memory=not args.no_release, **budget
        )
    dest = {m.name: torch.zeros(m.shape, dtype=m.dtype) for m in stream.metadata()}
    shards = [p.to_local() for p in model.parameters()]
    before = [s.clone() for s in shards]
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    dist.barrier()
    rss0 = rss()
    sampler = RssSampler()
    sampler.start()
    times, gathered = [], 0
    trims: list[int] = []  # malloc_trim calls of each sync (release_memory's growth bound)
    for _ in range(args.syncs):
        dist.barrier()
        t0 = time.perf_counter()
        if args.variant == "whole_full_tensor":
            gathered = max(gathered, whole_full_tensor_sync(model, dest))
        else:
            for name, tensor in stream:
                dest[name].copy_(tensor)
            gathered = max(gathered, stream.last_stats.peak_gathered_bytes)
            trims.append(stream.last_stats.heap_trims)
        times.append(time.perf_counter() - t0)
    peak = sampler.stop()
    adapter: dict[str, object] = {}
    if args.adapter:
        # The floors of the same bytes in the same process group, and what one sync issues.
        from adapter_floors import all_gather_floors, collectives_of, fsdp2_pieces, stage_breakdown

        def sync() -> None:
            for name, tensor in stream:
                dest[name].copy_(tensor)

        adapter = all_gather_floors(fsdp2_pieces([g.params for g in stream._groups]), args.syncs)
        adapter["collectives_per_sync"] = collectives_of(sync)
        adapter["stages_s"] = stage_breakdown(sync, args.syncs)
    flags = (
        ("no-release", args.no_release),
        ("fallback", args.fallback),
        (f"coalesce_bytes={args.coalesce_bytes}", args.coalesce_bytes is not None),
    )
    label = "adapter" if args.adapter else f"lora_stream {args.group_by}"
    row = {
        "variant": args.variant if args.variant == "whole_full_tensor" else label,
        "heap_trims_per_sync": trims,
        "options": [o for o, on in flags if on],
        "adapter": adapter,
        "gather_paths": stream.last_stats.gather_paths,
        "groups": len(stream.groups()),
        "budget_bytes": args.budget or None,
        "rank": dist.get_rank(),
        "median_sync_s": statistics.median(times),
        "sync_times_s": times,
        "peak_gathered_bytes": gathered,
        "largest_group_bytes": max(stream.group_gathered_bytes) if args.variant != "whole_full_tensor" else gathered,
        "model_bytes": sum(t.numel() * t.element_size() for t in dest.values()),
        "bytes_moved": sum(t.numel() * t.element_size() for t in dest.values()),
        "rss_growth_bytes": peak - rss0,
        "drift_changed_elements": sum(int((s != b).sum()) for s, b in zip(shards, before)),
    }
    Path(f"{args.out}.rank{dist.get_rank()}.json").write_text(json.dumps(row))
    dist.barrier()


if __name__ == "__main__":
    main()
