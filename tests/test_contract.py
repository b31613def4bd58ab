"""ParamStream's contract, point by point, against peft's own merge_and_unload() in float32."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
from helpers import (
    assert_bitwise_equal,
    assert_matches,
    lora,
    merged_flags,
    oracle,
    perturb_adapters,
    rel_err,
    require,
    snapshot,
    tiny_gpt2,
    tiny_llama,
)
from torch import nn

from lora_stream import ParamStream, UnsupportedAdapterError, UnsupportedModelError, stream_merged_params
from lora_stream.errors import NameCollisionError, RenameError

LLAMA_CASES = {
    "all-linear": dict(target_modules="all-linear"),
    "rslora+embedding": dict(target_modules=["q_proj", "v_proj", "embed_tokens"], use_rslora=True),
    "dora": dict(target_modules=["q_proj", "down_proj", "up_proj"], use_dora=True),
    "dora-embedding": dict(target_modules=["embed_tokens", "k_proj"], use_dora=True),
    "patterns": dict(
        target_modules=["q_proj", "o_proj", "gate_proj"],
        rank_pattern={"o_proj": 2},
        alpha_pattern={"q_proj": 3, "gate_proj": 32},
    ),
    "modules_to_save": dict(target_modules=["q_proj"], modules_to_save=["lm_head", "embed_tokens"]),
    "lora_bias": dict(target_modules=["q_proj"], lora_bias=True),
}


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("case", list(LLAMA_CASES))
def test_llama_stream_equals_peft_merge(case: str, tie: bool) -> None:
    kw = dict(LLAMA_CASES[case])
    model = tiny_llama(tie=tie)
    if case == "lora_bias":  # lora_bias needs a base bias
        model = tiny_llama(tie=tie, bias=True)
    pm = lora(model, **kw)
    if tie and "embed_tokens" in kw.get("target_modules", ()):
        with pytest.raises(UnsupportedAdapterError, match="the trainer's"):  # see the tied-embedding test below
            ParamStream(pm)
        return
    assert_matches(stream_merged_params(pm), oracle(pm))


@pytest.mark.parametrize("use_dora", [False, True])
def test_gpt2_conv1d_fan_in_fan_out(use_dora: bool) -> None:
    pm = lora(tiny_gpt2(), target_modules=["c_attn", "c_proj", "c_fc"], fan_in_fan_out=True, use_dora=use_dora)
    assert_matches(stream_merged_params(pm), oracle(pm))


def test_adapter_name_is_read_from_the_model() -> None:
    pm = lora(tiny_llama(tie=True), adapter_name="policy", target_modules=["q_proj"], modules_to_save=["lm_head"])
    got = list(stream_merged_params(pm))
    assert_matches(got, oracle(pm))
    assert not any("policy" in n or "default" in n for n, _ in got)


def test_several_adapters_merge_the_active_ones_like_peft() -> None:
    from peft import LoraConfig

    pm = lora(tiny_llama(), target_modules=["q_proj", "v_proj"], adapter_name="a")
    torch.manual_seed(1)
    pm.add_adapter("b", LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "o_proj"], init_lora_weights=False))
    # Only "a" is active.
    assert_matches(stream_merged_params(pm), oracle(pm))
    pm.set_adapter("b")
    assert_matches(stream_merged_params(pm), oracle(pm))
    # Both active: peft merges both.
    pm.base_model.set_adapter(["a", "b"])
    assert_matches(stream_merged_params(pm), oracle(pm))


def test_several_dora_adapters_merge_in_turn_like_peft() -> None:
    from peft import LoraConfig

    pm = lora(tiny_llama(), target_modules=["q_proj"], adapter_name="a", use_dora=True)
    torch.manual_seed(1)
    pm.add_adapter("b", LoraConfig(r=2, target_modules=["q_proj"], use_dora=True, init_lora_weights=False))
    pm.base_model.set_adapter(["a", "b"])
    assert_matches(stream_merged_params(pm), oracle(pm))


def test_disabled_adapters_yield_the_base_weights() -> None:
    base = tiny_llama(tie=True)
    expected = {n: p.detach().clone() for n, p in base.named_parameters()}
    pm = lora(base, target_modules=["q_proj", "embed_tokens"], modules_to_save=["lm_head"])
    with pm.disable_adapter():
        got = list(stream_merged_params(pm))
    assert_matches(got, expected, tol=0.0 + 1e-12)


@pytest.mark.parametrize("kind", ["loha", "lokr"])
def test_other_additive_tuners(kind: str) -> None:
    from peft import LoHaConfig, LoKrConfig, get_peft_model

    cfg = (LoHaConfig if kind == "loha" else LoKrConfig)(r=4, target_modules=["q_proj", "v_proj"], init_weights=False)
    torch.manual_seed(0)
    pm = get_peft_model(tiny_llama(), cfg)
    assert_matches(stream_merged_params(pm), oracle(pm))


def test_unsupported_tuner_raises_before_anything_is_produced() -> None:
    from peft import IA3Config, get_peft_model

    pm = get_peft_model(
        tiny_llama(), IA3Config(target_modules=["q_proj", "down_proj"], feedforward_modules=["down_proj"])
    )
    before = snapshot(pm)
    with pytest.raises(UnsupportedAdapterError, match=r"layers\.0\.self_attn\.q_proj.*IA3|ia3"):
        ParamStream(pm)
    assert_bitwise_equal(pm, before)


def test_prompt_learning_is_unsupported() -> None:
    from peft import PromptTuningConfig, get_peft_model

    pm = get_peft_model(tiny_llama(), PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4))
    with pytest.raises(UnsupportedAdapterError, match="prompt"):
        ParamStream(pm)


def test_bitsandbytes_quantized_base_is_refused_before_anything_is_produced() -> None:
    bnb = require("bitsandbytes")

    class Quantized(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = bnb.nn.Linear8bitLt(64, 64, has_fp16_weights=False)
            self.head = nn.Linear(64, 8)

    model = Quantized()
    model.proj.load_state_dict(nn.Linear(64, 64).state_dict())
    pm = lora(model, target_modules=["proj"])
    assert type(pm.base_model.model.proj.base_layer.weight).__module__.startswith("bitsandbytes")
    with pytest.raises(UnsupportedModelError, match=r"'base_model\.model\.proj'.*quantized base weight"):
        ParamStream(pm)


def test_in_place_merged_model_is_refused() -> None:
    pm = lora(tiny_llama(), target_modules=["q_proj"])
    pm.merge_adapter()
    with pytest.raises(UnsupportedModelError, match="unmerge_adapter"):
        ParamStream(pm)


# -- point 4: no writes, no drift ---------------------------------------------------------------------------------
def test_hundred_bf16_streams_leave_the_model_bitwise_identical() -> None:
    pm = lora(
        tiny_llama(tie=True, dtype=torch.bfloat16),
        target_modules="all-linear",
        use_dora=False,
        modules_to_save=["lm_head"],
    )
    pm.base_model.model.model.layers[0].self_attn.q_proj.lora_A["default"].to(torch.float32)
    before, flags = snapshot(pm), merged_flags(pm)
    first = None
    for _ in range(100):
        out = {n: t.clone() for n, t in stream_merged_params(pm)}
        first = first or out
        assert all(torch.equal(out[n], first[n]) for n in out)
    assert_bitwise_equal(pm, before)
    assert merged_flags(pm) == flags


def test_bf16_output_is_the_float32_merge_rounded_once() -> None:
    pm = lora(tiny_llama(dtype=torch.bfloat16), target_modules="all-linear")
    # peft keeps LoRA factors in float32 over a bf16 base by default (autocast_adapter_dtype)
    assert pm.base_model.model.model.layers[0].self_attn.q_proj.lora_A["default"].weight.dtype == torch.float32
    ref = oracle(pm)
    for name, t in stream_merged_params(pm):
        assert t.dtype == torch.bfloat16
        rounded = ref[name].to(torch.bfloat16)
        # one rounding of the float32 merge: at most one bf16 ulp away, almost always exact
        assert (t.float() - rounded.float()).abs().le(rounded.float().abs() * 2**-7 + 1e-30).all(), name
        assert (t == rounded).float().mean() > 0.99, name


def test_dtype_argument_casts_every_tensor() -> None:
    pm = lora(tiny_llama(), target_modules=["q_proj"])
    ref = oracle(pm)
    got = list(stream_merged_params(pm, dtype=torch.bfloat16))
    assert all(t.dtype == torch.bfloat16 for _, t in got)
    assert_matches(got, ref, tol=4e-3)


# -- points 3, 5, 6, 8 -----------------------------------------------------------------------------------------------
def test_tied_weights_come_once_and_persistent_buffers_as_the_checkpoint_holds_them() -> None:
    model = tiny_llama(tie=True)
    model.register_buffer("extra_buffer", torch.arange(3.0))
    model.register_buffer("scratch_buffer", torch.ones(3), persistent=False)
    names = [n for n, _ in stream_merged_params(model)]
    # Checkpoint layout: state_dict()'s keys, the tied lm_head once (save_pretrained drops it too).
    assert names == [n for n in model.state_dict() if n != "lm_head.weight"]
    assert "extra_buffer" in names and "scratch_buffer" not in names
    got = dict(stream_merged_params(model))
    assert torch.equal(got["extra_buffer"], model.extra_buffer)
    # Memory layout: named_parameters(), buffers never.
    names = [n for n, _ in stream_merged_params(model, layout="memory")]
    assert names == [n for n, _ in model.named_parameters()]
    assert "lm_head.weight" not in names and "extra_buffer" not in names


def test_lora_on_a_tied_embedding_is_refused_because_the_trainers_lm_head_keeps_the_base_weight() -> None:
    """peft applies an embedding LoRA to the lookup only: the policy's lm_head is the base weight, so serving the
    merged embedding as the tied lm_head (what merge_and_unload() does) is not the policy."""
    pm = lora(tiny_llama(tie=True), target_modules=["embed_tokens", "q_proj"])
    perturb_adapters(pm)
    ids = torch.tensor([[1, 17, 42, 5]])
    with torch.no_grad():
        policy = pm(input_ids=ids).logits
        merged = copy.deepcopy(pm).merge_and_unload()(input_ids=ids).logits
    assert (policy - merged).abs().max() > 1e-3  # merge_and_unload() is not the oracle here
    with pytest.raises(UnsupportedAdapterError, match=r"tied to .*embed_tokens.*the trainer's"):
        ParamStream(pm)
    tied_adapters = lora(tiny_llama(tie=True), target_modules=["embed_tokens"], ensure_weight_tying=True)
    with pytest.raises(UnsupportedAdapterError, match="ensure_weight_tying"):
        ParamStream(tied_adapters)


def test_lora_on_a_tied_model_without_the_embedding_serves_the_trainers_forward() -> None:
    from transformers import LlamaForCausalLM

    pm = lora(tiny_llama(tie=True), target_modules=["q_proj", "v_proj"])
    perturb_adapters(pm)
    stream = ParamStream(pm)
    assert stream.tied_aliases() == {"lm_head.weight": "model.embed_tokens.weight"}
    served = LlamaForCausalLM(pm.get_base_model().config)
    served.load_state_dict({**dict(stream), "lm_head.weight": dict(stream)["model.embed_tokens.weight"]})
    ids = torch.tensor([[1, 17, 42, 5]])
    with torch.no_grad():
        assert torch.allclose(served(input_ids=ids).logits, pm(input_ids=ids).logits, atol=1e-5)


def test_pass_through_parameters_are_not_copied() -> None:
    pm = lora(tiny_llama(), target_modules=["q_proj"])
    storages = {p.data_ptr() for p in pm.parameters()}
    stream = ParamStream(pm)
    for name, t in stream:
        assert (t.data_ptr() in storages) == ("q_proj" not in name), name
    assert stream.last_stats.computed == 2  # the two merged q_proj weights


def test_metadata_agrees_with_iteration_and_groups() -> None:
    pm = lora(tiny_llama(tie=True), target_modules="all-linear", use_dora=True, modules_to_save=["lm_head"])
    for kw in (
        {},
        {"dtype": torch.bfloat16},
        {"group_by": "budget"},
        {"group_by": "module"},
        {"group_by": "budget", "budget_bytes": 20_000},
    ):
        stream = ParamStream(pm, **kw)
        meta = stream.metadata()
        got = list(stream)
        assert [(m.name, m.dtype, m.shape) for m in meta] == [(n, t.dtype, tuple(t.shape)) for n, t in got]
        assert [n for g in stream.groups() for n in g] == [m.name for m in meta]
        batches = list(stream.iter_groups())
        assert [names for names, _ in batches] == stream.groups()
        for names, tensors in batches:
            for n, t in zip(names, tensors):
                assert torch.equal(t, dict(got)[n])


def test_metadata_materializes_nothing() -> None:
    pm = lora(tiny_llama(), target_modules=["q_proj"])
    stream = ParamStream(pm)
    calls = []

    class Spy(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            calls.append(func)
            return func(*args, **(kwargs or {}))

    with Spy():
        stream.metadata()
        stream.groups()
    assert calls == []


def test_order_is_registration_order_and_layer_groups_are_whole_layers() -> None:
    pm = lora(tiny_llama(layers=3), target_modules="all-linear")
    stream = ParamStream(pm, group_by="layer")
    names = [m.name for m in stream.metadata()]
    assert names == list(oracle(pm))
    groups = stream.groups()
    assert groups[0] == ["model.embed_tokens.weight"]
    for i in range(3):
        assert all(n.startswith(f"model.layers.{i}.") for n in groups[i + 1])
        assert len(groups[i + 1]) == 9
    assert groups[-1] == ["model.norm.weight", "lm_head.weight"]
    assert ParamStream(pm).groups() == groups, "group_by='layer' is the default"
    assert ParamStream(pm).group_by == "layer"


def test_budget_groups_respect_the_budget_unless_one_module_is_larger() -> None:
    pm = lora(tiny_llama(), target_modules="all-linear")
    budget = 40_000
    stream = ParamStream(pm, group_by="budget", budget_bytes=budget)
    sizes = stream.group_gathered_bytes
    groups = stream.groups()
    assert len(groups) > 4
    for size, names in zip(sizes, groups):
        assert size <= budget or len(names) <= 2, (
            size,
            names,
        )  # a single module (weight [+ bias]) may exceed
    assert ParamStream(pm, group_by="module").groups()[1] == ["model.layers.0.self_attn.q_proj.weight"]


# -- point 7: early stop --------------------------------------------------------------------------------------------
def test_break_exception_and_close_leave_the_model_untouched_and_release_the_pass() -> None:
    pm = lora(tiny_llama(), target_modules="all-linear", use_dora=True)
    before, flags = snapshot(pm), merged_flags(pm)
    stream = ParamStream(pm, group_by="module")

    it = iter(stream)
    ref = weakref.ref(it)
    for i, _ in enumerate(it):
        if i == 3:
            break
    assert it.active  # still suspended until closed or collected
    del it
    gc.collect()
    assert ref() is None
    assert not stream.last_stats.complete

    with pytest.raises(ValueError, match="consumer"):
        for i, _item in enumerate(stream):
            if i == 5:
                raise ValueError("consumer failed")

    it = iter(stream)
    next(it)
    stream.close()
    assert not it.active  # closed: its locals (gathered group, merged tensor) are released
    with pytest.raises(StopIteration):
        next(it)

    with ParamStream(pm) as s2:
        next(iter(s2))
    assert_bitwise_equal(pm, before)
    assert merged_flags(pm) == flags
    # A full pass afterwards still matches the oracle.
    assert_matches(stream, oracle(pm))


# -- point 1: names ---------------------------------------------------------------------------------------------------
class UserBlock(nn.Module):
    """A user's own module whose child names look like wrapper attributes."""

    def __init__(self) -> None:
        super().__init__()
        self.module = nn.Linear(8, 8)
        # (A child called `base_layer` would be handled here too, but peft's own merge_and_unload, the oracle,
        # then mistakes this block for a tuner layer and fails.)
        self.model = nn.Linear(8, 8)
        self.original_module = nn.Linear(8, 8)
        self._orig_mod = nn.Linear(8, 8)


class UserModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([UserBlock() for _ in range(2)])
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b.module(x) + b.model(x) + b.original_module(x) + b._orig_mod(x)
        return self.head(x)


def test_user_names_that_look_like_wrappers_survive() -> None:
    torch.manual_seed(0)
    model = UserModel()
    pm = lora(model, target_modules=["module", "model"], modules_to_save=["head"])
    got = list(stream_merged_params(pm))
    assert_matches(got, oracle(pm))
    assert "blocks.0.module.weight" in dict(got) and "blocks.1.model.bias" in dict(got)


def test_wrappers_are_stripped_by_structure() -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    base = tiny_llama()
    pm = lora(base, target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"])
    ref = oracle(pm)
    layers = pm.base_model.model.model.layers
    for i in range(len(layers)):
        layers[i] = checkpoint_wrapper(layers[i])
    compiled = torch.compile(pm)  # an OptimizedModule; nothing is compiled until it is called
    assert any("_checkpoint_wrapped_module" in n for n, _ in compiled.named_parameters())
    assert next(iter(compiled.named_parameters()))[0].startswith("_orig_mod.base_model.model.")
    assert_matches(stream_merged_params(compiled), ref)


def test_renames_mapping_and_callable_run_last() -> None:
    pm = lora(tiny_llama(), target_modules=["q_proj"])
    ref = oracle(pm)
    got = list(stream_merged_params(pm, renames={"model": "language_model.model", "lm_head.weight": "out.w"}))
    expected = {("language_model." + n if n.startswith("model.") else "out.w"): t for n, t in ref.items()}
    assert_matches(got, expected)
    # Anchored on whole segments: "model" does not touch "model_x" and a longer key wins.
    got = dict(stream_merged_params(pm, renames={"model": "m", "model.layers.0": "first"}))
    assert "first.self_attn.q_proj.weight" in got and "m.layers.1.self_attn.q_proj.weight" in got
    got = list(stream_merged_params(pm, renames=lambda n: n.upper()))
    assert_matches(got, {n.upper(): t for n, t in ref.items()})


# -- bad input ---------------------------------------------------------------------------------------------------------
def test_not_a_module_is_a_type_error() -> None:
    with pytest.raises(TypeError, match=r"nn\.Module"):
        ParamStream({"weight": torch.zeros(2)})  # type: ignore[arg-type]


def test_meta_parameters_are_named() -> None:
    with torch.device("meta"):
        model = tiny_llama()
    with pytest.raises(UnsupportedModelError, match=r"'model\.embed_tokens\.weight' is on the meta device"):
        ParamStream(model)


def test_name_collision_names_both_parameters() -> None:
    pm = lora(tiny_llama(), target_modules=["q_proj"])
    before = snapshot(pm)
    with pytest.raises(NameCollisionError, match=r"q_proj.*k_proj.*both normalize to 'x'|both normalize"):
        ParamStream(pm, renames=lambda n: "x" if n.endswith(("q_proj.weight", "k_proj.weight")) else n)
    with pytest.raises(NameCollisionError, match=r"base_model\.model\.model\.layers\.0\.self_attn\.q_proj"):
        ParamStream(pm, renames={"model.layers.0.self_attn.q_proj": "model.layers.0.self_attn.k_proj"})
    assert_bitwise_equal(pm, before)


def test_rename_returning_a_non_string_names_the_parameter() -> None:
    pm = lora(tiny_llama(), target_modules=["q_proj"])
    before = snapshot(pm)
    with pytest.raises(RenameError, match=r"base_model\.model\.model\.embed_tokens\.weight"):
        ParamStream(pm, renames=lambda n: None)  # type: ignore[arg-type,return-value]
    with pytest.raises(TypeError):
        ParamStream(pm, renames=3)  # type: ignore[arg-type]
    assert_bitwise_equal(pm, before)


def test_bad_options() -> None:
    model = tiny_llama()
    with pytest.raises(ValueError, match="group_by"):
        ParamStream(model, group_by="layers")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="budget_bytes"):
        ParamStream(model, budget_bytes=0)
    with pytest.raises(TypeError, match="dtype"):
        ParamStream(model, dtype=torch.int8)


def test_plain_model_passes_through_unchanged() -> None:
    model = tiny_llama()
    ref = {n: p.detach() for n, p in copy.deepcopy(model).named_parameters()}
    got = list(stream_merged_params(model))
    assert_matches(got, ref, tol=1e-12)
    assert all(rel_err(t, ref[n]) == 0 for n, t in got)


def test_an_abandoned_pass_ends_when_its_last_reference_goes_not_at_garbage_collection() -> None:
    """No reference cycle between a pass and its producer: dropping the pass ends it at once (and tells the peers),
    even with the cyclic garbage collector off."""
    pm = lora(tiny_llama(), target_modules=["q_proj"])
    stream = ParamStream(pm, group_by="module")
    gc.disable()
    try:
        it = iter(stream)
        next(it)
        producer = weakref.ref(it._gen)
        record = it.record
        del it
        assert producer() is None
        assert record.state.value == "stopped"
    finally:
        gc.enable()
