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
    elements_over_rpc(llm, path)
    del llm, sink

    from lora_stream import LoraStreamError

    plain = vllm_engine(path)
    try:
        VLLMColocatedSink(plain).sync(ParamStream(pm, group_by="layer"))
    except LoraStreamError as exc:
        report(event="no-extension-error", message=str(exc))


def elements_over_rpc(llm, path: str) -> None:  # type: ignore[no-untyped-def]
    """Full fine-tuning synced with ``elements=True`` into the child engine (tied: lm_head travels as the embedding's
    alias, rebuilt with it), verified; a failure after the child rebuilt and loaded the elements is rolled back; what
    it serves equals a full sync of the same weights."""
    import torch
    from helpers import report, vllm_generate
    from transformers import LlamaForCausalLM

    from lora_stream import ParamStream, VLLMColocatedSink
    from lora_stream.testing import set_fault_hook

    model = LlamaForCausalLM.from_pretrained(path)
    sink = VLLMColocatedSink(llm, elements=True, verify=True)
    full = VLLMColocatedSink(llm, skip_unchanged=False)

    def edit(seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                flat = p.data.view(-1)
                a, b = (int(i) for i in torch.randperm(flat.numel(), generator=g)[:2])
                flat[a].neg_()
                flat[b].mul_(2.0)

    sink.sync(ParamStream(model, group_by="layer"), version="e1")
    edit(1)
    record = sink.sync(ParamStream(model, group_by="layer"), version="e2")
    served = vllm_generate(llm)
    edit(2)
    set_fault_hook(lambda p: (_ for _ in ()).throw(RuntimeError("injected")) if p == "commit" else None)
    try:
        sink.sync(ParamStream(model, group_by="layer"), version="e3")
        raised = False
    except RuntimeError:
        raised = True
    finally:
        set_fault_hook(None)
    rolled_back = vllm_generate(llm) == served
    edit(3)
    sink.sync(ParamStream(model, group_by="layer"), version="e4")  # after the failure: everything
    edit(4)
    again = sink.sync(ParamStream(model, group_by="layer"), version="e5")
    mine = vllm_generate(llm)
    full.sync(ParamStream(model, group_by="layer"))
    report(
        event="child-elements",
        elements=record.elements,
        full_because=record.full_because,
        verified=record.verified,
        raised=raised,
        rolled_back=rolled_back,
        again=again.elements,
        same=vllm_generate(llm) == mine,
    )


if __name__ == "__main__":
    main(sys.argv[1])
