"""One side of the adapter benchmark's vLLM part (started by bench_adapter.py; not meant to be run by hand).

MODE merged: a vLLM engine without LoRA, synced with the merged model (VLLMColocatedSink + ParamStream).
MODE adapter: the same engine with enable_lora, synced with the adapter (VLLMLoRASink + AdapterStream).
Both in one process with a plain (unsharded) peft model; reports the median sync time, bytes sent, the process's
RSS growth over the syncs, and generation throughput (greedy, fixed prompts, tokens per second) through what was
synced. Writes one JSON file.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RssSampler, add_model_args, rss


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["merged", "adapter"])
    p.add_argument("checkpoint")
    p.add_argument("--syncs", type=int, default=5)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--out", required=True)
    add_model_args(p)
    args = p.parse_args()

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    from vllm import LLM, SamplingParams

    from lora_stream import AdapterStream, ParamStream, VLLMColocatedSink, VLLMLoRASink

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=torch.bfloat16)
    pm = get_peft_model(
        base, LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules="all-linear", init_lora_weights=False)
    )
    options = {"enable_lora": True, "max_lora_rank": args.rank, "max_loras": 1} if args.mode == "adapter" else {}
    llm = LLM(
        model=args.checkpoint,
        dtype="bfloat16",
        max_model_len=256,
        enforce_eager=True,
        skip_tokenizer_init=True,
        seed=0,
        **options,
    )
    sink = VLLMLoRASink(llm, lora_name="bench") if args.mode == "adapter" else VLLMColocatedSink(llm)

    def stream() -> ParamStream:
        return AdapterStream(pm) if args.mode == "adapter" else ParamStream(pm, group_by="layer")

    sink.sync(stream())  # warm-up: first-touch allocations in vLLM
    rss0 = rss()
    sampler = RssSampler()
    sampler.start()
    times, sent = [], 0
    for _ in range(args.syncs):
        t0 = time.perf_counter()
        record = sink.sync(stream())
        times.append(time.perf_counter() - t0)
        sent = record.bytes
    growth = sampler.stop() - rss0
    lora_request = getattr(sink, "lora_request", None)
    prompts = [{"prompt_token_ids": [(7 * i + 3 * j) % 1000 + 1 for j in range(16)]} for i in range(args.prompts)]
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    llm.generate(prompts[:1], params, use_tqdm=False, lora_request=lora_request)  # warm-up
    rates = []
    for _ in range(3):
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False, lora_request=lora_request)
        n = sum(len(o.outputs[0].token_ids) for o in outs)
        rates.append(n / (time.perf_counter() - t0))
    row = {
        "mode": args.mode,
        "median_sync_s": statistics.median(times),
        "sync_times_s": times,
        "bytes_sent": sent,
        "rss_growth_bytes": growth,
        "tokens_per_s": statistics.median(rates),
        "prompts": args.prompts,
        "tokens": args.tokens,
    }
    Path(args.out).write_text(json.dumps(row))


if __name__ == "__main__":
    main()
