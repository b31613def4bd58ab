"""Adapter sync into an engine in a child process (VLLM_ENABLE_V1_MULTIPROCESSING=1) through the worker extension."""

from __future__ import annotations

import sys


def main(path: str) -> None:
    import torch
    from helpers import assert_vllm_serves, lora, merged_copy, report, vllm_engine, vllm_generate
    from transformers import LlamaForCausalLM

    from lora_stream import AdapterStream, VLLMLoRASink
    from lora_stream.sinks import WORKER_EXTENSION

    llm = vllm_engine(path, worker_extension_cls=WORKER_EXTENSION, enable_lora=True, max_lora_rank=16, max_loras=1)
    sink = VLLMLoRASink(llm, lora_name="policy")
    assert not sink.in_process
    pm = lora(LlamaForCausalLM.from_pretrained(path), target_modules="all-linear", lora_alpha=16)
    opt = torch.optim.SGD([p for p in pm.parameters() if p.requires_grad], lr=0.5)
    ids = torch.tensor([[1, 17, 42, 99, 5, 7, 300]])
    served = []
    for k in range(3):
        pm(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        record = sink.sync(AdapterStream(pm), version=str(k))
        out = vllm_generate(llm, record.lora_request)
        assert_vllm_serves(out, merged_copy(pm))
        served.append(out)
    assert served[0] != served[1] != served[2]
    report(event="child-adapter-match", tensors=record.tensors, bytes=record.bytes)


if __name__ == "__main__":
    main(sys.argv[1])
