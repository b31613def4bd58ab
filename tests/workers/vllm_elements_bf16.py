"""Element syncs into a bfloat16 engine in this process, as full fine-tuning runs them: float32 master weights,
AdamW at a small learning rate, the served bfloat16 cast changing in a few elements per step.

Reports {"event": "step", ...} per element sync (what went, the engine's copy against the trainer's cast with
``torch.equal``, what it serves against a full sync of the same weights), and {"event": "fault", ...} for a failure
at every fault point of an element sync (the engine, and its copy, bit-identical afterwards).
"""

from __future__ import annotations

import sys


def main(path: str) -> None:
    import torch
    from helpers import report, vllm_engine, vllm_generate
    from transformers import LlamaForCausalLM

    from lora_stream import ParamStream, VLLMColocatedSink
    from lora_stream.engine.elements import ElementShadow
    from lora_stream.sinks.local_engine import local_model_runner
    from lora_stream.testing import FAULT_POINTS, set_fault_hook

    llm = vllm_engine(path, dtype="bfloat16")
    engine_model = local_model_runner(llm.llm_engine).model
    model = LlamaForCausalLM.from_pretrained(path, torch_dtype=torch.float32)  # float32 master weights
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    sink = VLLMColocatedSink(llm, elements=True)
    full = VLLMColocatedSink(llm, skip_unchanged=False)

    def step(seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, 1000, (1, 12), generator=g)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()

    def stream() -> ParamStream:
        return ParamStream(model, dtype=torch.bfloat16, group_by="layer")

    def copy_is_the_trainers() -> bool:
        shadow = ElementShadow.of(engine_model)
        return all(
            torch.equal(
                shadow.tensors[n].view(torch.int16), p.detach().to(torch.bfloat16).reshape(-1).view(torch.int16)
            )
            for n, p in model.named_parameters()
        )

    sink.sync(stream(), version="v0")
    for k in range(1, 4):
        step(k)
        record = sink.sync(stream(), version=f"v{k}")
        served = vllm_generate(llm)
        exact_copy = copy_is_the_trainers()
        full.sync(stream())
        same = vllm_generate(llm) == served
        sink.sync(stream(), version=f"v{k}-again")  # the full sink wrote the engine: everything once more
        report(
            event="step",
            k=k,
            full_because=record.full_because,
            elements=record.elements,
            fraction=record.element_fraction,
            kept=record.stages.get("kept_bytes"),
            copy_exact=exact_copy,
            same=same,
            line=record.summary(),
        )
    for point in [p for p in FAULT_POINTS if p not in ("group:<k>", "verify")] + ["group:0"]:
        step(10)
        sink.sync(stream(), version="before")  # after a failure: everything, then elements again
        step(11)
        sink.sync(stream(), version="base")
        before = vllm_generate(llm)
        copy = {n: t.clone() for n, t in ElementShadow.of(engine_model).tensors.items()}
        step(12)

        def hook(p: str, point: str = point) -> None:
            if p == point:
                raise RuntimeError(f"injected at {p}")

        set_fault_hook(hook)
        try:
            sink.sync(stream(), version="fails")
            raised = False
        except RuntimeError:
            raised = True
        finally:
            set_fault_hook(None)
        now = ElementShadow.of(engine_model).tensors
        copy_restored = copy.keys() == now.keys() and all(torch.equal(copy[n], now[n]) for n in copy)
        report(
            event="fault",
            point=point,
            raised=raised,
            equal=vllm_generate(llm) == before,
            copy_restored=copy_restored,
            version=sink.version,
        )
        # The next sync: whole after a failure that reached the engine; as elements after one refused in the
        # pre-flight (nothing reached the engine, so the trainer's baseline still is what it holds).
        report(event="next", point=point, full_because=sink.sync(stream(), version="next").full_because)
    record = sink.sync(stream(), version="after")
    report(event="after", full_because=record.full_because)


if __name__ == "__main__":
    main(sys.argv[1])
