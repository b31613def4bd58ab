"""Rank worker of bench_fleet.py: 2 trainer ranks (torch.distributed over gloo, the same model on each, as DDP keeps
it) push one model into 1, 2 and 3 vLLM servers, spread over the ranks or all from rank 0, one configuration after
the other.

Usage: fleet_worker.py OUT SYNCS URL [URL ...]   (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set; writes OUT.rankN.json)
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist


def main() -> None:
    out, syncs, urls = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from lora_stream import ParamStream, VLLMServerSink

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(os.environ["FLEET_MODEL"])
    model = get_peft_model(base, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", init_lora_weights=False))
    configs = [(n, spread) for n in range(1, len(urls) + 1) for spread in (True, False) if n > 1 or spread]
    rows: dict[str, list[dict]] = {}
    # One configuration at a time: a server's workers belong to one trainer's group at a time, so sinks sharing
    # servers cannot be interleaved without forming their groups again on every sync.
    for n, spread in configs:
        sink = VLLMServerSink(urls[:n], rank=rank, timeout=300, spread=spread, checkpoint=False)
        for i in range(syncs + 1):  # round 0 forms the groups: not counted
            dist.barrier()
            t = time.perf_counter()
            record = sink.sync(ParamStream(model, group_by="layer"), version=f"r{i}")
            seconds = time.perf_counter() - t
            # The sync ends when every rank's servers committed: the slowest rank's time is the sync's.
            slowest = torch.tensor([seconds])
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            # The decision's window (docs/guarantees.md): from a rank's records to the vote that every server
            # recorded, the longest over the ranks.
            window = torch.tensor([float(record.stages.get("decision", {}).get("window_s", 0.0))])
            dist.all_reduce(window, op=dist.ReduceOp.MAX)
            if i:
                key = f"{n}-{'spread' if spread else 'rank0'}"
                rows.setdefault(key, []).append(
                    {
                        "seconds": float(slowest),
                        "sent_bytes": int(record.stages.get("sent_bytes", 0)),
                        "decision_window_s": float(window),
                    }
                )
        sink.close()
    with open(f"{out}.rank{rank}.json", "w") as f:
        json.dump({"rank": rank, "bytes": record.bytes, "rows": rows}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
