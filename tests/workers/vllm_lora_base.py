"""A changed base pushed once into an engine with enable_lora, then an adapter sync on top of it.

Usage: vllm_lora_base.py CHECKPOINT_DIR   (the engine in this process: VLLM_ENABLE_V1_MULTIPROCESSING=0)
"""

from __future__ import annotations

import copy
import sys


def main(path: str) -> None:
    import torch
    from helpers import assert_vllm_serves, lora, merged_copy, report, vllm_engine, vllm_generate
    from transformers import LlamaForCausalLM

    from lora_stream import AdapterStream, ParamStream, VLLMColocatedSink, VLLMLoRASink

    llm = vllm_engine(path, enable_lora=True, max_lora_rank=16, max_loras=1)
    base = LlamaForCausalLM.from_pretrained(path)
    with torch.no_grad():
        for p in base.parameters():
            p.mul_(1.1)
    pm = lora(base, target_modules="all-linear", r=8)
    with pm.disable_adapter():
        record = VLLMColocatedSink(llm).sync(ParamStream(pm, group_by="layer"))
        assert_vllm_serves(vllm_generate(llm), copy.deepcopy(pm).unload())  # the changed base, without the adapter
    synced = VLLMLoRASink(llm, lora_name="over-new-base").sync(AdapterStream(pm))
    assert_vllm_serves(vllm_generate(llm, synced.lora_request), merged_copy(pm))
    report(event="base-then-adapter", base_tensors=record.tensors)


if __name__ == "__main__":
    main(sys.argv[1])
