"""An engine in a child process (VLLM_ENABLE_V1_MULTIPROCESSING=1): the sink reaches it through collective_rpc."""

from __future__ import annotations

import sys


def main(path: str) -> None:
    from helpers import assert_vllm_serves, lora, merged_copy, report, vllm_engine, vllm_generate
    from transformers import LlamaForCausalLM

    from lora_stream import ParamStream, VLLMColocatedSink
    from lora_stream.sinks import WORKER_EXTENSION

    llm = vllm_engine(path, worker_extension_cls=WORKER_EXTENSION)
    sink = VLLMColocatedSink(llm)
    assert not sink.in_process
    pm = lora(LlamaForCausalLM.from_pretrained(path), target_modules="all-linear", lora_alpha=16)
    record = sink.sync(ParamStream(pm, group_by="layer"))
    assert_vllm_serves(vllm_generate(llm), merged_copy(pm))
    report(event="child-engine-match", tensors=record.tensors, seconds=record.seconds)
    del llm, sink

    from lora_stream import LoraStreamError

    plain = vllm_engine(path)
    try:
        VLLMColocatedSink(plain).sync(ParamStream(pm, group_by="layer"))
    except LoraStreamError as exc:
        report(event="no-extension-error", message=str(exc))


if __name__ == "__main__":
    main(sys.argv[1])
