"""Rank worker of bench_checkpoint.py: save the ZeRO-3 benchmark model, merged, one way or the other.

Variants:
  gather_merge_save  what a user does today: GatheredParameters(every parameter), merge_adapter() on rank 0, copy the
                     merged state dict out, unmerge_adapter(), then safetensors' save_file on rank 0
  lora_stream        lora_stream.save_merged(engine, dir): one group at a time, rank 0 writes header-first shards
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import deepspeed
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RssSampler, add_model_args, rss
from zero3_worker import build


def gather_merge_save(engine, out: Path) -> None:  # type: ignore[no-untyped-def]
    from safetensors.torch import save_file

    model = engine.module
    state = {}
    with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None):
        if dist.get_rank() == 0:
            model.merge_adapter()
            for name, param in model.named_parameters():
                if "lora_" in name or "original_module" in name:
                    continue
                state[name.removeprefix("base_model.model.").replace(".base_layer", "")] = param.detach().clone()
            model.unmerge_adapter()
    if dist.get_rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
        save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    del state
    dist.barrier()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("variant")
    p.add_argument("--syncs", type=int, default=3)
    add_model_args(p)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    engine = build(args)

    from lora_stream import ParamStream, save_merged

    root = Path(tempfile.mkdtemp(prefix="lora_stream_bench_ckpt_")) if dist.get_rank() == 0 else Path("unused")
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    dist.barrier()
    rss0 = rss()
    sampler = RssSampler()
    sampler.start()
    times, peak_gathered, written = [], 0, 0
    for i in range(args.syncs):
        out = root / f"save-{i}"
        dist.barrier()
        t0 = time.perf_counter()
        if args.variant == "gather_merge_save":
            gather_merge_save(engine, out)
        else:
            stream = ParamStream(engine)
            record = save_merged(stream, out, progress=False)
            peak_gathered = record.peak_gathered_bytes
        times.append(time.perf_counter() - t0)
        if dist.get_rank() == 0:
            written = sum(f.stat().st_size for f in out.glob("*.safetensors"))
            shutil.rmtree(out)
    peak = sampler.stop()
    row = {
        "variant": args.variant,
        "rank": dist.get_rank(),
        "median_save_s": statistics.median(times),
        "save_times_s": times,
        "rss_growth_bytes": peak - rss0,
        "peak_gathered_bytes": peak_gathered,
        "written_bytes": written,
        "saves": args.syncs,
    }
    if dist.get_rank() == 0:
        shutil.rmtree(root, ignore_errors=True)
    with open(f"{args.out}.rank{dist.get_rank()}.json", "w") as f:
        json.dump(row, f)
    dist.barrier()


if __name__ == "__main__":
    main()
