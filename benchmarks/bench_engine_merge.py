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
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import free_port, llama_config, rank_env, wait_vllm_server  # noqa: E402

MiB = 2**20
MODES = ("trainer", "engine", "adapter")


def start_server(model: str) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    env = {
        **os.environ,
        "VLLM_SERVER_DEV_MODE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1",
    }
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--dtype", "float32"]
    cmd += ["--max-model-len", "128", "--enforce-eager", "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--skip-tokenizer-init", "--weight-transfer-config", '{"backend": "gloo"}']
    cmd += ["--enable-lora", "--max-lora-rank", "16", "--max-num-seqs", "8"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return proc, f"http://127.0.0.1:{port}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=2816)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(HERE / "results" / "engine_merge.json"))
    args = ap.parse_args()
    import torch
    from transformers import LlamaForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "model")
        torch.manual_seed(0)
        LlamaForCausalLM(llama_config(args)).save_pretrained(path)
        servers = []
        try:
            for _ in MODES:
                servers.append(start_server(path))
                wait_vllm_server(*servers[-1], 600)  # one at a time: two cores
            urls = ",".join(u for _, u in servers)
            pids = ",".join(str(p.pid) for p, _ in servers)
            out = str(Path(tmp) / "out")
            port = free_port()
            cmd = [sys.executable, str(HERE / "engine_merge_worker.py"), urls, pids, path, str(args.rounds), out]
            procs = [
                subprocess.Popen(
                    cmd, env=rank_env(r, port), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
                )
                for r in (0, 1)
            ]
            logs = [p.communicate(timeout=3600)[0] for p in procs]
            if any(p.returncode for p in procs):
                raise SystemExit("benchmark failed:\n" + "\n".join(log[-4000:] for log in logs))
            ranks = [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in (0, 1)]
        finally:
            for proc, _ in servers:
                proc.terminate()
                proc.wait(timeout=60)
    results: dict[str, dict[str, float]] = {}
    for mode in MODES:
        r0 = [row for row in ranks[0]["rows"] if row["mode"] == mode]
        r1 = [row for row in ranks[1]["rows"] if row["mode"] == mode]

        def med(rows: list[dict], key: str) -> float:
            return float(statistics.median(float(row[key] or 0.0) for row in rows))

        results[mode] = {
            "seconds": max(med(r0, "seconds"), med(r1, "seconds")),
            "gathered_mib_per_rank": med(r0, "gathered_bytes") / MiB,
            "sent_mib": med(r0, "sent_bytes") / MiB,
            "produce_s": med(r0, "produce_s"),
            "send_wait_s": med(r0, "send_wait_s"),
            "fingerprint_s": max(med(r0, "fingerprint_s"), med(r1, "fingerprint_s")),
            "server_merge_s": med(r0, "server_merge_s"),
            "server_load_s": med(r0, "server_load_s"),
            "server_kept_mib": med(r0, "server_kept_bytes") / MiB,
            "server_base_mib": med(r0, "server_base_bytes") / MiB,
            "server_rss_mib": ranks[0]["server_rss"][mode] / MiB,
            "tokens_per_s": float(statistics.median(ranks[0]["tokens_per_s"][mode])),
            "tokens_per_s_all": ranks[0]["tokens_per_s"][mode],
        }
    base = results["trainer"]
    header = (
        f"{'sync':<8} {'seconds':>8} {'x merged':>9} {'gathered MiB/rank':>18} {'sent MiB':>9} {'produce s':>10} "
        f"{'server merge s':>15} {'vLLM load s':>12} {'kept MiB':>9} {'base MiB':>9} {'server RSS MiB':>15} "
        f"{'tokens/s':>9} {'x merged':>9}"
    )
    print("\n2 ZeRO-3 ranks -> vLLM servers (gloo), LoRA r=16 on every linear layer, median over interleaved rounds")
    print(header + "\n" + "-" * len(header))
    for mode in MODES:
        r = results[mode]
        print(
            f"{mode:<8} {r['seconds']:>8.3f} {r['seconds'] / base['seconds']:>9.2f} "
            f"{r['gathered_mib_per_rank']:>18.1f} "
            f"{r['sent_mib']:>9.1f} {r['produce_s']:>10.3f} {r['server_merge_s']:>15.3f} {r['server_load_s']:>12.3f} "
            f"{r['server_kept_mib']:>9.1f} {r['server_base_mib']:>9.1f} {r['server_rss_mib']:>15.0f} "
            f"{r['tokens_per_s']:>9.1f} {r['tokens_per_s'] / base['tokens_per_s']:>9.2f}"
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))


if __name__ == "__main__":
    main()
