"""An engine in a child process (VLLM_ENABLE_V1_MULTIPROCESSING=1): the sink reaches it through collective_rpc. One
engine takes a merged sync, a rolled-back one, a partial one, then the engine-side merge's syncs
(``vllm_child_engine_merge.py``)."""

from __future__ import annotations

import sys


def main(path: str) -> None:
    from helpers import (
        assert_default_compiled_mode,
        assert_vllm_serves,
        lora,
        perturb_adapters,
        report,
        vllm_engine,
        vllm_generate,
    )
    from transformers import LlamaForCausalLM

    from lora_stream import ParamStream, VLLMColocatedSink
    from lora_stream.sinks import WORKER_EXTENSION
    from lora_stream.testing import set_fault_hook

    # vLLM's default compiled mode, as users run it: every sync below goes through the graph it compiled.
    llm = vllm_engine(path, worker_extension_cls=WORKER_EXTENSION, compiled=True)
    assert_default_compiled_mode(llm.llm_engine.vllm_config.compilation_config, "the child-process engine")
    sink = VLLMColocatedSink(llm, verify=True, skip_unchanged=True)
    assert not sink.in_process
    # A tied checkpoint: lm_head travels as the embedding's alias, its own copy (safetensors refuses shared memory).
    pm = lora(LlamaForCausalLM.from_pretrained(path), target_modules="all-linear", lora_alpha=16)
    perturb_adapters(pm)
    record = sink.sync(ParamStream(pm, group_by="layer"), version="v1")
    before = vllm_generate(llm)
    assert_vllm_serves(before, pm)  # tied: checked against the trainer's own forward
    report(event="child-engine-match", tensors=record.tensors, seconds=record.seconds)
    # A failure after the child loaded everything: the worker puts the previous weights back, bit for bit.
    perturb_adapters(pm, seed=7)
    set_fault_hook(lambda p: (_ for _ in ()).throw(RuntimeError("injected")) if p == "commit" else None)
    try:
        sink.sync(ParamStream(pm, group_by="layer"), version="v2")
    except RuntimeError:
        pass
    finally:
        set_fault_hook(None)
    report(event="child-engine-rollback", equal=vllm_generate(llm) == before, version=sink.version)
    # After the failed sync everything goes once; then only what changed, over collective_rpc too.
    full = sink.sync(ParamStream(pm, group_by="layer"), version="v3")
    perturb_adapters(pm, seed=9)
    partial = sink.sync(ParamStream(pm, group_by="layer"), version="v4")
    assert_vllm_serves(vllm_generate(llm), pm)
    report(
        event="child-engine-partial",
        full_because=full.full_because,
        skipped=partial.skipped_tensors,
        partial_full_because=partial.full_because,
        verified=partial.verification.passed,
    )
    # The same engine then takes the engine-side merge (a base sent by another sink of the same weights' model).
    from vllm_child_engine_merge import merge_in_the_engine

    merge_in_the_engine(llm, path)
    del llm, sink

    from lora_stream import LoraStreamError

    plain = vllm_engine(path)
    try:
        VLLMColocatedSink(plain).sync(ParamStream(pm, group_by="layer"))
    except LoraStreamError as exc:
        report(event="no-extension-error", message=str(exc))


if __name__ == "__main__":
    main(sys.argv[1])
