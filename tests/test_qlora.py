"""QLoRA: bitsandbytes 4-bit (nf4/fp4, with and without double quantization) and 8-bit bases stream exactly.

The oracle is peft's merge on a float32 copy whose bases are bitsandbytes' own dequantization of the quantized
weights. ``merge_block_bytes`` is small, so the per-block dequantization runs over many row blocks (64 columns: whole
quantization blocks per row); ``down_proj`` has 96 columns, a row that is not a whole number of blocks, which is
dequantized in one piece.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import (
    BNB_CONFIGS,
    assert_matches,
    dequantized_reference,
    load_quantized,
    lora,
    perturb_adapters,
    require,
    tiny_llama,
)

from lora_stream import ParamStream, PlainGatherer, UnsupportedAdapterError, UnsupportedModelError


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    require("bitsandbytes")
    path = tmp_path_factory.mktemp("qlora") / "model"
    tiny_llama(hidden=64, inter=96, heads=2, kv_heads=1, layers=2).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def checkpoint_128(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Every row a whole number of quantization blocks: bitsandbytes' CPU repacking needs that to run a forward."""
    require("bitsandbytes")
    path = tmp_path_factory.mktemp("qlora128") / "model"
    tiny_llama(hidden=64, inter=128, heads=2, kv_heads=1, layers=2).save_pretrained(path)
    return str(path)


def _qlora(path: str, quant: str, **lora_kw: object) -> torch.nn.Module:
    lora_kw.setdefault("target_modules", ["q_proj", "v_proj", "gate_proj", "down_proj"])
    pm = lora(load_quantized(path, quant), **lora_kw)
    perturb_adapters(pm)
    return pm


def _quantized_storage(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for n, p in model.named_parameters():
        if type(p).__module__.startswith("bitsandbytes"):
            out[n] = p.data.clone()
            state = getattr(p, "quant_state", None)
            if state is not None:
                out[n + ".absmax"] = state.absmax.clone()
            if getattr(p, "SCB", None) is not None:
                out[n + ".SCB"] = p.SCB.clone()
    return out


@pytest.mark.parametrize("use_dora", [False, True], ids=["lora", "dora"])
@pytest.mark.parametrize("quant", list(BNB_CONFIGS))
def test_quantized_base_streams_the_dequantized_merge(checkpoint: str, quant: str, use_dora: bool) -> None:
    pm = _qlora(checkpoint, quant, use_dora=use_dora)
    layer = pm.base_model.model.model.layers[0].self_attn.q_proj
    assert type(layer).__module__ == "peft.tuners.lora.bnb", type(layer)
    ref = {n: p.detach() for n, p in dequantized_reference(pm, checkpoint).named_parameters()}
    stream = ParamStream(pm, dtype=torch.float32, merge_block_bytes=2048)
    got = list(stream)
    # Every quantized layer comes out dequantized (k_proj, o_proj, up_proj carry no adapter) and merged where adapted.
    assert_matches(got, ref)
    assert [m.name for m in stream.metadata()] == list(ref)


def test_default_dtype_of_a_quantized_base_is_bf16_rounded_once(checkpoint: str) -> None:
    pm = _qlora(checkpoint, "nf4-double")
    f32 = dict(ParamStream(pm, dtype=torch.float32))
    stream = ParamStream(pm)
    meta = {m.name: m for m in stream.metadata()}
    assert meta["model.layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16
    assert meta["model.layers.0.self_attn.k_proj.weight"].shape == (32, 64)  # logical shape, not packed storage
    for name, t in stream:
        assert t.dtype == meta[name].dtype and tuple(t.shape) == meta[name].shape, name
        if "proj" in name:
            assert torch.equal(t, f32[name].to(torch.bfloat16)), name


@pytest.mark.parametrize("quant", ["nf4-double", "int8"])
def test_quantized_storage_is_bitwise_unchanged_after_twenty_streams(checkpoint: str, quant: str) -> None:
    pm = _qlora(checkpoint, quant, use_dora=True)
    before = _quantized_storage(pm)
    assert len(before) >= 14
    first = None
    for _ in range(20):
        out = {n: t.clone() for n, t in ParamStream(pm)}
        first = first or out
        assert all(torch.equal(out[n], first[n]) for n in out)
    after = _quantized_storage(pm)
    assert all(torch.equal(before[n], after[n]) for n in before)


def test_lora_bias_on_a_quantized_layer_is_refused(checkpoint: str) -> None:
    pm = lora(load_quantized(checkpoint, "nf4"), target_modules=["q_proj"], lora_bias=True)
    with pytest.raises(UnsupportedAdapterError, match=r"q_proj' adapter 'default': lora_bias=True: peft's merge"):
        ParamStream(pm)


def test_a_quantized_base_under_a_collective_gatherer_is_refused(checkpoint: str) -> None:
    class Collective(PlainGatherer):
        name = "sharded-test"

        @property
        def collective(self) -> bool:
            return True

    pm = _qlora(checkpoint, "nf4")
    with pytest.raises(UnsupportedModelError, match="plain/DDP gatherer only"):
        ParamStream(pm, gatherer=Collective())


def test_other_quantizers_are_refused_with_a_clear_error(tmp_path: Path) -> None:
    from torch import nn

    class FakeGptqLinear(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qweight = nn.Parameter(torch.zeros(8, 8, dtype=torch.int32), requires_grad=False)
            self.weight = nn.Parameter(torch.zeros(8, 8, dtype=torch.int8), requires_grad=False)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = FakeGptqLinear()

    with pytest.raises(UnsupportedModelError, match=r"'proj'.*quantized base weight"):
        ParamStream(Model())

    class GptqLikeLinear(nn.Module):
        """A weight-only quantized layer keeps buffers, no `weight`: streaming its other parameters would silently
        drop the layer's weight."""

        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("qweight", torch.zeros(8, 8, dtype=torch.int32))
            self.bias = nn.Parameter(torch.zeros(8))

    GptqLikeLinear.__module__ = "auto_gptq.nn_modules.qlinear"
    model = Model()
    model.proj = GptqLikeLinear()
    with pytest.raises(UnsupportedModelError, match=r"'proj' \(GptqLikeLinear"):
        ParamStream(model)


def test_a_float_layer_from_a_quantization_package_is_streamed() -> None:
    """torchao's Float8Linear trains a float master weight: the module's package alone must not refuse it."""
    from torch import nn

    class Float8Linear(nn.Linear):
        pass

    Float8Linear.__module__ = "torchao.float8.float8_linear"
    model = nn.Sequential(Float8Linear(4, 4))
    assert [n for n, _ in ParamStream(model)] == ["0.weight", "0.bias"]


def test_cpu_packed_4bit_layout_after_an_eval_forward_streams_what_the_layer_computes(checkpoint_128: str) -> None:
    """On AVX512-BF16 CPUs ``Linear4bit`` repacks its weight in place at its first no-grad eval forward (a GRPO
    loop's logprob pass). The stream must read that layout as the layer's forward does: probed with the identity
    matrix, the layer returns its effective weight, which must equal the streamed (dequantized) weight bit for bit,
    also for a stream planned before the repack."""
    pm = _qlora(checkpoint_128, "nf4-double", target_modules=["q_proj"])
    built_before = ParamStream(pm, dtype=torch.float32, merge_block_bytes=4096)  # planned on the original layout
    pm.eval()
    with torch.no_grad():
        pm(torch.tensor([[1, 2, 3, 4]]))
    attn = pm.base_model.model.model.layers[0].self_attn
    k_proj, q_base = attn.k_proj, attn.q_proj.base_layer
    if k_proj.support_avx512bf16_for_cpu:
        assert k_proj.weight.quant_state.packing_format_for_cpu, "the forward should have repacked the weight"
    eye = torch.eye(64, dtype=torch.bfloat16)
    with torch.no_grad():
        effective_k = (k_proj(eye) - k_proj.bias if k_proj.bias is not None else k_proj(eye)).float().t()
        effective_q = q_base(eye).float().t()
    layer = attn.q_proj
    delta = layer.lora_B["default"].weight.float() @ layer.lora_A["default"].weight.float() * layer.scaling["default"]
    for stream in (ParamStream(pm, dtype=torch.float32, merge_block_bytes=4096), built_before):
        got = dict(stream)
        assert torch.equal(got["model.layers.0.self_attn.k_proj.weight"].to(torch.bfloat16).float(), effective_k)
        assert_matches([("q", got["model.layers.0.self_attn.q_proj.weight"])], {"q": effective_q + delta})
