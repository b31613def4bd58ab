"""What a sync saves by sending only what changed: 2 ZeRO-3 ranks into a vLLM server, full against skipping syncs.

    python3 -m nox -s bench -- skip            # or, inside the stack: python benchmarks/bench_skip.py

Three cases, each with a server of its own started from the base checkpoint (float32, lora_stream's gloo weight
transfer): the server benchmark's Llama shape with LoRA r=16 on every linear layer, the same with LoRA on attention
only, and a Qwen3-MoE shape (fused experts, most of the bytes) with LoRA on attention. After every training step the
trainer syncs; rounds alternate a *full* sync (the sink told to ``forget()`` what the server holds, so it sends
everything, fingerprints included) and a *skipping* one (the default), interleaved so that the machine's drift hits
both alike. Reported per case (medians over the rounds): sync time and its ratio, bytes gathered per rank, bytes
sent by the feeding rank, the server workers' snapshot (what they keep to undo the update), the server's peak RSS
growth, and the fingerprint's cost (seconds, and the local frozen bytes it read per rank). Writes
benchmarks/results/skip.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import free_port, llama_config, rank_env, start_vllm_server, wait_vllm_server  # noqa: E402

MiB = 2**20


def checkpoint(case: str, args: argparse.Namespace, path: str) -> None:
    import torch

    torch.manual_seed(0)
    if case == "moe-attn":
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        cfg = Qwen3MoeConfig(
            vocab_size=8192,
            hidden_size=512,
            intermediate_size=1024,
            moe_intermediate_size=args.moe_intermediate,
            num_experts=args.experts,
            num_experts_per_tok=2,
            num_hidden_layers=args.moe_layers,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=64,
            tie_word_embeddings=False,
        )
        Qwen3MoeForCausalLM(cfg).save_pretrained(path)
        return
    from transformers import LlamaForCausalLM

    LlamaForCausalLM(llama_config(args)).save_pretrained(path)


def run_case(case: str, args: argparse.Namespace, tmp: str) -> dict[str, object]:
    path = str(Path(tmp) / case)
    checkpoint(case, args, path)
    server, url = start_vllm_server(path)
    try:
        wait_vllm_server(server, url, 600)
        out = str(Path(tmp) / f"{case}-out")
        port = free_port()
        targets = "all" if case == "dense-all" else "attn"
        cmd = [sys.executable, str(HERE / "skip_worker.py"), url, str(server.pid), path, targets, str(args.rounds), out]
        procs = [
            subprocess.Popen(cmd, env=rank_env(r, port), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for r in (0, 1)
        ]
        logs = [p.communicate(timeout=3600)[0] for p in procs]
        if any(p.returncode for p in procs):
            raise SystemExit(f"case {case} failed:\n" + "\n".join(log[-4000:] for log in logs))
        ranks = [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in (0, 1)]
    finally:
        server.terminate()
        server.wait(timeout=60)
    result: dict[str, object] = {"case": case}
    for kind in ("full", "skip"):
        r0 = [row for row in ranks[0]["rows"] if row["kind"] == kind]
        r1 = [row for row in ranks[1]["rows"] if row["kind"] == kind]

        def med(rows: list[dict], key: str) -> float:
            return float(statistics.median(float(row[key]) for row in rows))

        result[kind] = {
            "seconds": max(med(r0, "seconds"), med(r1, "seconds")),
            "gathered_mib_per_rank": med(r0, "gathered_bytes") / MiB,
            "sent_mib": med(r0, "sent_bytes") / MiB,
            "tensors": med(r0, "tensors"),
            "skipped_tensors": med(r0, "skipped_tensors"),
            "snapshot_mib": med(r0, "snapshot_bytes") / MiB,
            "server_rss_growth_mib": med(r0, "server_rss_growth") / MiB,
            "server_load_s": med(r0, "server_load_s"),
            "fingerprint_s": max(med(r0, "fingerprint_s"), med(r1, "fingerprint_s")),
            "decide_s": max(med(r0, "decide_s"), med(r1, "decide_s")),
        }
    result["fingerprinted_local_mib"] = max(r["fingerprinted_local_bytes"] for r in ranks) / MiB
    result["rounds"] = args.rounds
    return result


def _linear_fingerprint(t: object) -> int:
    """The fingerprint lora_stream used before NH, kept here as the baseline: a weighted sum of 64-bit words with
    odd weights (linear: two sign flips at one parity cancel). Same blocks and one device sync, as it was."""
    import torch

    assert isinstance(t, torch.Tensor)
    words = t.detach().contiguous().view(-1).view(torch.uint8)
    main = words[: words.numel() // 8 * 8].view(torch.int64)
    w = _LINEAR_WEIGHTS.setdefault(
        "w", torch.randint(-(1 << 62), 1 << 62, (1 << 20,), generator=torch.Generator().manual_seed(1)) | 1
    )
    sums = [
        torch.dot(main[i : i + (1 << 20)], w[: min(1 << 20, main.numel() - i)]) for i in range(0, main.numel(), 1 << 20)
    ]
    return int(torch.stack(sums).sum()) if sums else 0


_LINEAR_WEIGHTS: dict[str, object] = {}


def fingerprint_cost(args: argparse.Namespace) -> list[dict[str, object]]:
    """NH (``lora_stream.fingerprint``) against the linear sum it replaced, on the same tensors in the same run,
    interleaved, at 1 and 2 threads: GiB/s and the ratio."""
    import time

    import torch

    from lora_stream.fingerprint import fingerprint

    rows: list[dict[str, object]] = []
    before = torch.get_num_threads()
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for dtype in (torch.float32, torch.bfloat16):
            t = torch.randn(args.fingerprint_mib * MiB // dtype.itemsize).to(dtype)
            times: dict[str, list[float]] = {"nh": [], "linear": []}
            for _ in range(args.rounds + 1):  # the first round warms up, and is dropped
                for name, fn in (("nh", fingerprint), ("linear", _linear_fingerprint)):
                    s = time.perf_counter()
                    fn(t)
                    times[name].append(time.perf_counter() - s)
            nh, lin = (statistics.median(times[k][1:]) for k in ("nh", "linear"))
            gib = args.fingerprint_mib / 1024
            rows.append(
                {
                    "threads": threads,
                    "dtype": str(dtype),
                    "mib": args.fingerprint_mib,
                    "nh_gib_s": gib / nh,
                    "linear_gib_s": gib / lin,
                    "nh_over_linear": nh / lin,
                }
            )
    torch.set_num_threads(before)
    print("\nfingerprint cost: NH against the linear sum it replaced (same tensors, interleaved, medians)")
    print(f"{'threads':>7} {'dtype':>15} {'MiB':>6} {'NH GiB/s':>9} {'linear GiB/s':>13} {'NH / linear':>12}")
    for r in rows:
        print(
            f"{r['threads']:>7} {r['dtype']:>15} {r['mib']:>6} {r['nh_gib_s']:>9.2f} {r['linear_gib_s']:>13.2f} "
            f"{r['nh_over_linear']:>12.1f}"
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=2816)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--moe-layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--moe-intermediate", type=int, default=384)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cases", default="dense-all,dense-attn,moe-attn")
    ap.add_argument("--out", default=str(HERE / "results" / "skip.json"))
    ap.add_argument("--fingerprint-mib", type=int, default=256, help="tensor size for the fingerprint's cost")
    ap.add_argument("--fingerprint-only", action="store_true", help="measure the fingerprint's cost only")
    args = ap.parse_args()
    cost = fingerprint_cost(args)
    if args.fingerprint_only:
        out = Path(args.out).with_name("fingerprint.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"args": vars(args), "fingerprint": cost}, indent=1))
        return
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for case in args.cases.split(","):
            results.append(run_case(case, args, tmp))
            print(f"  {case}: done", flush=True)
    header = (
        f"{'case':<11} {'sync':<5} {'seconds':>8} {'x full':>7} {'tensors':>8} {'gathered MiB/rank':>18} "
        f"{'sent MiB':>9} {'snapshot MiB':>13} {'server RSS +MiB':>16} {'vLLM load s':>12} {'fingerprint s':>14}"
    )
    print("\n2 ZeRO-3 ranks -> 1 vLLM server (gloo), median over interleaved rounds\n" + header)
    print("-" * len(header))
    for res in results:
        full = res["full"]
        for kind in ("full", "skip"):
            row = res[kind]
            print(
                f"{res['case']:<11} {kind:<5} {row['seconds']:>8.3f} {row['seconds'] / full['seconds']:>7.2f} "
                f"{row['tensors']:>8.0f} {row['gathered_mib_per_rank']:>18.1f} {row['sent_mib']:>9.1f} "
                f"{row['snapshot_mib']:>13.1f} {row['server_rss_growth_mib']:>16.0f} {row['server_load_s']:>12.3f} "
                f"{row['fingerprint_s']:>14.4f}"
            )
        print(f"{'':<11} fingerprints read {res['fingerprinted_local_mib']:.0f} MiB of frozen shards per rank")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "results": results, "fingerprint": cost}, indent=1))


if __name__ == "__main__":
    main()
