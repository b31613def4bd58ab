"""Which peft tuner layers lora_stream merges, and how: one table, and anything not in it is refused.

peft decides what a layer's merge is from the layer's class, each adapter's ``lora_variant`` object and a few options
(``lora_bias``, ``fan_in_fan_out``, a convolution's ``groups``). A merge that ignores one of them comes out silently
wrong in the inference engine, so every one of them is checked here, before the first tensor, against the rows of
:data:`LAYER_RULES` (matched by exact class, never by ``isinstance``: a subclass may merge differently). A layer class,
a variant or an adapter tensor that no row names is refused with :class:`~lora_stream.UnsupportedAdapterError`
naming the module, the adapter and the reason. Supporting a new peft layer or variant is one row here plus its math
in :mod:`lora_stream.merge`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from torch import nn

from .errors import UnsupportedAdapterError

__all__ = ["LAYER_RULES", "LayerRule", "LoraAdapterSpec", "LycorisAdapterSpec", "rule_for", "lora_spec", "lycoris_spec"]

#: How the adapted weight is laid out for a LoRA merge: ``linear`` ([out, in], or [in, out] with ``fan_in_fan_out``),
#: ``embedding`` ([num_embeddings, dim]) or ``conv`` ([out, in, *kernel], merged as the matrix [out, in * kernel]).
Layout = Literal["linear", "embedding", "conv", "param"]

_DORA = "dora"


@dataclass(frozen=True)
class LayerRule:
    """One row of the table: a peft tuner layer class and what lora_stream does with it.

    ``family`` is ``"lora"`` (low-rank product, optional DoRA, merged in float32 blocks), ``"loha"`` / ``"lokr"``
    (peft's own LyCORIS weight functions on the gathered factors) or ``"refused"`` (``reason`` says why).
    ``variants`` maps the exact class name of an adapter's ``lora_variant`` to ``"dora"``; no variant is plain
    LoRA; any other variant is refused. ``lora_bias`` / ``fan_in_fan_out`` say whether those options are merged
    (``None``: refused, with ``lora_bias_refusal`` as the reason).
    """

    family: Literal["lora", "loha", "lokr", "refused"]
    layout: Layout = "linear"
    variants: dict[str, str] = field(default_factory=dict)
    lora_bias: bool = False
    lora_bias_refusal: str = "peft does not merge lora_bias on this layer"
    fan_in_fan_out: bool = False
    reason: str = ""


_LORA = "peft.tuners.lora.layer"
_VARIANTS = "peft.tuners.lora.variants"
_BNB_BIAS = (
    "peft's merge of lora_bias on a bitsandbytes layer adds lora_B.bias without the LoRA scaling while its forward "
    "scales it, so there is no single right answer"
)

#: The table. Keys are ``f"{cls.__module__}.{cls.__qualname__}"`` of the tuner layer.
LAYER_RULES: dict[str, LayerRule] = {
    f"{_LORA}.Linear": LayerRule(
        "lora", "linear", {f"{_VARIANTS}.DoraLinearVariant": _DORA}, lora_bias=True, fan_in_fan_out=True
    ),
    f"{_LORA}.Embedding": LayerRule("lora", "embedding", {f"{_VARIANTS}.DoraEmbeddingVariant": _DORA}),
    f"{_LORA}.Conv1d": LayerRule("lora", "conv", {f"{_VARIANTS}.DoraConv1dVariant": _DORA}, lora_bias=True),
    f"{_LORA}.Conv2d": LayerRule("lora", "conv", {f"{_VARIANTS}.DoraConv2dVariant": _DORA}, lora_bias=True),
    f"{_LORA}.Conv3d": LayerRule("lora", "conv", {f"{_VARIANTS}.DoraConv3dVariant": _DORA}, lora_bias=True),
    # QLoRA: the base is dequantized block by block (lora_stream.base_weights); the adapter math is nn.Linear's.
    "peft.tuners.lora.bnb.Linear4bit": LayerRule(
        "lora", "linear", {f"{_VARIANTS}.DoraLinearVariant": _DORA}, lora_bias_refusal=_BNB_BIAS
    ),
    "peft.tuners.lora.bnb.Linear8bitLt": LayerRule(
        "lora", "linear", {f"{_VARIANTS}.DoraLinearVariant": _DORA}, lora_bias_refusal=_BNB_BIAS
    ),
    "peft.tuners.loha.layer.Linear": LayerRule("loha"),
    "peft.tuners.loha.layer.Conv1d": LayerRule("loha", "conv"),
    "peft.tuners.loha.layer.Conv2d": LayerRule("loha", "conv"),
    "peft.tuners.lokr.layer.Linear": LayerRule("lokr"),
    "peft.tuners.lokr.layer.Conv1d": LayerRule("lokr", "conv"),
    "peft.tuners.lokr.layer.Conv2d": LayerRule("lokr", "conv"),
    f"{_LORA}.MultiheadAttention": LayerRule(
        "refused",
        reason="LoRA on nn.MultiheadAttention merges into the fused in_proj_weight and out_proj through its own "
        "path, which lora_stream does not reproduce",
    ),
    # target_parameters: LoRA on a module's parameter (3-D MoE experts, a router's 2-D weight), nested when several
    # parameters of one module are adapted. peft itself refuses DoRA, lora_bias and dropout here.
    f"{_LORA}.ParamWrapper": LayerRule(
        "lora", "param", lora_bias_refusal="peft refuses lora_bias on target_parameters"
    ),
}

#: Adapter tensors each LyCORIS family may hold per adapter, and the combinations whose weight function is known.
_LYCORIS_KEYS: dict[str, tuple[frozenset[str], ...]] = {
    "loha": (
        frozenset({"hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b"}),
        frozenset({"hada_t1", "hada_t2", "hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b"}),
    ),
    "lokr": tuple(
        frozenset(w1 | w2)
        for w1 in ({"lokr_w1"}, {"lokr_w1_a", "lokr_w1_b"})
        for w2 in ({"lokr_w2"}, {"lokr_w2_a", "lokr_w2_b"}, {"lokr_t2", "lokr_w2_a", "lokr_w2_b"})
    ),
}


@dataclass(frozen=True)
class LoraAdapterSpec:
    """What one active LoRA adapter of a layer contributes: DoRA or not, and whether its bias is merged."""

    adapter: str
    dora: bool
    bias: bool


@dataclass(frozen=True)
class LycorisAdapterSpec:
    """One active LoHa/LoKr adapter: the names of its tensors present on the layer, and its scaling."""

    adapter: str
    keys: frozenset[str]
    scaling: float


def class_key(obj: object) -> str:
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def _refuse(src: str, adapter: str | None, reason: str) -> UnsupportedAdapterError:
    who = f"module {src!r}" + (f" adapter {adapter!r}" if adapter is not None else "")
    return UnsupportedAdapterError(f"{who}: {reason}")


def rule_for(layer: nn.Module, src: str) -> LayerRule:
    """The table row of ``layer``; raises :class:`UnsupportedAdapterError` if there is none or it is a refusal."""
    key = class_key(layer)
    rule = LAYER_RULES.get(key)
    if rule is None:
        supported = (
            "LoRA/rsLoRA/DoRA on Linear, GPT-2 Conv1D, Embedding, Conv1d/2d/3d and bitsandbytes 4/8-bit Linear; "
            "LoRA on target_parameters (MoE experts); "
            "LoHa; LoKr"
        )
        raise _refuse(
            src, None, f"{key} is not a layer lora_stream knows how to merge exactly (supported: {supported})"
        )
    if rule.family == "refused":
        raise _refuse(src, None, rule.reason)
    return rule


def _base_groups(layer: Any) -> int:
    return int(getattr(layer.get_base_layer(), "groups", 1))


def lora_spec(rule: LayerRule, layer: Any, adapter: str, src: str, base_has_bias: bool) -> LoraAdapterSpec:
    """Check every option of ``adapter`` on ``layer`` that changes peft's merge, against ``rule``."""
    variant = getattr(layer, "lora_variant", {}).get(adapter)
    dora = False
    if variant is not None:
        vkey = class_key(variant)
        if rule.variants.get(vkey) != _DORA:
            raise _refuse(src, adapter, f"the LoRA variant {type(variant).__name__} is not merged by lora_stream")
        dora = True
    if rule.layout == "conv":
        if _base_groups(layer) != 1:
            raise _refuse(
                src, adapter, f"a convolution with groups={_base_groups(layer)}; peft itself cannot merge LoRA into it"
            )
        base, a_conv, b_conv = layer.get_base_layer(), layer.lora_A[adapter], layer.lora_B[adapter]
        if any(k != 1 for k in b_conv.kernel_size) or getattr(a_conv, "dilation", None) != getattr(
            base, "dilation", None
        ):
            raise _refuse(src, adapter, "its LoRA convolutions are not the (kernel, 1x1) pair whose merge is B @ A")
    fan_in_fan_out = bool(getattr(layer, "fan_in_fan_out", False))
    if fan_in_fan_out and not rule.fan_in_fan_out:
        raise _refuse(src, adapter, f"fan_in_fan_out=True on a {type(layer).__name__} layer")
    bias = bool(getattr(layer, "lora_bias", {}).get(adapter, False))
    if bias:
        if not rule.lora_bias:
            raise _refuse(src, adapter, f"lora_bias=True: {rule.lora_bias_refusal}")
        if not base_has_bias:
            raise _refuse(src, adapter, "lora_bias=True but the base layer has no bias (peft cannot merge it either)")
    if rule.layout != "embedding":
        # The merge is B @ A (+ lora_B.bias): any other adapter tensor would be silently dropped.
        if getattr(layer.lora_A[adapter], "bias", None) is not None:
            raise _refuse(src, adapter, "lora_A has a bias, which the LoRA merge has no term for")
        if not bias and getattr(layer.lora_B[adapter], "bias", None) is not None:
            raise _refuse(src, adapter, "lora_B has a bias but lora_bias is off")
    return LoraAdapterSpec(adapter, dora, bias)


def lycoris_spec(rule: LayerRule, layer: Any, adapter: str, src: str) -> LycorisAdapterSpec:
    """The tensors ``adapter`` holds on a LoHa/LoKr ``layer``; refused unless they form a known weight function."""
    names = tuple(getattr(layer, "adapter_layer_names", ()))
    keys = frozenset(n for n in names if adapter in getattr(layer, n, {}))
    if keys not in _LYCORIS_KEYS[rule.family]:
        raise _refuse(src, adapter, f"{rule.family} adapter tensors {sorted(keys)} form no weight lora_stream knows")
    if rule.layout == "conv" and _base_groups(layer) != 1:
        raise _refuse(src, adapter, f"a convolution with groups={_base_groups(layer)}")
    return LycorisAdapterSpec(adapter, keys, float(layer.scaling[adapter]))
