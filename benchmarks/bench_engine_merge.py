"""Where the merge runs: the trainer-side merged sync, the engine-side merge, and the adapter sync with vLLM's LoRA
serving, side by side. 2 ZeRO-3 ranks, the server benchmark's Llama shape with LoRA r=16 on every linear layer.

    python3 -m nox -s bench -- engine_merge      # or, inside the stack: python benchmarks/bench_engine_merge.py

Three vLLM servers (float32, lora_stream's gloo transfer, all started alike with ``--enable-lora``), one per way of
syncing, so that each keeps its steady state (a sink whose server another sink wrote sends everything again). After
every training step each is synced in turn (rounds interleaved, so the machine's drift hits all three alike).
Reported (medians over the rounds): sync time and its stages, bytes gathered per rank and sent, what the server's
workers keep to undo an update, the base they keep, each server's RSS, and the generation throughput of a fixed
batch (8 prompts x 32 tokens, greedy): merged weights against vLLM's LoRA kernels. Writes
benchmarks/results/engine_merge.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import (  # noqa: E402
    Col,
    MiB,
    add_model_args,
    format_table,
    llama_config,
    median_of,
    rank_rows,
    run_ranks,
    vllm_servers,
    write_json,
)

MODES = ("trainer", "engine", "adapter")
#: What each server gets on top of :func:`common.start_vllm_server`'s: vLLM's LoRA serving, updatable at run time.
LORA_ENV = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}
LORA_ARGS = ("--enable-lora", "--max-lora-rank", "16", "--max-num-seqs", "8")
COLUMNS = (
    Col("sync", "<8"),
    Col("seconds", ">8.3f"),
    Col("x merged", ">9.2f"),
    Col("gathered MiB/rank", ">18.1f"),
    Col("sent MiB", ">9.1f"),
    Col("produce s", ">10.3f"),
    Col("server merge s", ">15.3f"),
    Col("vLLM load s", ">12.3f"),
    Col("kept MiB", ">9.1f"),
    Col("base MiB", ">9.1f"),
    Col("server RSS MiB", ">15.0f"),
    Col("tokens/s", ">9.1f"),
    Col("x merged", ">9.2f"),
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap, layers=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(HERE / "results" / "engine_merge.json"))
    args = ap.parse_args()
    import torch
    from transformers import LlamaForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "model")
        torch.manual_seed(0)
        LlamaForCausalLM(llama_config(args)).save_pretrained(path)
        # One at a time: two cores.
        with vllm_servers(path, len(MODES), timeout=600, env=LORA_ENV, args=LORA_ARGS, one_by_one=True) as servers:
            urls = ",".join(u for _, u in servers)
            pids = ",".join(str(p.pid) for p, _ in servers)
            out = str(Path(tmp) / "out")
            cmd = [sys.executable, str(HERE / "engine_merge_worker.py"), urls, pids, path, str(args.rounds), out]
            ranks = run_ranks(cmd, out, timeout=3600, failure="benchmark failed:\n", tail=4000)
    results: dict[str, dict[str, float]] = {}
    for mode in MODES:
        r0, r1 = rank_rows(ranks, "mode", mode)
        results[mode] = {
            "seconds": max(median_of(r0, "seconds"), median_of(r1, "seconds")),
            "gathered_mib_per_rank": median_of(r0, "gathered_bytes") / MiB,
            "sent_mib": median_of(r0, "sent_bytes") / MiB,
            "produce_s": median_of(r0, "produce_s"),
            "send_wait_s": median_of(r0, "send_wait_s"),
            "fingerprint_s": max(median_of(r0, "fingerprint_s"), median_of(r1, "fingerprint_s")),
            "server_merge_s": median_of(r0, "server_merge_s"),
            "server_load_s": median_of(r0, "server_load_s"),
            "server_kept_mib": median_of(r0, "server_kept_bytes") / MiB,
            "server_base_mib": median_of(r0, "server_base_bytes") / MiB,
            "server_rss_mib": ranks[0]["server_rss"][mode] / MiB,
            "tokens_per_s": float(statistics.median(ranks[0]["tokens_per_s"][mode])),
            "tokens_per_s_all": ranks[0]["tokens_per_s"][mode],
        }
    base = results["trainer"]
    print("\n2 ZeRO-3 ranks -> vLLM servers (gloo), LoRA r=16 on every linear layer, median over interleaved rounds")
    rows = [
        [
            mode,
            r["seconds"],
            r["seconds"] / base["seconds"],
            r["gathered_mib_per_rank"],
            r["sent_mib"],
            r["produce_s"],
            r["server_merge_s"],
            r["server_load_s"],
            r["server_kept_mib"],
            r["server_base_mib"],
            r["server_rss_mib"],
            r["tokens_per_s"],
            r["tokens_per_s"] / base["tokens_per_s"],
        ]
        for mode, r in results.items()
    ]
    print(format_table(COLUMNS, rows))
    write_json(args.out, {"args": vars(args), "results": results})


if __name__ == "__main__":
    main()
