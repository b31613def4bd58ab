"""One rank of one benchmark variant (started by bench_zero3.py; not meant to be run by hand).

Builds the benchmark model under deepspeed.zero.Init (no rank ever holds it whole before the sync), wraps it with a
non-zero LoRA adapter, runs `syncs` syncs of the variant into a preallocated destination (what a colocated engine
holds anyway), samples the process RSS every 2 ms, and writes one JSON line.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RssSampler, add_model_args, llama_config, rss

deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def build(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    ds_config = {
        "train_micro_batch_size_per_gpu": 1,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "zero_allow_untested_optimizer": True,
    }
    cfg = llama_config(args)
    torch.manual_seed(0)
    dschf = HfDeepSpeedConfig(ds_config)  # noqa: F841 - keeps zero.Init on for from_config
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    assert all(p.numel() == 0 for p in model.parameters()), "expected a model partitioned while built"
    pm = get_peft_model(
        model, LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules="all-linear", init_lora_weights=False)
    )
    opt = torch.optim.AdamW([p for p in pm.parameters() if p.requires_grad], lr=1e-4)
    engine, *_ = deepspeed.initialize(model=pm, optimizer=opt, config=ds_config)
    return engine


def trl_whole_gather_sync(engine, dest: dict[str, torch.Tensor]) -> int:  # type: ignore[no-untyped-def]
    """What TRL's `_iter_named_params` does for PEFT + ZeRO-3: gather all, merge in place, iterate, unmerge."""
    from lora_stream import ZeroThreeGatherer

    model = engine.module
    probe = ZeroThreeGatherer(model)
    with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None):
        held = probe.held_bytes()
        model.merge_adapter()
        for name, param in model.named_parameters():
            if "lora_" in name or "original_module" in name:
                continue
            name = name.removeprefix("base_model.model.").replace(".base_layer", "")
            dest[name].copy_(param.data)
        model.unmerge_adapter()
    return held


def lora_stream_sync(stream, dest: dict[str, torch.Tensor]) -> int:  # type: ignore[no-untyped-def]
    for name, tensor in stream:
        dest[name].copy_(tensor)
    return int(stream.last_stats.peak_gathered_bytes)


def floor_pieces(engine, dest: dict[str, torch.Tensor]):  # type: ignore[no-untyped-def]
    """The no-overlap floor's three parts as callables: the raw all-gather of every partition into one reused
    buffer (no merge, no copy out), the stream's merges alone on whole tensors already in memory (an unsharded
    copy of the model), and copying every output into the destination."""
    import copy

    from lora_stream import ParamStream, PlainGatherer

    params = list(engine.module.parameters())
    world = dist.get_world_size()
    largest = max(p.ds_tensor.ds_numel * world * p.element_size() for p in params)
    buf = torch.empty(largest, dtype=torch.uint8)

    def all_gather() -> None:
        for p in params:
            n = p.ds_tensor.ds_numel * world * p.element_size()
            out = buf.narrow(0, 0, n).view(p.dtype)
            dist.all_gather_into_tensor(out, p.ds_tensor.view(-1).narrow(0, 0, p.ds_tensor.ds_numel))

    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        whole = copy.deepcopy(engine.module)  # unsharded: the merges run on tensors already in memory
    for p in whole.parameters():
        p.requires_grad_(False)
    merged_only = ParamStream(whole, gatherer=PlainGatherer(), release_memory=False)
    outputs = {n: t.clone() for n, t in merged_only}

    def merge() -> None:
        for _name, _tensor in merged_only:
            pass

    def copy_out() -> None:
        for name, tensor in outputs.items():
            dest[name].copy_(tensor)

    return (("all_gather_s", all_gather), ("merge_s", merge), ("copy_s", copy_out))


def with_totals(out: dict[str, float]) -> dict[str, float]:
    """The floor parts' medians, with the no-overlap and the overlapped floor they make."""
    out["no_overlap_s"] = out["all_gather_s"] + out["merge_s"] + out["copy_s"]
    out["overlap_s"] = max(out["all_gather_s"], out["merge_s"] + out["copy_s"])
    return out


def measure_floors(engine, dest: dict[str, torch.Tensor], syncs: int) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """Each floor part's median of ``syncs`` runs."""
    from adapter_floors import median_seconds

    return with_totals({label: median_seconds(fn, syncs) for label, fn in floor_pieces(engine, dest)})


def interleaved_floors(engine, stream, dest: dict[str, torch.Tensor], syncs: int) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """The floor parts and the stream's sync, one of each per round, in the same processes: on a noisy machine
    separate runs drift apart by more than the gap being measured. ``sync_s`` is the sync's median here."""
    from adapter_floors import interleaved

    runs = {"sync_s": lambda: lora_stream_sync(stream, dest), **dict(floor_pieces(engine, dest))}
    return with_totals({label: r["median_s"] for label, r in interleaved(runs, syncs).items()})


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("variant")
    p.add_argument("--budget", type=int, default=0)
    p.add_argument("--group-by", default="budget")
    p.add_argument("--syncs", type=int, default=20)
    p.add_argument("--no-release", action="store_true", help="release_memory=False")
    p.add_argument("--reuse-outputs", action="store_true", help="reuse_outputs=True")
    p.add_argument("--adapter", action="store_true", help="AdapterStream: only the LoRA factors")
    p.add_argument("--fallback", action="store_true", help="ZeroThreeGatherer(direct=False): GatheredParameters")
    p.add_argument("--coalesce-bytes", type=int, default=None, help="ZeroThreeGatherer(coalesce_bytes=...)")
    p.add_argument("--prefetch", action="store_true", help="prefetch=True")
    p.add_argument("--keep-bytes", type=int, default=None, help="ZeroThreeGatherer(keep_bytes=...)")
    p.add_argument("--ab", default="", help="adapter A/B: labels of adapter_floors.AB, run interleaved (no RSS)")
    p.add_argument("--trace", action="store_true", help="keep the RSS samples of the last sync (for the plot)")
    p.add_argument("--interleaved-floor", action="store_true", help="after the syncs, time floor and sync in turns")
    add_model_args(p)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    engine = build(args)

    from lora_stream import AdapterStream, ParamStream, ZeroThreeGatherer

    budget = {"budget_bytes": args.budget} if args.budget else {}
    if args.ab:
        from adapter_floors import ab_run, zero3_pieces

        def make(**kw: object) -> ParamStream:
            return AdapterStream(engine, group_by=args.group_by, gatherer=ZeroThreeGatherer(engine, **kw), **budget)

        ab_run(args, make, zero3_pieces)
        return
    coalesce = {} if args.coalesce_bytes is None else {"coalesce_bytes": args.coalesce_bytes}
    if args.keep_bytes is not None:
        coalesce["keep_bytes"] = args.keep_bytes
    elif args.adapter:  # what AdapterStream(engine) does with the gatherer it builds
        from lora_stream.gatherers.base import KEEP_BYTES

        coalesce["keep_bytes"] = KEEP_BYTES
    gatherer = ZeroThreeGatherer(engine, direct=not args.fallback, **coalesce)
    if args.adapter:
        stream: ParamStream = AdapterStream(engine, group_by=args.group_by, gatherer=gatherer, **budget)
    else:
        stream = ParamStream(
            engine,
            gatherer=gatherer,
            group_by=args.group_by,
            release_memory=not args.no_release,
            reuse_outputs=args.reuse_outputs,
            prefetch=args.prefetch,
            **budget,
        )
    # zeros, not empty: the destination's pages must be resident before the baseline RSS is read, or the first
    # sync's page faults on it would be counted as the sync's growth.
    dest = {m.name: torch.zeros(m.shape, dtype=m.dtype) for m in stream.metadata()}
    model_bytes = sum(t.numel() * t.element_size() for t in dest.values())
    partitions = [p for p in engine.module.parameters()]
    before = [p.ds_tensor.detach().clone() for p in partitions]
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    dist.barrier()
    rss0 = rss()
    sampler = RssSampler(keep=args.trace)
    sampler.start()
    times, gathered = [], 0
    trims: list[int] = []  # malloc_trim calls of each sync (release_memory's growth bound)
    floors: dict[str, float] = {}
    if args.variant == "floor":
        floors = measure_floors(engine, dest, args.syncs)
        times = [floors["no_overlap_s"]]
    for _ in range(args.syncs if args.variant != "floor" else 0):
        dist.barrier()
        t0 = time.perf_counter()
        if args.variant == "whole_gather":
            gathered = max(gathered, trl_whole_gather_sync(engine, dest))
        else:
            gathered = max(gathered, lora_stream_sync(stream, dest))
            trims.append(stream.last_stats.heap_trims)
        times.append(time.perf_counter() - t0)
    trace: list[tuple[float, int]] = []
    if args.trace:
        # 0.1 s after the last sync, so the plot shows whether memory came back; the sampler keeps running meanwhile.
        time.sleep(0.1)
        trace = sampler.window(t0 - 0.05, t0 + times[-1] + 0.1, rss0)
    peak = sampler.stop()
    if args.interleaved_floor:
        floors = interleaved_floors(engine, stream, dest, args.syncs)
    adapter: dict[str, object] = {}
    if args.adapter:
        # The floors of the same bytes in the same process group, and what one sync issues (after the RSS peak).
        from adapter_floors import all_gather_floors, collectives_of, stage_breakdown, zero3_pieces

        adapter = all_gather_floors(zero3_pieces([g.params for g in stream._groups]), args.syncs)
        adapter["collectives_per_sync"] = collectives_of(lambda: lora_stream_sync(stream, dest))

        def sync() -> None:
            lora_stream_sync(stream, dest)

        adapter["stages_s"] = stage_breakdown(sync, args.syncs, consumer="lora_stream_sync")
    changed = sum(int((p.ds_tensor != b).sum()) for p, b in zip(partitions, before))
    max_drift = max(float((p.ds_tensor.float() - b.float()).abs().max()) for p, b in zip(partitions, before))
    flags = (
        ("no-release", args.no_release),
        ("reuse-outputs", args.reuse_outputs),
        ("prefetch", args.prefetch),
        ("fallback", args.fallback),
        (f"coalesce_bytes={args.coalesce_bytes}", args.coalesce_bytes is not None),
    )
    options = [o for o, on in flags if on]
    label = "adapter" if args.adapter else f"lora_stream {args.group_by}"
    row = {
        "variant": args.variant if args.variant in ("whole_gather", "floor") else label,
        "floors": floors,
        "adapter": adapter,
        "gather_paths": stream.last_stats.gather_paths,
        "heap_trims_per_sync": trims,
        "options": options,
        "budget_bytes": args.budget or None,
        "rank": dist.get_rank(),
        "median_sync_s": statistics.median(times),
        "sync_times_s": times,
        "peak_gathered_bytes": gathered,
        "largest_group_bytes": max(stream.group_gathered_bytes) if args.variant != "whole_gather" else gathered,
        "groups": len(stream.groups()),
        "model_bytes": model_bytes,
        "bytes_moved": model_bytes,
        "rss_before_bytes": rss0,
        "rss_growth_bytes": peak - rss0,
        "peak_temp_bytes": int(stream.last_stats.peak_temp_bytes) if args.variant != "whole_gather" else None,
        "drift_changed_elements": changed,
        "drift_max_abs": max_drift,
        "syncs": args.syncs,
        "layers": args.layers,
        "rss_trace": trace,
        "trace_sync_s": times[-1] if args.trace else None,
    }
    with open(f"{args.out}.rank{dist.get_rank()}.json", "w") as f:
        json.dump(row, f)
    dist.barrier()


if __name__ == "__main__":
    main()
