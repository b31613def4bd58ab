"""Exact or refused: every peft tuner on every layer type peft can adapt either streams peft's own merge or raises a
``LoraStreamError`` at construction, before any tensor exists. Any other outcome fails.

Every adapter tensor (factors, DoRA magnitudes, biases, ``modules_to_save`` copies) is perturbed away from peft's
initialisation, which otherwise hides wrong merges (``lora_B == 0``; DoRA's magnitude equal to ``||W + dW||``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import assert_matches, oracle, perturb_adapters, zoo
from torch import nn

from lora_stream import LoraStreamError, ParamStream, UnsupportedAdapterError

MATCH = "match"


def _lora(**kw: Any) -> Any:
    from peft import LoraConfig

    return LoraConfig(init_lora_weights=False, r=4, lora_alpha=8, **kw)


def _cfg(name: str, **kw: Any) -> Callable[[], Any]:
    def make() -> Any:
        import peft

        return getattr(peft, name)(**kw)

    return make


CONV = ["c1", "c2", "c2_1x1", "c3"]

# (id, config factory, expected): "match", or the LoraStreamError subclass raised at construction.
CASES: list[tuple[str, Callable[[], Any], Any]] = [
    ("lora-linear", lambda: _lora(target_modules=["lin", "lin_nobias"]), MATCH),
    ("rslora-linear", lambda: _lora(target_modules=["lin"], use_rslora=True), MATCH),
    ("dora-linear", lambda: _lora(target_modules=["lin", "lin_nobias"], use_dora=True), MATCH),
    ("lora_bias-linear", lambda: _lora(target_modules=["lin"], lora_bias=True), MATCH),
    (
        "lora_bias-without-base-bias",
        lambda: _lora(target_modules=["lin_nobias"], lora_bias=True),
        UnsupportedAdapterError,
    ),
    ("lora-embedding", lambda: _lora(target_modules=["emb"]), MATCH),
    ("dora-embedding", lambda: _lora(target_modules=["emb"], use_dora=True), MATCH),
    ("lora-conv", lambda: _lora(target_modules=CONV), MATCH),
    ("rslora-conv", lambda: _lora(target_modules=CONV, use_rslora=True), MATCH),
    ("dora-conv", lambda: _lora(target_modules=CONV, use_dora=True), MATCH),
    ("lora_bias-conv", lambda: _lora(target_modules=CONV, lora_bias=True), MATCH),
    ("lora-conv-groups", lambda: _lora(target_modules=["c2_groups"]), UnsupportedAdapterError),
    ("lora-conv-dilated", lambda: _lora(target_modules=["c2_dilated"]), UnsupportedAdapterError),
    ("lora-gpt2-conv1d", lambda: _lora(target_modules=["gpt2"], fan_in_fan_out=True), MATCH),
    ("dora-gpt2-conv1d", lambda: _lora(target_modules=["gpt2"], fan_in_fan_out=True, use_dora=True), MATCH),
    ("lora_bias-gpt2-conv1d", lambda: _lora(target_modules=["gpt2"], fan_in_fan_out=True, lora_bias=True), MATCH),
    ("lora-mha", lambda: _lora(target_modules=["mha"]), UnsupportedAdapterError),
    ("lora-target_parameters", lambda: _lora(target_modules=[], target_parameters=["moe.gate_up"]), MATCH),
    (
        # Three ParamWrappers nested on one module (3-D experts and a 2-D router), rsLoRA, a per-parameter rank.
        "lora-target_parameters-nested",
        lambda: _lora(
            target_modules=["lin"],
            target_parameters=["moe.gate_up", "moe.down", "moe.router"],
            use_rslora=True,
            rank_pattern={"moe.down": 2},
        ),
        MATCH,
    ),
    ("lora-target_parameters-transposed", lambda: _lora(target_modules=[], target_parameters=["moe_t.gate_up"]), MATCH),
    ("alora", lambda: _lora(target_modules=["lin"], alora_invocation_tokens=[1]), UnsupportedAdapterError),
    ("lora+modules_to_save", lambda: _lora(target_modules=["lin"], modules_to_save=["c2", "emb"]), MATCH),
    (
        "lora-trainable-tokens",
        lambda: _lora(target_modules=["lin"], trainable_token_indices={"emb": [1, 5]}),
        UnsupportedAdapterError,
    ),
    ("loha-linear", _cfg("LoHaConfig", target_modules=["lin", "lin_nobias"], init_weights=False), MATCH),
    ("loha-conv", _cfg("LoHaConfig", target_modules=["c1", "c2", "c2_1x1"], init_weights=False), MATCH),
    (
        "loha-conv-effective",
        _cfg("LoHaConfig", target_modules=["c2"], init_weights=False, use_effective_conv2d=True),
        MATCH,
    ),
    ("lokr-linear", _cfg("LoKrConfig", target_modules=["lin", "lin_nobias"], init_weights=False), MATCH),
    (
        "lokr-linear-decompose",
        _cfg("LoKrConfig", target_modules=["lin"], init_weights=False, decompose_both=True, decompose_factor=4),
        MATCH,
    ),
    ("lokr-conv", _cfg("LoKrConfig", target_modules=["c1", "c2", "c2_1x1"], init_weights=False), MATCH),
    (
        "lokr-conv-effective",
        _cfg("LoKrConfig", target_modules=["c2"], init_weights=False, use_effective_conv2d=True),
        MATCH,
    ),
    ("adalora", _cfg("AdaLoraConfig", target_modules=["lin"], total_step=10, init_r=4), UnsupportedAdapterError),
    ("ia3", _cfg("IA3Config", target_modules=["lin"], feedforward_modules=[]), UnsupportedAdapterError),
    ("oft", _cfg("OFTConfig", target_modules=["lin"], r=0, oft_block_size=8), UnsupportedAdapterError),
    ("boft", _cfg("BOFTConfig", target_modules=["lin"], boft_block_size=4), UnsupportedAdapterError),
    ("vera", _cfg("VeraConfig", target_modules=["lin"], r=4), UnsupportedAdapterError),
    ("fourierft", _cfg("FourierFTConfig", target_modules=["lin"], n_frequency=16), UnsupportedAdapterError),
    ("vblora", _cfg("VBLoRAConfig", target_modules=["lin"], vector_length=16, num_vectors=8), UnsupportedAdapterError),
    ("hra", _cfg("HRAConfig", target_modules=["lin"], r=4), UnsupportedAdapterError),
    ("ln-tuning", _cfg("LNTuningConfig", target_modules=["lin"]), UnsupportedAdapterError),
    (
        "trainable-tokens",
        _cfg("TrainableTokensConfig", target_modules=["emb"], token_indices=[1, 5]),
        UnsupportedAdapterError,
    ),
]


def _peft_model(make: Callable[[], Any]) -> nn.Module:
    import warnings

    from peft import get_peft_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = get_peft_model(zoo(), make())
    perturb_adapters(pm)
    return pm


@pytest.mark.parametrize(("case", "make", "expected"), CASES, ids=[c[0] for c in CASES])
def test_every_configuration_streams_peft_merge_or_is_refused_at_construction(
    case: str, make: Callable[[], Any], expected: Any
) -> None:
    pm = _peft_model(make)
    if expected is not MATCH:
        with pytest.raises(expected) as info:
            ParamStream(pm)
        assert isinstance(info.value, LoraStreamError)
        assert "module" in str(info.value) or "model" in str(info.value), info.value
        return
    ref = oracle(pm)
    got = list(ParamStream(pm, group_by="module"))
    assert_matches(got, ref)
    # bf16: the float32 merge rounded once, whatever the grouping.
    bf16 = dict(ParamStream(pm, dtype=torch.bfloat16, group_by="budget", budget_bytes=10_000))
    for name, t in got:
        assert torch.equal(bf16[name], t.to(torch.bfloat16)), name


def test_several_active_adapters_on_convolutions_merge_in_turn() -> None:
    pm = _peft_model(lambda: _lora(target_modules=[*CONV, "lin"], use_dora=True))
    pm.add_adapter("second", _lora(target_modules=CONV, lora_bias=True))
    perturb_adapters(pm, seed=2)
    pm.base_model.set_adapter(["default", "second"])
    assert_matches(ParamStream(pm), oracle(pm))


def test_the_comparison_catches_a_merge_that_ignores_dora() -> None:
    """Control: the pre-fix conv DoRA merge (W + dW, no magnitude rescale) fails the same comparison."""
    pm = _peft_model(lambda: _lora(target_modules=["c2"], use_dora=True))
    layer = pm.base_model.model.c2
    wrong = {n: t.clone() for n, t in ParamStream(pm)}
    with torch.no_grad():
        wrong["c2.weight"] = layer.base_layer.weight + layer.get_delta_weight("default")
    with pytest.raises(AssertionError, match=r"c2\.weight"):
        assert_matches(wrong.items(), oracle(pm))


def test_refusal_names_module_adapter_and_reason() -> None:
    pm = _peft_model(lambda: _lora(target_modules=["c2_groups"]))
    with pytest.raises(UnsupportedAdapterError, match=r"'base_model\.model\.c2_groups' adapter 'default'.*groups=2"):
        ParamStream(pm)


def test_an_unknown_subclass_of_a_supported_layer_is_refused() -> None:
    """Matching is by exact class: a subclass may merge differently, so it is not assumed to merge like its base."""
    from peft.tuners.lora.layer import Linear

    pm = _peft_model(lambda: _lora(target_modules=["lin"]))
    layer = pm.base_model.model.lin

    class CustomLinear(Linear):
        pass

    layer.__class__ = CustomLinear
    with pytest.raises(UnsupportedAdapterError, match="CustomLinear"):
        ParamStream(pm)


def test_unknown_lora_variant_is_refused() -> None:
    from peft.tuners.lora.variants import DoraLinearVariant

    class MyVariant(DoraLinearVariant):
        pass

    pm = _peft_model(lambda: _lora(target_modules=["lin"], use_dora=True))
    pm.base_model.model.lin.lora_variant["default"] = MyVariant()
    with pytest.raises(UnsupportedAdapterError, match="MyVariant"):
        ParamStream(pm)


def test_rank_dropout_in_training_mode_does_not_change_the_merge() -> None:
    """LoHa/LoKr's rank dropout is a training-time perturbation; the merge is the deterministic weight."""
    pm = _peft_model(_cfg("LoKrConfig", target_modules=["lin"], init_weights=False, rank_dropout=0.5))
    pm.train()
    first = {n: t.clone() for n, t in ParamStream(pm)}
    second = dict(ParamStream(pm))
    assert all(torch.equal(first[n], second[n]) for n in first)
    assert_matches(first.items(), oracle(copy.deepcopy(pm).eval()))


def test_lora_on_parameters_peft_cannot_merge_exactly_is_refused_at_construction() -> None:
    """A single expert stored [1, in, out] (peft adds its [out, in] delta there), and a non-float weight."""
    import warnings

    from peft import get_peft_model

    class OneTransposedExpert(nn.Module):
        is_transposed = True

        def __init__(self) -> None:
            super().__init__()
            self.gate_up = nn.Parameter(torch.randn(1, 16, 32))

    class Holder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.moe = OneTransposedExpert()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = get_peft_model(Holder(), _lora(target_modules=[], target_parameters=["moe.gate_up"]))
    perturb_adapters(pm)
    with pytest.raises(UnsupportedAdapterError, match=r"\[1, in, out\]"):
        ParamStream(pm)

    pm = _peft_model(lambda: _lora(target_modules=[], target_parameters=["moe.gate_up"]))
    base = pm.base_model.model.moe.get_base_layer()
    base.gate_up = nn.Parameter(base.gate_up.data.to(torch.float64), requires_grad=False)
    with pytest.raises(UnsupportedAdapterError, match="float64"):
        ParamStream(pm)
