"""vLLM server sink throughput on CPU: a trainer process pushes a model into a vLLM server over the gloo backend.

    python3 -m nox -s bench -- server          # or, inside the stack: python benchmarks/bench_server.py

Starts a vLLM OpenAI server (dev mode, gloo weight transfer) on 127.0.0.1 with a random Llama-shaped model, then
pushes the same model with a non-zero LoRA adapter merged, `--syncs` times, from one trainer process. Reports the
median sync time and GB/s (merged bytes per second, end to end: merge, pack, broadcast, load in vLLM), and where
the time goes: the trainer's stages and the server worker's own (from `SyncRecord.stages`). The first sync, which
also sets up the transfer group, is reported separately. The floor, measured in the same run: a raw gloo broadcast
of the same bytes in the same chunks between two processes of this machine, with a copy into a destination on the
receiver (`broadcast_floor.py`). Then what the transaction costs, variants interleaved: no pause and no rollback,
the pause alone, the default (pause and rollback), and the default with ``verify=True`` (each check's seconds from
``record.verification.stages``), with the server's peak RSS growth (process and children, sampled every 5 ms).
Writes benchmarks/results/server.json.
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
from common import (  # noqa: E402
    Col,
    add_model_args,
    format_table,
    free_port,
    interleave,
    llama_config,
    median_growth,
    median_seconds,
    tree_rss_growth,
    vllm_servers,
    write_json,
)

#: Variants of the transaction-cost table: name -> (pause, rollback, verify).
TX_VARIANTS = {
    "plain": (None, False, False),
    "pause": ("wait", False, False),
    "pause+rollback": ("wait", True, False),
    "pause+rollback+verify": ("wait", True, True),
}
TX_COLUMNS = (
    Col("transaction cost", "22"),
    Col("median s", "9.3f"),
    Col("x plain", "8.2f"),
    Col("server peak RSS growth MiB", "27.0f"),
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap, layers=8)
    ap.add_argument("--syncs", type=int, default=5)
    ap.add_argument("--buffer-mib", type=float, default=1.0)
    ap.add_argument("--out", default=str(HERE / "results" / "server.json"))
    args = ap.parse_args()

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    from lora_stream import ParamStream, VLLMServerSink

    torch.manual_seed(0)
    base = LlamaForCausalLM(llama_config(args))
    with tempfile.TemporaryDirectory() as tmp:
        base.save_pretrained(tmp)
        with vllm_servers(tmp, timeout=300) as [(server, url)]:
            model = get_peft_model(
                base, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", init_lora_weights=False)
            )
            sink = VLLMServerSink(url, rank=0, buffer_bytes=int(args.buffer_mib * 2**20), timeout=300)
            # One stream for every sync, planned once, as the TRL hook does.
            stream = ParamStream(model, group_by="layer")
            records = [sink.sync(stream, version=f"v{i}") for i in range(args.syncs)]
            # What the transaction costs, interleaved round after round: no pause and no rollback (the sink before
            # transactions), the pause alone, and the default (pause and rollback); the server's RSS sampled.
            import psutil

            tree = psutil.Process(server.pid)

            def configure(v: str) -> None:
                sink.pause, sink.rollback, sink.verify = TX_VARIANTS[v]

            costs = interleave(
                args.syncs,
                {v: lambda i, v=v: sink.sync(stream, version=f"{v}-{i}") for v in TX_VARIANTS},
                before=configure,
                watch=lambda: tree_rss_growth(tree),
            )
            checks = [
                dict(s.result.verification.stages)
                for i in range(args.syncs)
                for v in TX_VARIANTS
                if (s := costs[v][i]).result.verification is not None
            ]
            from lora_stream.transfer.packing import plan_chunks

            meta = stream.metadata()
            plan = plan_chunks(
                [list(m.shape) for m in meta],
                [m.dtype for m in meta],
                [len(g) for g in stream.groups()],
                int(args.buffer_mib * 2**20),
            )
            chunk_bytes = [plan.chunk_bytes(c) for c in range(len(plan.chunks))]
        floor_out = os.path.join(tmp, "floor.json")
        fport = free_port()
        procs = [
            subprocess.Popen(
                [sys.executable, str(HERE / "broadcast_floor.py"), str(r), str(fport), floor_out]
                + [str(n) for n in chunk_bytes],
                env={**os.environ, "OMP_NUM_THREADS": "1"},
            )
            for r in (0, 1)
        ]
        for p in procs:
            p.wait(timeout=600)
        floor = json.loads(Path(floor_out).read_text())["broadcast_floor_s"]
    first, rest = records[0], records[1:]
    median = statistics.median(r.seconds for r in rest)
    gbps = rest[0].bytes / median / 1e9

    def med(key: str, worker: bool = False) -> float:
        return statistics.median(
            float((r.stages.get("worker", {}) if worker else r.stages).get(key, 0.0)) for r in rest
        )

    trainer = {k: med(k) for k in ("produce_s", "pack_s", "send_wait_s", "http_s")}
    worker = {k: med(k, worker=True) for k in ("recv_wait_s", "unpack_s", "load_s", "finish_s")}
    vllm_own = worker["load_s"] + worker["finish_s"]
    ours = median - vllm_own
    print(
        f"\nmodel: {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}: {first.bytes / 2**20:.0f} MiB "
        f"float32, {first.tensors} tensors; buffer {args.buffer_mib:g} MiB; 1 trainer process -> vLLM server (gloo)"
    )
    print(f"  first sync (with group setup): {first.seconds:.2f} s")
    print(f"  median of the next {len(rest)}:     {median:.2f} s  ({gbps:.3f} GB/s end to end)")
    print(f"  broadcast floor (same bytes and chunks, 2 processes, copy on the receiver): {floor:.3f} s")
    print("  trainer stages (median s): " + ", ".join(f"{k} {v:.3f}" for k, v in trainer.items()))
    print("  server worker stages (median s): " + ", ".join(f"{k} {v:.3f}" for k, v in worker.items()))
    print(
        f"  vLLM's own load (load_weights + reload finalisation and check): {vllm_own:.3f} s; the rest, ours: "
        f"{ours:.3f} s = {ours / floor:.2f}x the broadcast floor; end to end {median / floor:.2f}x the floor, "
        f"{median / vllm_own:.2f}x vLLM's own load"
    )
    transport = ours - trainer["produce_s"]
    print(
        f"  of ours, the trainer's merges (produce_s) {trainer['produce_s']:.3f} s, a cost the broadcast floor lacks;"
        f" the rest (transport, packing, HTTP, waits) {transport:.3f} s = {transport / floor:.2f}x the floor, "
        "if the merges overlapped nothing"
    )
    base = median_seconds(costs["plain"])
    tx_rows = []
    for v in TX_VARIANTS:
        m = median_seconds(costs[v])
        g = median_growth(costs[v]) / 2**20
        tx_rows.append({"variant": v, "median_s": m, "ratio": m / base, "server_rss_growth_mib": g})
    keys = ("variant", "median_s", "ratio", "server_rss_growth_mib")
    print(format_table(TX_COLUMNS, [[r[k] for k in keys] for r in tx_rows], rule=False, indent="  "))
    verify_stages = {k: statistics.median(c.get(k, 0.0) for c in checks) for k in (checks[0] if checks else {})}
    print("  verify=True, each check (median s): " + ", ".join(f"{k} {v:.3f}" for k, v in verify_stages.items()))
    write_json(
        args.out,
        {
            "args": vars(args),
            "first_s": first.seconds,
            "median_s": median,
            "bytes": first.bytes,
            "gbps": gbps,
            "broadcast_floor_s": floor,
            "trainer_stages_s": trainer,
            "worker_stages_s": worker,
            "vllm_own_load_s": vllm_own,
            "ours_s": ours,
            "ours_less_produce_s": transport,
            "transaction": tx_rows,
            "verify_stages_s": verify_stages,
        },
    )


if __name__ == "__main__":
    main()
