"""One-GPU check of the figures the cost model (benchmarks/cost_model.py) assumes for GPUs.

    python benchmarks/gpu_check.py                 # on one CUDA GPU: ~1-2 minutes
    python benchmarks/gpu_check.py --tiny          # small sizes (a smoke test; on CPU without CUDA)

Needs only torch, transformers, peft, accelerate, safetensors and lora_stream (no DeepSpeed, no vLLM). Without CUDA it
runs the same steps on the CPU and labels every figure "no CUDA: CPU figures". Measures:

1. **copy**: the device's memcpy bandwidth (one large device-to-device copy; bytes of the destination per second).
2. **merge**: lora_stream's merge throughput in bf16 and float32: a random Llama (transformers) with a peft LoRA
   (r=16 on all linear layers, ``lora_B`` perturbed so the merge is not trivial), streamed by ``ParamStream`` with the
   plain gatherer (nothing to gather), at the default 8 MiB merge block and at 64 MiB. Merged output bytes per
   second, and against the memcpy bandwidth. The cost model assumes ~8% of HBM bandwidth at 8 MiB blocks, limited by
   ~40 us of CPU dispatch per block.
3. **peak memory during a sync**: ``torch.cuda.max_memory_allocated`` (reset before) above what was allocated before
   the pass, while the stream is copied into a preallocated destination, against the largest group (and the largest
   output tensor). On CPU the process's resident-set peak (``measure_rss=True``) stands in.
4. **FSDP2 direct path at world size 1**: ``torch.distributed`` with a single process (nccl on GPU, gloo on CPU),
   ``fully_shard`` per decoder layer and on the root; ``ParamStream`` picks ``Fsdp2Gatherer``; the pass must take
   the direct path (``last_stats.gather_paths``) and yield exactly what the unsharded stream yields. Time and peak
   memory as above.

5. **engine-side merge** (``VLLMServerSink(merge="engine")``): the same model's recipes
   (``lora_stream.engine_merge``) computed by ``compute_step`` from the inputs on the device, as a server worker
   does, in bf16: merged output bytes per second, and whether every output equals the trainer-side stream's bit
   for bit on this GPU.

Prints a table and writes benchmarks/results/gpu_check.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
MiB = 2**20


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median seconds of ``fn`` (one warm-up), synchronizing the device around each run."""
    fn()
    sync(device)
    runs = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        runs.append(time.perf_counter() - t0)
    return statistics.median(runs)


def build(args: argparse.Namespace, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """A random Llama with a non-zero LoRA adapter (r=16, all linear layers), frozen, on ``device``."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=max(1, args.hidden // 128),
        num_key_value_heads=max(1, args.hidden // 512),
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = get_peft_model(
        LlamaForCausalLM(cfg).to(dtype), LoraConfig(r=16, lora_alpha=32, target_modules="all-linear")
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.02)  # peft initializes lora_B to zero: perturb it so the merge changes the weight
    model.to(device)
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def merged_bytes(model: torch.nn.Module, out_size: int) -> int:
    from peft.tuners.lora import LoraLayer

    return sum(
        m.base_layer.weight.numel() * out_size
        for m in model.modules()
        if isinstance(m, LoraLayer) and hasattr(m, "base_layer")
    )


def copy_check(args: argparse.Namespace, device: torch.device) -> dict[str, float]:
    n = (64 if args.tiny else 2048) * MiB
    src = torch.ones(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    t = timed(lambda: dst.copy_(src), device, args.repeats)
    return {"copy_bytes": n, "copy_s": t, "copy_GBps": n / t / 1e9}


def merge_check(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> dict[str, float]:
    from lora_stream import ParamStream, PlainGatherer

    model = build(args, dtype, device)
    out: dict[str, float] = {"merged_bytes": merged_bytes(model, torch.finfo(dtype).bits // 8)}
    for block_mib in (8, 64):
        stream = ParamStream(model, gatherer=PlainGatherer(), release_memory=False, merge_block_bytes=block_mib * MiB)

        def run(stream: ParamStream = stream) -> None:
            for _name, _t in stream:
                pass

        t = timed(run, device, args.repeats)
        out[f"merge_s_block{block_mib}"] = t
        out[f"merge_GBps_block{block_mib}"] = out["merged_bytes"] / t / 1e9
    del model
    return out


def engine_merge_check(args: argparse.Namespace, device: torch.device) -> dict[str, float | bool]:
    from lora_stream import ParamStream, PlainGatherer
    from lora_stream.engine_merge import EngineMergePlan, compute_step

    model = build(args, torch.bfloat16, device)
    stream = ParamStream(model, gatherer=PlainGatherer(), release_memory=False)
    plan = EngineMergePlan(stream)
    lookup = {k: spec.ref.detach() for k, spec in plan.inputs.items() if spec.ref is not None}
    lookup.update({k: spec.buffer.module._buffers[spec.buffer.attr] for k, spec in plan.inputs.items() if spec.buffer})
    merged = [r for i, r in enumerate(plan.recipes) if plan.reads_trainable(i)]

    def run() -> None:
        for recipe in merged:
            compute_step(recipe, lookup)

    t = timed(run, device, args.repeats)
    expected = {n: x for n, x in stream}
    exact = all(torch.equal(x, expected[n]) for recipe in merged for n, x in compute_step(recipe, lookup))
    nbytes = sum(math.prod(o[2]) * 2 for recipe in merged for o in recipe["outputs"])
    del model, expected
    return {"merged_bytes": nbytes, "engine_merge_s": t, "engine_merge_GBps": nbytes / t / 1e9, "bit_exact": exact}


def memory_check(args: argparse.Namespace, device: torch.device, model: torch.nn.Module, label: str) -> dict:
    """One pass of ``ParamStream(model)`` (its automatic gatherer) copied into a preallocated destination: time,
    peak memory above the start, the largest group and output, and the gather paths."""
    from lora_stream import ParamStream

    stream = ParamStream(model, measure_rss=device.type != "cuda")
    dest = {m.name: torch.zeros(m.shape, dtype=m.dtype, device=device) for m in stream.metadata()}

    def run() -> None:
        for name, t in stream:
            dest[name].copy_(t)

    seconds = timed(run, device, args.repeats)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        run()
        sync(device)
        peak = torch.cuda.max_memory_allocated(device) - before
        how = "torch.cuda.max_memory_allocated"
    else:
        run()
        st = stream.last_stats
        peak = (st.rss_peak_bytes or 0) - (st.rss_start_bytes or 0)
        how = "process RSS peak (measure_rss)"
    largest_group = max(stream.group_gathered_bytes)
    largest_out = max(math.prod(m.shape) * m.dtype.itemsize for m in stream.metadata())
    return {
        "label": label,
        "seconds": seconds,
        "bytes": sum(t.numel() * t.element_size() for t in dest.values()),
        "peak_bytes": peak,
        "peak_how": how,
        "largest_group_bytes": largest_group,
        "largest_output_bytes": largest_out,
        "peak_x_largest_group": peak / max(1, largest_group),
        "gather_paths": dict(stream.last_stats.gather_paths),
        "gatherer": type(stream.gatherer).__name__,
        "outputs": {k: v for k, v in dest.items()},
    }


def fsdp2_check(args: argparse.Namespace, device: torch.device) -> tuple[dict, dict]:
    """The plain stream and the FSDP2 stream (world size 1) of the same model; their outputs must be equal."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    plain = memory_check(args, device, build(args, torch.bfloat16, device), "plain (one process, no gather)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, rank=0, world_size=1, **({"device_id": device} if device.type == "cuda" else {}))
    try:
        model = build(args, torch.bfloat16, device)
        mesh = init_device_mesh(device.type, (1,))
        for layer in model.base_model.model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        fsdp = memory_check(args, device, model, f"FSDP2 direct path, world size 1 ({backend})")
    finally:
        dist.destroy_process_group()
    diff = max(
        float((fsdp["outputs"][k].float() - v.float()).abs().max()) if v.numel() else 0.0
        for k, v in plain["outputs"].items()
    )
    fsdp["max_abs_diff_vs_plain"] = diff
    fsdp["direct"] = fsdp["gather_paths"].get("direct", 0) > 0 and not fsdp["gather_paths"].get("fallback", 0)
    return plain, fsdp


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="small sizes: hidden 256, 2 layers, 64 MiB copies")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--hidden", type=int, default=None)
    ap.add_argument("--intermediate", type=int, default=None)
    ap.add_argument("--vocab", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=str(HERE / "results" / "gpu_check.json"))
    args = ap.parse_args()
    # Default: one Llama-3-8B-shaped layer stack (hidden 4096, intermediate 14336), 4 layers, 1.9 GB bf16.
    size = (
        dict(layers=2, hidden=256, intermediate=688, vocab=1024)
        if args.tiny
        else dict(layers=4, hidden=4096, intermediate=14336, vocab=32000)
    )
    for k, v in size.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    label = torch.cuda.get_device_name(device) if cuda else "no CUDA: CPU figures"
    print(f"device: {label}; model: {args.layers} layers, hidden {args.hidden}, intermediate {args.intermediate}")
    copy = copy_check(args, device)
    merges = {name: merge_check(args, device, dt) for name, dt in (("bf16", torch.bfloat16), ("fp32", torch.float32))}
    plain, fsdp = fsdp2_check(args, device)
    engine = engine_merge_check(args, device)
    print(f"\n{'check':<44} {'figure':>14}  note")
    print(f"{'memcpy (device to device)':<44} {copy['copy_GBps']:>9.1f} GB/s  {copy['copy_bytes'] / MiB:.0f} MiB")
    for name, m in merges.items():
        for block in (8, 64):
            gbps = m[f"merge_GBps_block{block}"]
            print(
                f"{f'merge {name}, {block} MiB blocks':<44} {gbps:>9.2f} GB/s  {gbps / copy['copy_GBps']:.3f}x memcpy, "
                f"{m['merged_bytes'] / MiB:.0f} MiB merged in {m[f'merge_s_block{block}']:.3f} s"
            )
    print(
        f"{'engine-side merge bf16 (compute_step)':<44} {engine['engine_merge_GBps']:>9.2f} GB/s  "
        f"{engine['merged_bytes'] / MiB:.0f} MiB merged in {engine['engine_merge_s']:.3f} s, "
        f"bit-exact with the trainer-side stream: {engine['bit_exact']}"
    )
    for r in (plain, fsdp):
        print(
            f"{r['label'][:44]:<44} {r['seconds']:>10.3f} s     peak {r['peak_bytes'] / MiB:.0f} MiB "
            f"({r['peak_how']}) = {r['peak_x_largest_group']:.2f}x the largest group "
            f"({r['largest_group_bytes'] / MiB:.0f} MiB; largest output {r['largest_output_bytes'] / MiB:.1f} MiB)"
        )
    print(
        f"FSDP2 gather paths {fsdp['gather_paths']} (direct: {fsdp['direct']}); max |FSDP2 - plain| "
        f"{fsdp['max_abs_diff_vs_plain']:.3g}"
    )
    for r in (plain, fsdp):
        r.pop("outputs")
    out = {
        "device": label,
        "cuda": cuda,
        "args": vars(args),
        "copy": copy,
        "merge": merges,
        "plain": plain,
        "fsdp2": fsdp,
        "engine_merge": engine,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"\nwrote {args.out}")
    if not fsdp["direct"] or fsdp["max_abs_diff_vs_plain"] != 0.0:
        raise SystemExit("FSDP2 at world size 1 did not take the direct path or differs from the plain stream")


if __name__ == "__main__":
    main()
