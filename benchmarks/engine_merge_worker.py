"""One rank of bench_engine_merge.py (not meant to be run by hand): a ZeRO-3 trainer with LoRA r=16 on every linear
layer keeps three vLLM servers in sync after every training step, each its own way, interleaved round by round:
the trainer-side merged sync, the engine-side merge (``merge="engine"``), and the adapter sync (vLLM's LoRA
serving). Rank 0 then measures each server's generation throughput.

Usage: engine_merge_worker.py URLS PIDS CHECKPOINT ROUNDS OUT   (URLS, PIDS: three, comma-separated)
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
from common import tree_rss

deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
DS = {
    "train_micro_batch_size_per_gpu": 1,
    "zero_allow_untested_optimizer": True,
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
}
MODES = ("trainer", "engine", "adapter")
LORA_NAME = "policy"


def throughput(url: str, model: str, batch: int, tokens: int) -> float:
    """Generated tokens per second for one batch of ``batch`` prompts, ``tokens`` each (greedy, no early stop)."""
    import requests

    prompts = [[1 + i, 17, 42, 99, 5 + i, 7, 30] for i in range(batch)]
    body = {"model": model, "prompt": prompts, "max_tokens": tokens, "temperature": 0, "ignore_eos": True}
    t = time.perf_counter()
    r = requests.post(f"{url}/v1/completions", json=body, timeout=600)
    r.raise_for_status()
    seconds = time.perf_counter() - t
    n = int(r.json()["usage"]["completion_tokens"])
    return n / seconds


def main() -> None:
    import psutil
    import requests
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from lora_stream import AdapterStream, ParamStream, VLLMServerSink

    urls, pids, ckpt, rounds, out = sys.argv[1].split(","), sys.argv[2].split(","), *sys.argv[3:6]
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    cfg = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", init_lora_weights=False)
    pm = get_peft_model(model, cfg)
    opt = torch.optim.SGD([p for p in pm.parameters() if p.requires_grad], lr=1e-3)
    engine, *_ = deepspeed.initialize(model=pm, optimizer=opt, config=DS)
    sinks = {
        "trainer": VLLMServerSink(urls[0], rank=rank, timeout=600),
        "engine": VLLMServerSink(urls[1], rank=rank, timeout=600, merge="engine"),
        "adapter": VLLMServerSink(urls[2], rank=rank, timeout=600, lora_name=LORA_NAME),
    }
    streams = {
        "trainer": ParamStream(engine, group_by="layer"),
        "engine": ParamStream(engine, group_by="layer"),
        "adapter": AdapterStream(engine),
    }
    ids = torch.tensor([[1, 17, 42, 99, 5, 7, 30]])

    def step() -> None:
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()

    def sync(mode: str, i: int) -> dict[str, object]:
        t = time.perf_counter()
        r = sinks[mode].sync(streams[mode], version=f"{mode}-{i}")
        seconds = time.perf_counter() - t
        worker = dict(r.stages.get("worker") or {})
        return {
            "mode": mode,
            "round": i,
            "seconds": seconds,
            "tensors": r.tensors,
            "stream_bytes": r.bytes,
            "sent_bytes": r.stages.get("sent_bytes", 0) if rank == 0 else 0,
            "gathered_bytes": r.gathered_bytes,
            "produce_s": r.stages.get("produce_s", 0.0),
            "send_wait_s": r.stages.get("send_wait_s", 0.0),
            "fingerprint_s": r.stages.get("fingerprint_s", 0.0),
            "server_merge_s": worker.get("merge_s", 0.0),
            "server_load_s": worker.get("load_s", 0.0) + worker.get("finish_s", 0.0),
            "server_kept_bytes": worker.get("kept_bytes", 0.0),
            "server_base_bytes": worker.get("base_bytes", 0.0),
            "full_because": r.full_because,
        }

    for mode in MODES:
        sync(mode, -1)  # transfer groups, and the engine-side merge's base
    rows = []
    for i in range(int(rounds)):
        step()
        for mode in MODES:
            rows.append(sync(mode, i))
    result: dict[str, object] = {"rank": rank, "rows": rows}
    if rank == 0:
        served = {
            "trainer": (urls[0], requests.get(f"{urls[0]}/v1/models", timeout=10).json()["data"][0]["id"]),
            "engine": (urls[1], requests.get(f"{urls[1]}/v1/models", timeout=10).json()["data"][0]["id"]),
            "adapter": (urls[2], LORA_NAME),
        }
        for url, model_name in served.values():
            throughput(url, model_name, 2, 4)  # warm-up
        tps: dict[str, list[float]] = {m: [] for m in MODES}
        for _ in range(3):
            for mode in MODES:
                tps[mode].append(throughput(*served[mode], batch=8, tokens=32))
        result["tokens_per_s"] = tps
        result["server_rss"] = {m: tree_rss(psutil.Process(int(pid))) for m, pid in zip(MODES, pids)}
    with open(f"{out}.rank{rank}.json", "w") as f:
        json.dump(result, f)
    dist.barrier()


if __name__ == "__main__":
    main()
