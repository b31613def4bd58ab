"""Element syncs into a bfloat16 engine in this process, as full fine-tuning runs them: float32 master weights,
AdamW at a small learning rate, the served bfloat16 cast changing in a few elements per step.

Reports {"event": "step", ...} per element sync (what went, the engine's copy against the trainer's cast with
``torch.equal``, what it serves against a full sync of the same weights, how many tensors were written where they
are served, which the engine serves in their own layout, and the host copy's bytes), and {"event": "fault", ...}
for a failure at every fault point of an element sync (the engine, and its copy, bit-identical afterwards),
{"event": "moved", ...} for syncs of one changed norm element (the commit's record moved by the write, not read, and
equal to a read), and {"event": "foreign", ...} for the sync after a write that bypassed every loader into a tensor
served in its layout.

Usage: vllm_elements_bf16.py CHECKPOINT [default|torch-linear]. ``torch-linear``: vLLM's own fallback for linear
layers, the path it takes where oneDNN and sgl-kernel are unavailable (selected in this process before the engine
is built): every weight is then served as loaded, as on CUDA, so the element syncs write every one in place.
"""

from __future__ import annotations

import sys


def main(path: str, mode: str = "default") -> None:
    import torch
    from helpers import report, vllm_engine, vllm_generate
    from transformers import LlamaForCausalLM

    from lora_stream import ParamStream, VLLMColocatedSink
    from lora_stream.engine.elements import ElementShadow
    from lora_stream.engine.state_digest import first_difference
    from lora_stream.sinks.local_engine import local_model_runner
    from lora_stream.testing import FAULT_POINTS, set_fault_hook

    if mode == "torch-linear":
        import vllm._custom_ops as ops
        import vllm.model_executor.layers.utils as layer_utils

        ops._supports_onednn = False
        layer_utils.check_cpu_sgl_kernel = lambda *args: False
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
        with torch.no_grad():  # a norm moves too, as larger steps would move it (AdamW's 1e-4 is below bf16's step)
            model.model.norm.weight[:4] += 0.05

    def stream() -> ParamStream:
        return ParamStream(model, dtype=torch.bfloat16, group_by="layer")

    def copy_is_the_trainers() -> bool:
        shadow = ElementShadow.of(engine_model)
        return all(
            torch.equal(
                shadow.held(n).view(torch.int16),  # type: ignore[union-attr]
                p.detach().to(torch.bfloat16).reshape(-1).view(torch.int16),
            )
            for n, p in model.named_parameters()
        )

    def copy() -> dict[str, torch.Tensor]:
        shadow = ElementShadow.of(engine_model)
        return {n: shadow.held(n).clone() for n in [*shadow.tensors, *shadow.placements]}  # type: ignore[union-attr]

    sink.sync(stream(), version="v0")
    for k in range(1, 4):
        step(k)
        record = sink.sync(stream(), version=f"v{k}")
        shadow = ElementShadow.of(engine_model)
        in_place, host_bytes, placed = shadow.stats.get("in_place"), shadow.host_bytes, sorted(shadow.placements)
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
            in_place=in_place,
            host_bytes=host_bytes,
            placed=placed,
            line=record.summary(),
        )
    for point in [p for p in FAULT_POINTS if p not in ("group:<k>", "verify")] + ["group:0"]:
        step(10)
        sink.sync(stream(), version="before")  # after a failure: everything, then elements again
        step(11)
        sink.sync(stream(), version="base")
        before = vllm_generate(llm)
        held_before = copy()
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
        now = copy()
        copy_restored = held_before.keys() == now.keys() and all(torch.equal(held_before[n], now[n]) for n in now)
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
    # One element of the final norm changed (1 of 64): the commit records that module by moving its last record by
    # the write, reading nothing; the record then equals a read of the engine, and the next sync is elements again.
    for k in range(2):
        with torch.no_grad():
            model.model.norm.weight[10 + k] += 0.25
        record = sink.sync(stream(), version=f"moved-{k}")
        report(
            event="moved",
            k=k,
            full_because=record.full_because,
            moved=ElementShadow.of(engine_model).stats.get("moved"),
            record_exact=first_difference(engine_model) is None,
        )
    # A writer that bypasses every loader, into a tensor the engine serves in its own layout (a fused projection
    # on the torch-linear path, a norm on the default one), between two element syncs: the next sync must not
    # trust the engine's copy (that tensor is the copy), and must leave it serving exactly the trainer's weights.
    layer = engine_model.model.layers[0]
    written = layer.self_attn.qkv_proj.weight if mode == "torch-linear" else layer.input_layernorm.weight
    with torch.no_grad():
        written.view(-1)[:3] += 0.5
    step(20)
    record = sink.sync(stream(), version="foreign")
    served = vllm_generate(llm)
    exact_copy = copy_is_the_trainers()
    full.sync(stream())
    report(
        event="foreign",
        full_because=record.full_because,
        in_place=ElementShadow.of(engine_model).stats.get("in_place"),
        copy_exact=exact_copy,
        same=vllm_generate(llm) == served,
    )


if __name__ == "__main__":
    main(*sys.argv[1:])
