"""Calibration probes for the cost model (``cost_model.py``): the raw rates of this machine, measured the way the
benchmarks run (2 ranks over gloo on 127.0.0.1, one thread each, both ranks busy at once).

    python benchmarks/calibrate.py              # ~1 minute on 2 cores; writes benchmarks/results/calibration.json
    python benchmarks/calibrate.py --quick      # fewer sizes and repeats (a smoke test)

Every probe is a median of repeats, on both ranks at the same time:

* ``all_gather_into_tensor`` at output sizes from 16 KiB to 62.5 MiB, fitted as ``t = latency + S (W-1)/W / busbw``
  (nccl-tests' bus-bandwidth convention, S the gathered bytes);
* the status exchange (the stream's one small ``all_reduce`` per group);
* a broadcast rank 0 -> rank 1 with a copy on the receiver (the server path's data plane), fitted as
  ``t = latency + S / bw``;
* lora_stream's own LoRA merges on an unsharded bf16 model of the benchmarks' shape (LoRA r=16 on all linear layers),
  at two merge block sizes (to separate the per-block cost from the byte rate), bf16 and float32 outputs; the
  per-merge overhead on a tiny model (many small merges);
* a warm memory copy, a copy into freshly mapped memory (the page faults a fresh output tensor pays), and
  ``malloc_trim(0)``.

Nothing here is a benchmark of the library's end-to-end sync: ``cost_model.py`` predicts those from these rates and
compares the prediction with the benchmarks' own measurements.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import MiB, run_ranks, write_json  # noqa: E402

KiB = 1024


def timed(fn: Callable[[], object], repeats: int, barrier: Callable[[], object] | None = None) -> float:
    """Median wall time of ``fn`` over ``repeats`` runs (one untimed warm-up first)."""
    fn()
    runs = []
    for _ in range(repeats):
        if barrier is not None:
            barrier()
        t0 = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - t0)
    return statistics.median(runs)


def fit_affine(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """``y = a + b x`` by least squares on relative error (weights 1/y), so that small sizes fix the latency ``a``
    and large ones the slope ``b``. Returns ``(a, b)``, ``a`` clamped at 0."""
    w = [1.0 / (y * y) for y in ys]
    sw = sum(w)
    sx = sum(wi * x for wi, x in zip(w, xs))
    sy = sum(wi * y for wi, y in zip(w, ys))
    sxx = sum(wi * x * x for wi, x in zip(w, xs))
    sxy = sum(wi * x * y for wi, x, y in zip(w, xs, ys))
    b = (sw * sxy - sx * sy) / (sw * sxx - sx * sx)
    a = (sy - b * sx) / sw
    return max(a, 0.0), b


def merge_probe(quick: bool) -> dict[str, float]:
    """lora_stream's merges alone (PlainGatherer: nothing gathered) on this rank, the other rank doing the same."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from lora_stream import ParamStream, PlainGatherer

    def model(hidden: int, inter: int, layers: int, dtype: torch.dtype) -> torch.nn.Module:
        cfg = LlamaConfig(
            vocab_size=256,
            hidden_size=hidden,
            intermediate_size=inter,
            num_hidden_layers=layers,
            num_attention_heads=max(1, hidden // 64),
            num_key_value_heads=max(1, hidden // 64),
            tie_word_embeddings=False,
        )
        torch.manual_seed(0)
        m = get_peft_model(
            LlamaForCausalLM(cfg).to(dtype),
            LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", init_lora_weights=False),
        )
        for p in m.parameters():
            p.requires_grad_(False)
        return m

    def merged_bytes(m: torch.nn.Module, out_size: int) -> tuple[int, int]:
        """(bytes of the merged outputs, number of merged tensors): every base weight of a LoRA layer."""
        from peft.tuners.lora import LoraLayer

        n = numel = 0
        for mod in m.modules():
            if isinstance(mod, LoraLayer) and hasattr(mod, "base_layer"):
                numel += mod.base_layer.weight.numel()
                n += 1
        return numel * out_size, n

    def pass_time(m: torch.nn.Module, block: int, repeats: int) -> float:
        stream = ParamStream(m, gatherer=PlainGatherer(), release_memory=False, merge_block_bytes=block)

        def run() -> None:
            for _name, _t in stream:
                pass

        return timed(run, repeats)

    reps = 2 if quick else 5
    layers = 1 if quick else 2
    out: dict[str, float] = {}
    big = model(1024, 2816, layers, torch.bfloat16)
    nbytes, n_big = merged_bytes(big, 2)
    rows_big = 8 * MiB // (4 * 1024)  # rows per default block for a [*, 1024] weight
    t_default = pass_time(big, 8 * MiB, reps)
    t_small = pass_time(big, 256 * KiB, reps)
    # Blocks per pass at each block size: every merged weight is cut into row blocks of block/(4*cols) rows.
    from peft.tuners.lora import LoraLayer

    def n_blocks(m: torch.nn.Module, block: int) -> int:
        total = 0
        for mod in m.modules():
            if isinstance(mod, LoraLayer) and hasattr(mod, "base_layer"):
                rows, cols = mod.base_layer.weight.shape
                step = max(1, block // (4 * cols))
                total += -(-rows // step)
        return total

    nb_default, nb_small = n_blocks(big, 8 * MiB), n_blocks(big, 256 * KiB)
    per_block = max(0.0, (t_small - t_default) / max(1, nb_small - nb_default))
    out["merge_bf16_s"] = t_default
    out["merge_bf16_bytes"] = float(nbytes)
    out["merge_blocks_default"] = float(nb_default)
    out["merge_blocks_small"] = float(nb_small)
    out["merge_small_block_s"] = t_small
    out["merge_per_block_s"] = per_block
    out["merge_rows_per_block"] = float(rows_big)
    out["merges"] = float(n_big)
    del big
    big32 = model(1024, 2816, layers, torch.float32)
    nbytes32, _ = merged_bytes(big32, 4)
    out["merge_fp32_s"] = pass_time(big32, 8 * MiB, reps)
    out["merge_fp32_bytes"] = float(nbytes32)
    del big32
    tiny = model(64, 128, 32, torch.bfloat16)
    _, tn = merged_bytes(tiny, 2)
    t_tiny = pass_time(tiny, 8 * MiB, reps)
    out["per_merge_s"] = t_tiny / tn
    out["tiny_merges"] = float(tn)
    return out


def memory_probe(quick: bool) -> dict[str, float]:
    """Warm copy, copy into fresh pages (first touch), and malloc_trim, on this rank."""
    import mmap

    import torch

    n = (16 if quick else 64) * MiB
    src = torch.ones(n, dtype=torch.uint8)
    warm = torch.zeros(n, dtype=torch.uint8)
    reps = 3 if quick else 7
    t_warm = timed(lambda: warm.copy_(src), reps)

    def fresh() -> None:
        region = mmap.mmap(-1, n)  # anonymous, never touched: every page faults on the first write
        dst = torch.frombuffer(region, dtype=torch.uint8)
        dst.copy_(src)
        del dst
        region.close()

    t_fresh = timed(fresh, reps)
    libc = ctypes.CDLL("libc.so.6")
    junk = [torch.empty(MiB // 2, dtype=torch.uint8).fill_(1) for _ in range(128)]
    del junk
    t0 = time.perf_counter()
    libc.malloc_trim(0)
    t_trim_first = time.perf_counter() - t0
    t_trim = timed(lambda: libc.malloc_trim(0), reps)
    return {
        "copy_bytes": float(n),
        "copy_warm_s": t_warm,
        "copy_fresh_s": t_fresh,
        "malloc_trim_s": max(t_trim, t_trim_first),
    }


def collective_probe(quick: bool) -> dict[str, object]:
    """all-gather, all-reduce (status exchange) and broadcast on the default gloo group of 2 ranks."""
    import torch
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    reps = 3 if quick else 7
    sizes = [16 * KiB, 256 * KiB, 2 * MiB, 8 * MiB, 32 * MiB] + ([] if quick else [int(62.5 * MiB)])
    ag = []
    for s in sizes:
        out = torch.empty(s // 2, dtype=torch.bfloat16)
        part = torch.ones(s // 2 // world, dtype=torch.bfloat16)
        t = timed(lambda out=out, part=part: dist.all_gather_into_tensor(out, part), reps, dist.barrier)
        ag.append((s, t))
    # The status exchange: lockstep's buffer is (2 + reason words) int64 per rank; a few hundred bytes.
    small = torch.zeros(2 * world + world * 32, dtype=torch.int64)
    t_ar = timed(lambda: dist.all_reduce(small), 10 * reps, dist.barrier)
    bc = []
    for s in [256 * KiB, 1 * MiB, 8 * MiB, 32 * MiB] + ([] if quick else [int(62.5 * MiB)]):
        buf = torch.ones(s, dtype=torch.uint8)
        dest = torch.zeros(s, dtype=torch.uint8)

        def send(buf: torch.Tensor = buf, dest: torch.Tensor = dest) -> None:
            dist.broadcast(buf, src=0)
            if rank == 1:
                dest.copy_(buf)

        bc.append((s, timed(send, reps, dist.barrier)))
    return {"all_gather": ag, "all_reduce_s": t_ar, "broadcast": bc}


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    res: dict[str, object] = {"rank": dist.get_rank(), "world": dist.get_world_size()}
    res["collectives"] = collective_probe(args.quick)
    dist.barrier()
    res["merge"] = merge_probe(args.quick)
    dist.barrier()
    res["memory"] = memory_probe(args.quick)
    dist.barrier()
    Path(f"{args.worker_out}.rank{dist.get_rank()}.json").write_text(json.dumps(res))
    dist.barrier()
    os._exit(0)  # torch 2.13's gloo groups sometimes abort while being destroyed at exit (docs/development.md)


def summarize(ranks: list[dict]) -> dict[str, object]:
    """The cost model's calibration from both ranks' probes: the slower rank's figure for every rate."""
    world = int(ranks[0]["world"])
    out: dict[str, object] = {"world": world, "machine": os.uname().machine, "cores": os.cpu_count()}
    ag = [
        max(r["collectives"]["all_gather"][i][1] for r in ranks)
        for i in range(len(ranks[0]["collectives"]["all_gather"]))
    ]
    sizes = [s for s, _ in ranks[0]["collectives"]["all_gather"]]
    lat, slope = fit_affine([s * (world - 1) / world for s in sizes], ag)
    out["all_gather_latency_s"] = lat
    out["all_gather_busbw_Bps"] = 1.0 / slope
    out["all_gather_points"] = [[s, t] for s, t in zip(sizes, ag)]
    out["all_reduce_latency_s"] = max(r["collectives"]["all_reduce_s"] for r in ranks)
    bc = [
        max(r["collectives"]["broadcast"][i][1] for r in ranks)
        for i in range(len(ranks[0]["collectives"]["broadcast"]))
    ]
    bsizes = [s for s, _ in ranks[0]["collectives"]["broadcast"]]
    blat, bslope = fit_affine([float(s) for s in bsizes], bc)
    out["broadcast_latency_s"] = blat
    out["broadcast_bw_Bps"] = 1.0 / bslope
    out["broadcast_points"] = [[s, t] for s, t in zip(bsizes, bc)]
    m = {k: max(float(r["merge"][k]) for r in ranks) for k in ranks[0]["merge"]}
    per_block, per_merge = m["merge_per_block_s"], m["per_merge_s"]
    # A pass's merge time = merges x per-merge cost (one block included) + the further blocks + bytes / rate.
    fixed = m["merges"] * per_merge + (m["merge_blocks_default"] - m["merges"]) * per_block
    out["merge_per_block_s"] = per_block
    out["per_merge_s"] = per_merge
    out["merge_bf16_Bps"] = m["merge_bf16_bytes"] / max(1e-9, m["merge_bf16_s"] - fixed)
    out["merge_fp32_Bps"] = m["merge_fp32_bytes"] / max(1e-9, m["merge_fp32_s"] - fixed)
    out["merge_raw"] = m
    mem = {k: max(float(r["memory"][k]) for r in ranks) for k in ranks[0]["memory"]}
    out["copy_Bps"] = mem["copy_bytes"] / mem["copy_warm_s"]
    out["fault_s_per_byte"] = max(0.0, mem["copy_fresh_s"] - mem["copy_warm_s"]) / mem["copy_bytes"]
    out["malloc_trim_s"] = mem["malloc_trim_s"]
    out["memory_raw"] = mem
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer sizes and repeats")
    ap.add_argument("--out", default=str(HERE / "results" / "calibration.json"))
    ap.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker_out:
        worker(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        base = os.path.join(tmp, "probe")
        cmd = [sys.executable, __file__, "--worker-out", base] + (["--quick"] if args.quick else [])
        ranks = run_ranks(cmd, base, timeout=900, failure="a calibration rank failed", capture=False)
    cal = summarize(ranks)
    cal["quick"] = args.quick
    cal["measured_at"] = time.strftime("%Y-%m-%d %H:%M:%S")
    write_json(args.out, cal)
    print(
        f"all-gather (2 ranks, gloo): latency {cal['all_gather_latency_s'] * 1e6:.0f} us, "
        f"busbw {cal['all_gather_busbw_Bps'] / 1e9:.3f} GB/s"
    )
    print(f"status all-reduce: {cal['all_reduce_latency_s'] * 1e6:.0f} us")
    print(
        f"broadcast + copy: latency {cal['broadcast_latency_s'] * 1e6:.0f} us, {cal['broadcast_bw_Bps'] / 1e9:.3f} GB/s"
    )
    print(
        f"merge: bf16 {cal['merge_bf16_Bps'] / 1e9:.3f} GB/s, fp32 {cal['merge_fp32_Bps'] / 1e9:.3f} GB/s "
        "(output bytes), "
        f"{cal['merge_per_block_s'] * 1e6:.0f} us per block, {cal['per_merge_s'] * 1e6:.0f} us per merge"
    )
    print(
        f"memory: warm copy {cal['copy_Bps'] / 1e9:.2f} GB/s, "
        f"first touch {cal['fault_s_per_byte'] * MiB * 1e3:.3f} ms/MiB, "
        f"malloc_trim {cal['malloc_trim_s'] * 1e3:.1f} ms"
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
