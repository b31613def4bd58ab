"""The field fingerprint against NH, where an element sync would spend them: one range read whole, and an update
from the changed elements alone.

    python3 -m nox -s bench -- field_fingerprint   # or, inside the stack: python benchmarks/bench_field_fingerprint.py

A bfloat16 range of ``--numel`` elements (8.5M by default: one rank's shard of the 17M-parameter model of
``bench_elements.py``). Reported, best of ``--reps``, seconds: ``lora_stream.fingerprint`` (NH) over the whole range,
``lora_stream.field_fingerprint`` over the whole range, and the field fingerprint's update for each changed fraction
(``--fractions``: the fractions an AdamW step changes at lr 1e-6 and 1e-5), with its ratio to NH's whole read. An
update pays where that ratio is below 1. Writes benchmarks/results/field_fingerprint.json.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import Col, format_table, write_json  # noqa: E402


def _best(reps: int, f: Any, *args: Any) -> float:
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        f(*args)
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--numel", type=int, default=8_500_000)
    ap.add_argument("--fractions", default="0.011,0.077")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=str(HERE / "results" / "field_fingerprint.json"))
    args = ap.parse_args()

    import torch

    from lora_stream.field_fingerprint import field_delta, field_fingerprint
    from lora_stream.fingerprint import fingerprint

    torch.manual_seed(0)
    values = torch.randn(args.numel).to(torch.bfloat16)
    field_fingerprint(values[:8])  # the tables of powers, once per process
    nh = _best(args.reps, fingerprint, values)
    whole = _best(args.reps, field_fingerprint, values)
    rows: list[list[object]] = [
        ["NH, whole range", args.numel, nh, 1.0],
        ["field, whole range", args.numel, whole, whole / nh],
    ]
    for fraction in (float(x) for x in args.fractions.split(",")):
        k = int(args.numel * fraction)
        index = torch.randperm(args.numel)[:k].sort().values
        update = _best(args.reps, field_delta, index, values[index], values[index])
        rows.append([f"field, update of {fraction:.1%}", k, update, update / nh])
    cols = (Col("what", "<28"), Col("elements", ">10d"), Col("seconds", ">9.4f", " s"), Col("x NH whole", ">10.2f"))
    print(f"bfloat16 range of {args.numel} elements, best of {args.reps}, {torch.get_num_threads()} threads")
    print(format_table(cols, rows))
    write_json(args.out, {"numel": args.numel, "threads": torch.get_num_threads(), "rows": rows})


if __name__ == "__main__":
    main()
