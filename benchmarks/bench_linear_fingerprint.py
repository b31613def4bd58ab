"""The linear fingerprint element syncs prove with, against NH, where an element sync spends them: one range read
whole, and an update from the changed elements alone.

    python3 -m nox -s bench -- linear_fingerprint   # in the stack: python benchmarks/bench_linear_fingerprint.py

A bfloat16 range of ``--numel`` elements (8.5M by default: one rank's shard of the 17M-parameter model of
``bench_elements.py``). Reported, best of ``--reps``, seconds: ``lora_stream.fingerprint`` (NH) over the whole range,
``lora_stream.linear_fingerprint`` over the whole range, and its update (``linear_update``) for each changed fraction
(``--fractions``: the fractions an AdamW step changes at lr 1e-6 and 1e-5), with the ratio of each to NH's whole
read. An update pays where its ratio is below the linear whole read's. Writes
benchmarks/results/linear_fingerprint.json.
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
    ap.add_argument("--out", default=str(HERE / "results" / "linear_fingerprint.json"))
    args = ap.parse_args()

    import torch

    from lora_stream.fingerprint import fingerprint
    from lora_stream.linear_fingerprint import linear_fingerprint, linear_update

    torch.manual_seed(0)
    values = torch.randn(args.numel).to(torch.bfloat16)
    linear_fingerprint(values)  # the key's tables, once per process
    nh = _best(args.reps, fingerprint, values)
    whole = _best(args.reps, linear_fingerprint, values)
    rows: list[list[object]] = [
        ["NH, whole range", args.numel, nh, 1.0],
        ["linear, whole range", args.numel, whole, whole / nh],
    ]
    for fraction in (float(x) for x in args.fractions.split(",")):
        k = int(args.numel * fraction)
        index = torch.randperm(args.numel)[:k].sort().values
        new = values[index].neg()
        update = _best(args.reps, linear_update, 0, index, values[index], new)
        rows.append([f"linear, update of {fraction:.1%}", k, update, update / nh])
    cols = (Col("what", "<28"), Col("elements", ">10d"), Col("seconds", ">9.4f", " s"), Col("x NH whole", ">10.2f"))
    print(f"bfloat16 range of {args.numel} elements, best of {args.reps}, {torch.get_num_threads()} threads")
    print(format_table(cols, rows))
    write_json(args.out, {"numel": args.numel, "threads": torch.get_num_threads(), "rows": rows})


if __name__ == "__main__":
    main()
