"""The engine-side merge into an engine in a child process (VLLMColocatedSink(merge="engine") over collective_rpc):
served `==` what a trainer-side merged sync of the same weights serves, only the trainable inputs after the first
sync, and a failed partial sync rolled back by recomputing (bit for bit). ``vllm_child_engine.py`` runs it on its
engine after its own syncs (one engine takes the merged, the partial and the engine-side merged syncs in turn);
run alone, it starts an engine of its own."""

from __future__ import annotations

import sys


def main(path: str) -> None:
    from helpers import vllm_engine

    from lora_stream.sinks import WORKER_EXTENSION

    merge_in_the_engine(vllm_engine(path, worker_extension_cls=WORKER_EXTENSION), path)


def merge_in_the_engine(llm: object, path: str) -> None:
    """The scenario, on ``llm`` (an engine in a child process, which another sink may have written before)."""
    from helpers import lora, perturb_adapters, report, vllm_generate
    from transformers import LlamaForCausalLM

    from lora_stream import ParamStream, VLLMColocatedSink
    from lora_stream.testing import set_fault_hook

    sink = VLLMColocatedSink(llm, merge="engine")
    trainer_side = VLLMColocatedSink(llm, skip_unchanged=False)
    pm = lora(LlamaForCausalLM.from_pretrained(path), target_modules="all-linear", lora_alpha=16, use_dora=True)
    perturb_adapters(pm)
    adapter_bytes = sum(p.numel() * p.element_size() for p in pm.parameters() if p.requires_grad)
    first = sink.sync(ParamStream(pm, group_by="layer"), version="v1")
    perturb_adapters(pm, seed=3)
    partial = sink.sync(ParamStream(pm, group_by="layer"), version="v2")
    engine_side = vllm_generate(llm)
    trainer_side.sync(ParamStream(pm, group_by="layer"), version="v2-trainer")
    report(
        event="child-merge-equal",
        equal=vllm_generate(llm) == engine_side,
        first_full_because=first.full_because,
        partial_full_because=partial.full_because,
        partial_bytes=partial.bytes,
        adapter_bytes=adapter_bytes,
    )
    sink.sync(ParamStream(pm, group_by="layer"), version="v3")  # another sink wrote: the base again
    before = vllm_generate(llm)
    perturb_adapters(pm, seed=5)
    set_fault_hook(lambda p: (_ for _ in ()).throw(RuntimeError("injected")) if p == "commit" else None)
    try:
        sink.sync(ParamStream(pm, group_by="layer"), version="v4")
        raised = False
    except RuntimeError:
        raised = True
    finally:
        set_fault_hook(None)
    report(event="child-merge-rollback", raised=raised, equal=vllm_generate(llm) == before, version=sink.version)
    again = sink.sync(ParamStream(pm, group_by="layer"), version="v5")
    report(event="child-merge-after", full_because=again.full_because)


if __name__ == "__main__":
    main(sys.argv[1])
