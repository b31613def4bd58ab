"""Saving a merged checkpoint from ZeRO-3 (2 ranks, gloo, CPU): lora_stream's save_merged against a whole gather.

Model: the ZeRO-3 benchmark's (Llama-shaped, bf16, built under zero.Init, LoRA r=16 on all linear layers, non-zero).
Baseline "gather_merge_save": GatheredParameters over every parameter, merge_adapter() on rank 0, the merged state
dict copied out, unmerge_adapter(), safetensors' save_file on rank 0 -- what a user does today. "lora_stream":
save_merged(engine, dir). Each variant in fresh processes, --syncs saves each; RSS growth is the peak during the
saves minus the resident set before them. Writes benchmarks/results/checkpoint.json.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import Col, MiB, format_table, model_cli, run_variant, write_json  # noqa: E402

COLUMNS = (
    Col("variant", "<18"),
    Col("rank", ">4"),
    Col("median save", ">10.2f", "s"),
    Col("x base", ">7.2f"),
    Col("RSS growth", ">8.0f", "MiB"),
    Col("x less", ">7.1f"),
    Col("peak gathered", ">14"),
    Col("written", ">6.0f", "MiB"),
)


def main() -> None:
    args, common = model_cli(__doc__ or "", syncs=3, out=HERE / "results" / "checkpoint.json")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for variant in ("gather_merge_save", "lora_stream"):
            print(f"running {variant} ...", flush=True)
            rows += run_variant(HERE / "checkpoint_worker.py", variant, [], common, tmp, timeout=1800)
    base = {r["rank"]: r for r in rows if r["variant"] == "gather_merge_save"}
    lines = []
    for r in rows:
        b = base[r["rank"]]
        gathered = f"{r['peak_gathered_bytes'] / MiB:.1f}MiB" if r["peak_gathered_bytes"] else "whole model"
        lines.append(
            [
                r["variant"],
                r["rank"],
                r["median_save_s"],
                r["median_save_s"] / b["median_save_s"],
                r["rss_growth_bytes"] / MiB,
                b["rss_growth_bytes"] / max(r["rss_growth_bytes"], 1),
                gathered,
                r["written_bytes"] / MiB,
            ]
        )
    print(format_table(COLUMNS, lines))
    write_json(args.out, {"args": vars(args), "rows": rows})
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
