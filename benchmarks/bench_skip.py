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
    interleave,
    llama_config,
    median_of,
    median_seconds,
    rank_rows,
    run_ranks,
    vllm_servers,
    write_json,
)

COLUMNS = (
    Col("case", "<11"),
    Col("sync", "<5"),
    Col("seconds", ">8.3f"),
    Col("x full", ">7.2f"),
    Col("tensors", ">8.0f"),
    Col("gathered MiB/rank", ">18.1f"),
    Col("sent MiB", ">9.1f"),
    Col("snapshot MiB", ">13.1f"),
    Col("server RSS +MiB", ">16.0f"),
    Col("vLLM load s", ">12.3f"),
    Col("fingerprint s", ">14.4f"),
)
FINGERPRINT_COLUMNS = (
    Col("threads", ">7"),
    Col("dtype", ">15"),
    Col("MiB", ">6"),
    Col("NH GiB/s", ">9.2f"),
    Col("linear GiB/s", ">13.2f"),
    Col("NH / linear", ">12.1f"),
)


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
    with vllm_servers(path, timeout=600) as [(server, url)]:
        out = str(Path(tmp) / f"{case}-out")
        targets = "all" if case == "dense-all" else "attn"
        cmd = [sys.executable, str(HERE / "skip_worker.py"), url, str(server.pid), path, targets, str(args.rounds), out]
        ranks = run_ranks(cmd, out, timeout=3600, failure=f"case {case} failed:\n", tail=4000)
    result: dict[str, object] = {"case": case}
    for kind in ("full", "skip"):
        r0, r1 = rank_rows(ranks, "kind", kind)
        result[kind] = {
            "seconds": max(median_of(r0, "seconds"), median_of(r1, "seconds")),
            "gathered_mib_per_rank": median_of(r0, "gathered_bytes") / MiB,
            "sent_mib": median_of(r0, "sent_bytes") / MiB,
            "tensors": median_of(r0, "tensors"),
            "skipped_tensors": median_of(r0, "skipped_tensors"),
            "snapshot_mib": median_of(r0, "snapshot_bytes") / MiB,
            "server_rss_growth_mib": median_of(r0, "server_rss_growth") / MiB,
            "server_load_s": median_of(r0, "server_load_s"),
            "fingerprint_s": max(median_of(r0, "fingerprint_s"), median_of(r1, "fingerprint_s")),
            "decide_s": max(median_of(r0, "decide_s"), median_of(r1, "decide_s")),
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
    import torch

    from lora_stream.fingerprint import fingerprint

    rows: list[dict[str, object]] = []
    before = torch.get_num_threads()
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for dtype in (torch.float32, torch.bfloat16):
            t = torch.randn(args.fingerprint_mib * MiB // dtype.itemsize).to(dtype)
            # The first round warms up, and is dropped.
            fns = {"nh": lambda _, t=t: fingerprint(t), "linear": lambda _, t=t: _linear_fingerprint(t)}
            runs = interleave(args.rounds + 1, fns)
            nh, lin = (median_seconds(runs[k][1:]) for k in ("nh", "linear"))
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
    keys = ("threads", "dtype", "mib", "nh_gib_s", "linear_gib_s", "nh_over_linear")
    print(format_table(FINGERPRINT_COLUMNS, [[r[k] for k in keys] for r in rows], rule=False))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap, layers=8)
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
        write_json(Path(args.out).with_name("fingerprint.json"), {"args": vars(args), "fingerprint": cost})
        return
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for case in args.cases.split(","):
            results.append(run_case(case, args, tmp))
            print(f"  {case}: done", flush=True)
    lines: list[list[object] | str] = []
    for res in results:
        full = res["full"]
        for kind in ("full", "skip"):
            row = res[kind]
            lines.append(
                [
                    res["case"],
                    kind,
                    row["seconds"],
                    row["seconds"] / full["seconds"],
                    row["tensors"],
                    row["gathered_mib_per_rank"],
                    row["sent_mib"],
                    row["snapshot_mib"],
                    row["server_rss_growth_mib"],
                    row["server_load_s"],
                    row["fingerprint_s"],
                ]
            )
        lines.append(f"{'':<11} fingerprints read {res['fingerprinted_local_mib']:.0f} MiB of frozen shards per rank")
    print("\n2 ZeRO-3 ranks -> 1 vLLM server (gloo), median over interleaved rounds")
    print(format_table(COLUMNS, lines))
    write_json(args.out, {"args": vars(args), "results": results, "fingerprint": cost})


if __name__ == "__main__":
    main()
