"""ZeRO-3 sync against model depth, and process memory over one sync: the data behind the docs' plots.

    python3 -m nox -s bench -- depth            # about 10 minutes on 2 cores; then: python3 -m nox -s plots
    python benchmarks/bench_depth.py --depths 2,4 --syncs 2      # a quick small run

For each depth, TRL's whole-model gather and lora_stream (32 MiB budget) run in fresh processes on the ZeRO-3
benchmark model (the shape of bench_zero3.py, 2 CPU ranks over gloo), ``--syncs`` syncs each. Every run keeps the
RSS samples (every 2 ms) of its last sync, so the plot shows memory against time within one sync. Writes
benchmarks/results/depth.json; benchmarks/plots.py turns it into docs/images/*.png.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import Col, MiB, format_table, model_cli, run_variant, write_json  # noqa: E402

COLUMNS = (
    Col("layers", ">6"),
    Col("model", ">6.0f", "MiB"),
    Col("variant", "<20"),
    Col("median sync", ">10.2f", "s"),
    Col("peak gathered", ">10.1f", "MiB"),
    Col("RSS growth", ">7.0f", "MiB"),
)


def main() -> None:
    args, common = model_cli(
        __doc__ or "",
        syncs=5,
        out=HERE / "results" / "depth.json",
        extra=lambda ap: ap.add_argument("--depths", default="4,8,16,32", help="decoder layers, comma-separated"),
    )
    depths = [int(d) for d in args.depths.split(",")]
    budget = str(int(args.budgets_mib.split(",")[0]) * MiB)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for depth in depths:
            shape = [a for a in common if not a.startswith("--layers=")] + [f"--layers={depth}", "--trace"]
            for variant, opts in (("whole_gather", []), ("lora_stream", ["--budget", budget])):
                print(f"depth {depth}: {variant} ...", flush=True)
                rows += run_variant(HERE / "zero3_worker.py", variant, opts, shape, tmp, timeout=1800)
    lines = [
        [
            r["layers"],
            r["model_bytes"] / MiB,
            r["variant"],
            r["median_sync_s"],
            r["peak_gathered_bytes"] / MiB,
            r["rss_growth_bytes"] / MiB,
        ]
        for r in rows
        if r["rank"] == 0
    ]
    print("\n" + format_table(COLUMNS, lines, rule=False))
    write_json(args.out, {"args": vars(args), "rows": rows}, indent=None)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
