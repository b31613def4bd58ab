"""verl benchmark: lora_stream's export against verl's own in-place merged export, on verl's real FSDP engine.

    python3 -m nox -s verl -- bench        # in verl's environment (.nox/verl); extra arguments follow "bench"

2 CPU ranks over gloo, verl 0.9.1's FSDP2 engine built through its trainer config with
``model.external_lib=lora_stream.integrations.verl`` and ``lora.merge=True``; a Llama (12 layers, hidden 1024,
vocab 32000 by default), LoRA r=16 on all linear layers, every adapter tensor perturbed. Both exports run on the
same engine and weights, interleaved, with fp32 and with bf16 training weights; each tensor is copied into a
preallocated bf16 destination. Columns per rank: median sync time, RSS growth during the sync (median and peak,
after ``malloc_trim``), what lora_stream gathered at once, and training-weight elements changed after every sync.
Writes benchmarks/results/verl.json.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import Col, MiB, add_model_args, format_table, run_ranks, write_json  # noqa: E402

COLUMNS = (
    Col("export", "<14"),
    Col("weights", ">7"),
    Col("rank", ">4"),
    Col("median sync", ">10.2f", "s"),
    Col("x verl", ">7.2f"),
    Col("RSS growth med", ">11.0f", "MiB"),
    Col("peak", ">6.0f", "MiB"),
    Col("x less", ">7.1f"),
    Col("gathered at once", ">16"),
    Col("drift (elements)", ">16"),
)


def run(dtype: str, args, tmp: str) -> list[dict]:  # type: ignore[no-untyped-def]
    out = str(Path(tmp) / f"verl-{dtype}")
    shape = [f"--{k}={getattr(args, k)}" for k in ("layers", "hidden", "intermediate", "vocab", "syncs")]
    cmd = [sys.executable, str(HERE / "verl_worker.py"), *shape, f"--model-dtype={dtype}", "--dir", tmp, "--out", out]
    env = {"VERL_PLATFORM": "cpu", "VERL_ENGINE_DEVICE": "cuda"}
    return [row for rows in run_ranks(cmd, out, timeout=3600, env=env) for row in rows]


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap, layers=12)
    ap.add_argument("--syncs", type=int, default=5)
    ap.add_argument("--out", default=str(HERE / "results" / "verl.json"))
    args = ap.parse_args()
    rows: list[dict] = []
    for dtype in ("fp32", "bf16"):
        with tempfile.TemporaryDirectory() as tmp:
            print(f"running with {dtype} training weights ...", flush=True)
            rows += run(dtype, args, tmp)
    lines = []
    for r in rows:
        base = next(
            b
            for b in rows
            if b["variant"] == "verl_in_place" and b["rank"] == r["rank"] and b["model_dtype"] == r["model_dtype"]
        )
        gathered = f"{r['peak_gathered_bytes'] / MiB:.1f}MiB" if r["peak_gathered_bytes"] else "-"
        lines.append(
            [
                r["variant"],
                r["model_dtype"],
                r["rank"],
                r["median_sync_s"],
                r["median_sync_s"] / base["median_sync_s"],
                r["median_rss_growth_bytes"] / MiB,
                r["peak_rss_growth_bytes"] / MiB,
                base["median_rss_growth_bytes"] / max(r["median_rss_growth_bytes"], 1),
                gathered,
                r["drifted_elements_after_all_syncs"],
            ]
        )
    print(
        f"\nmodel: {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}; "
        f"{rows[0]['model_bytes'] / MiB:.0f} MiB (fp32 run), {args.syncs} syncs per export, 2 ranks, verl FSDP2\n"
    )
    print(format_table(COLUMNS, lines))
    write_json(args.out, {"rows": rows, "args": vars(args)})
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
