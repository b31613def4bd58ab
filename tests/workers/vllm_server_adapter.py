"""Rank worker: adapter sync from a trainer into a vLLM server started with --enable-lora, over the gloo backend.

Usage: vllm_server_adapter.py SCENARIO BASE_URL CHECKPOINT
  steps    2 ZeRO-3 ranks; three optimizer steps, an adapter sync after each: /v1/completions with the adapter's
           name serves the merged trainer model every time, the base model name still serves the base, and the
           server lists the adapter once.
  refused  one process; v1 (r=4) synced, then an adapter above the server's max_lora_rank: the sync raises and the
           server keeps serving v1 under the adapter's name.
Every outcome is printed as one RESULT {json} line.
"""

from __future__ import annotations

import copy
import sys

import deepspeed
import requests
import torch
import torch.distributed as dist
from helpers import (
    ZERO3_CONFIG,
    assert_vllm_serves,
    finish,
    lora,
    merged_copy,
    report,
    server_generate,
    zero3_whole_into,
)

from lora_stream import AdapterStream, LoraStreamError, VLLMServerSink

deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
DS = ZERO3_CONFIG
IDS = torch.tensor([[1, 17, 42, 99, 5, 7, 300]])


def main() -> None:
    from transformers import AutoModelForCausalLM

    scenario, url, ckpt = sys.argv[1], sys.argv[2], sys.argv[3]
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    sink = VLLMServerSink(url, rank=rank, timeout=60, lora_name="policy")
    base_out = server_generate(url) if rank == 0 else None
    if scenario == "refused":
        ok = lora(AutoModelForCausalLM.from_pretrained(ckpt), target_modules="all-linear", r=4)
        sink.sync(AdapterStream(ok), version="v1")
        served = server_generate(url, model="policy")
        assert_vllm_serves(served, merged_copy(ok))
        big = lora(AutoModelForCausalLM.from_pretrained(ckpt), target_modules="all-linear", r=32, seed=5)
        try:
            sink.sync(AdapterStream(big), version="v2")
        except LoraStreamError as exc:
            assert server_generate(url, model="policy") == served, "the server must keep serving v1"
            assert server_generate(url) == base_out
            report(rank=rank, outcome="raised", error=type(exc).__name__, message=str(exc))
            finish(0)
        report(rank=rank, outcome="ok")
        finish(5)

    pm = lora(AutoModelForCausalLM.from_pretrained(ckpt), target_modules="all-linear", lora_alpha=16)
    template = copy.deepcopy(pm)
    opt = torch.optim.SGD([p for p in pm.parameters() if p.requires_grad], lr=0.5)
    engine, *_ = deepspeed.initialize(model=pm, optimizer=opt, config=DS)
    outputs = []
    for k in range(3):
        engine.backward(engine(input_ids=IDS, labels=IDS).loss)
        engine.step()
        record = sink.sync(AdapterStream(engine), version=f"v{k}")
        assert record.lora_name == "policy"
        expected = copy.deepcopy(zero3_whole_into(engine, template)).float().merge_and_unload()  # every rank
        if rank == 0:
            out = server_generate(url, model="policy")
            assert_vllm_serves(out, expected)
            outputs.append(out)
    if rank == 0:
        assert outputs[0] != outputs[1] != outputs[2], "every step should change what the adapter serves"
        assert server_generate(url) == base_out, "the base model name still serves the base weights"
        names = [m["id"] for m in requests.get(f"{url}/v1/models", timeout=10).json()["data"]]
        assert names.count("policy") == 1, names
    report(rank=rank, outcome="ok", tensors=record.tensors, bytes=record.bytes)
    finish()


if __name__ == "__main__":
    main()
