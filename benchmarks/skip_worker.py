"""One rank of bench_skip.py (not meant to be run by hand): a ZeRO-3 trainer syncing into a vLLM server, a full
sync (the sink told to forget what the server holds) and a skipping one after every training step, interleaved.

Usage: skip_worker.py URL SERVER_PID CHECKPOINT TARGETS ROUNDS OUT
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import tree_rss_growth

deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
DS = {
    "train_micro_batch_size_per_gpu": 1,
    "zero_allow_untested_optimizer": True,
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
}
TARGETS = {"all": "all-linear", "attn": ["q_proj", "k_proj", "v_proj", "o_proj"]}


def main() -> None:
    import psutil
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from lora_stream import ParamStream, VLLMServerSink

    url, pid, ckpt, targets, rounds, out = sys.argv[1:7]
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    cfg = LoraConfig(r=16, lora_alpha=32, target_modules=TARGETS[targets], init_lora_weights=False)
    pm = get_peft_model(model, cfg)
    opt = torch.optim.SGD([p for p in pm.parameters() if p.requires_grad], lr=1e-3)
    engine, *_ = deepspeed.initialize(model=pm, optimizer=opt, config=DS)
    sink = VLLMServerSink(url, rank=rank, timeout=600)
    stream = ParamStream(engine, group_by="layer")  # planned once, as the TRL hook does
    ids = torch.tensor([[1, 17, 42, 99, 5, 7, 30]])

    def step() -> None:
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()

    def sync(kind: str, i: int) -> dict[str, object]:
        if kind == "full":
            sink.forget()
        stop_rss = tree_rss_growth(psutil.Process(int(pid))) if rank == 0 else None
        t = time.perf_counter()
        r = sink.sync(stream, version=f"{kind}-{i}")
        seconds = time.perf_counter() - t
        worker = r.stages.get("worker", {})
        return {
            "kind": kind,
            "seconds": seconds,
            "tensors": r.tensors,
            "sent_bytes": r.stages.get("sent_bytes", 0) if rank == 0 else 0,
            "stream_bytes": r.bytes,
            "skipped_tensors": r.skipped_tensors,
            "skipped_bytes": r.skipped_bytes,
            "gathered_bytes": r.gathered_bytes,
            "fingerprint_s": r.stages.get("fingerprint_s", 0.0),
            "decide_s": r.stages.get("decide_s", 0.0),
            "snapshot_bytes": worker.get("kept_bytes", 0.0),
            "server_load_s": worker.get("load_s", 0.0) + worker.get("finish_s", 0.0),
            "server_rss_growth": stop_rss() if stop_rss is not None else 0,
            "full_because": r.full_because,
        }

    sync("full", -1)  # the transfer group's setup, and the first record
    rows = []
    for i in range(int(rounds)):
        step()
        rows.append(sync("full", i))
        step()
        rows.append(sync("skip", i))
    # What the fingerprints read on this rank: its share of the outputs with no trainable source (the others are
    # sent at every sync, so their frozen bases are not read).
    fp_bytes = sum(b for b, fp in zip(stream.step_bytes(), stream.fingerprints(), strict=True) if fp is not None)
    fp_bytes //= dist.get_world_size()
    with open(f"{out}.rank{rank}.json", "w") as f:
        json.dump({"rank": rank, "rows": rows, "fingerprinted_local_bytes": fp_bytes}, f)
    dist.barrier()


if __name__ == "__main__":
    main()
