"""FSDP2 sync benchmark: whole-model full_tensor() versus lora_stream per group, 2 CPU ranks over gloo.

    python3 -m nox -s bench -- fsdp2            # or, inside the stack: python benchmarks/bench_fsdp2.py

Same model and columns as bench_zero3.py (Llama-shaped bf16, 16 layers, LoRA r=16 on all linear layers). The
baseline gathers every parameter with full_tensor() at once, then merges each LoRA module in float32 (what a
trainer that "gathers the full state dict, then merges" does). Writes benchmarks/results/fsdp2.json.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import MiB, model_cli, run_variant, table, write_json  # noqa: E402


def main() -> None:
    args, common = model_cli(__doc__ or "", syncs=10, out=HERE / "results" / "fsdp2.json")
    variants: list[tuple[str, list[str]]] = [("whole_full_tensor", [])]
    variants += [("lora_stream", ["--budget", str(int(b) * MiB)]) for b in args.budgets_mib.split(",")]
    variants += [("lora_stream", ["--group-by", "layer"])]
    first = str(int(args.budgets_mib.split(",")[0]) * MiB)
    variants += [("lora_stream", ["--budget", first, "--no-release"])]
    variants += [("lora_stream", ["--budget", first, "--fallback"])]
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for variant, extra in variants:
            print(f"running {variant} {' '.join(extra)} ...", flush=True)
            rows += run_variant(HERE / "fsdp2_worker.py", variant, extra, common, tmp, timeout=1800)
    print(
        f"\nmodel: {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}: "
        f"{rows[0]['model_bytes'] / MiB:.0f} MiB bf16; {args.syncs} syncs per variant, 2 ranks, FSDP2\n"
    )
    print(table(rows, "whole_full_tensor"))
    write_json(args.out, {"args": vars(args), "rows": rows})
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
