"""ZeRO-3 sync benchmark: TRL's whole-model gather versus lora_stream, 2 CPU ranks over gloo, one invocation.

    python3 -m nox -s bench -- zero3                 # or, inside the stack: python benchmarks/bench_zero3.py
    python benchmarks/bench_zero3.py --layers 4 --syncs 3     # a quick small run

Each variant runs in fresh processes (so one variant's freed heap cannot flatter the next one's RSS) on the same
model: a Llama-shaped bf16 model built under deepspeed.zero.Init, LoRA r=16 on all linear layers (non-zero).
Per variant and rank: median sync time, peak gathered bytes, process RSS growth during the syncs (sampled every
2 ms, default glibc settings), and the drift of the training weights (ZeRO partitions) after all syncs.
Ratios are against the whole-gather baseline of the same run. Writes benchmarks/results/zero3.json.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import MiB, llama_config, model_cli, run_variant, table, write_json  # noqa: E402


def unsharded_drift(args: argparse.Namespace, cycles: int) -> dict[str, dict[str, float]]:
    """Drift of the training weights on an unsharded bf16 model, where the baseline's in-place merge is real.

    Under ZeRO-3, TRL's merge_adapter() writes into the gathered copy that GatheredParameters(modifier_rank=None)
    discards, so the partitions do not drift (the table shows 0 for both). Without ZeRO-3 -- DDP, a single GPU --
    the same code merges into the live weights and unmerges again, in bf16, every sync. Same model shape, fewer
    layers (drift is per element), in this process.
    """
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    from lora_stream import ParamStream

    cfg = llama_config(args, num_hidden_layers=2)
    out = {}
    for variant in ("whole_gather", "lora_stream"):
        torch.manual_seed(0)
        model = get_peft_model(
            LlamaForCausalLM(cfg).to(torch.bfloat16),
            LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", init_lora_weights=False),
        )
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        for _ in range(cycles):
            if variant == "whole_gather":
                model.merge_adapter()
                for _n, _p in model.named_parameters():
                    pass
                model.unmerge_adapter()
            else:
                for _n, _t in ParamStream(model):
                    pass
        now = {n: p.detach() for n, p in model.named_parameters()}
        changed = sum(int((p != before[n]).sum()) for n, p in now.items())
        worst = max(float((p.float() - before[n].float()).abs().max()) for n, p in now.items())
        out[variant] = {"changed_elements": changed, "max_abs": worst}
    return out


LABELS = ("whole_gather", "floor", "budget", "layer", "prefetch", "fallback", "no-release", "reuse-outputs")


def main() -> None:
    args, common = model_cli(
        __doc__ or "",
        syncs=20,
        out=HERE / "results" / "zero3.json",
        extra=lambda ap: ap.add_argument("--only", default="", help=f"comma-separated subset of: {', '.join(LABELS)}"),
    )
    first = str(int(args.budgets_mib.split(",")[0]) * MiB)
    labelled: list[tuple[str, str, list[str]]] = [("whole_gather", "whole_gather", []), ("floor", "floor", [])]
    # The first budget's stream is also timed in turns with the floor parts (--interleaved-floor).
    labelled += [
        ("budget", "lora_stream", ["--budget", str(int(b) * MiB), *(["--interleaved-floor"] if i == 0 else [])])
        for i, b in enumerate(args.budgets_mib.split(","))
    ]
    labelled += [("layer", "lora_stream", ["--group-by", "layer"])]
    labelled += [(opt, "lora_stream", ["--budget", first, f"--{opt}"]) for opt in LABELS[4:]]
    only = set(filter(None, args.only.split(",")))
    if only - set(LABELS) or (only and not {"whole_gather", "floor"} <= only):
        raise SystemExit(f"--only: labels from {LABELS}, including whole_gather and floor (the baselines)")
    variants = [(v, extra) for label, v, extra in labelled if not only or label in only]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for variant, extra in variants:
            print(f"running {variant} {' '.join(extra)} ...", flush=True)
            rows += run_variant(HERE / "zero3_worker.py", variant, extra, common, tmp, timeout=1800)
    model_mib = rows[0]["model_bytes"] / MiB
    print(
        f"\nmodel: {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}: {model_mib:.0f} MiB bf16; "
        f"{args.syncs} syncs per variant, 2 ranks\n"
    )
    floors = {r["rank"]: r["floors"] for r in rows if r["variant"] == "floor"}
    interleaved = [r for r in rows if r["variant"] != "floor" and r["floors"]]
    rows = [r for r in rows if r["variant"] != "floor"]
    print(table(rows, "whole_gather"))
    print(
        "\nfloors measured in the same run (median; no-overlap = all-gather + merge + copy, overlap = max(all-gather,"
        " merge + copy)):"
    )
    for rank, f in sorted(floors.items()):
        print(
            f"  rank {rank}: raw all-gather {f['all_gather_s']:.3f} s, merge alone {f['merge_s']:.3f} s, copy alone "
            f"{f['copy_s']:.3f} s; no-overlap floor {f['no_overlap_s']:.3f} s, overlapped floor {f['overlap_s']:.3f} s"
        )
    print("\neach variant against the floors of its rank:")
    for r in rows:
        f = floors[r["rank"]]
        print(
            f"  {r['variant']:<22} {','.join(r['options']) or '-':<14} rank {r['rank']}: "
            f"{r['median_sync_s'] / f['no_overlap_s']:.2f}x no-overlap floor, "
            f"{r['median_sync_s'] / f['overlap_s']:.2f}x overlapped floor, growth "
            f"{r['rss_growth_bytes'] / max(r['largest_group_bytes'], 1):.2f}x largest group"
            + (f", heap trims per sync {r['heap_trims_per_sync']}" if r.get("heap_trims_per_sync") else "")
        )
    if interleaved:
        print("\nthe default stream and the floor parts timed in turns, in the same processes (the steadier ratio):")
    for r in interleaved:
        f = r["floors"]
        print(
            f"  rank {r['rank']}: sync {f['sync_s']:.3f} s; all-gather {f['all_gather_s']:.3f} + merge "
            f"{f['merge_s']:.3f} + copy {f['copy_s']:.3f} = {f['no_overlap_s']:.3f} s; "
            f"{f['sync_s'] / f['no_overlap_s']:.2f}x no-overlap floor, {f['sync_s'] / f['overlap_s']:.2f}x overlapped"
        )
    drift = unsharded_drift(args, cycles=args.syncs)
    print(
        f"\ndrift of the training weights after {args.syncs} syncs of an unsharded bf16 model (2 layers, same shapes):"
    )
    for variant, d in drift.items():
        print(f"  {variant:<14} {d['changed_elements']:>10} elements changed, max |change| {d['max_abs']:.3g}")
    write_json(args.out, {"args": vars(args), "rows": rows, "floors": floors, "unsharded_drift": drift})
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
