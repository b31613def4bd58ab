"""Planning: walk the trainer's model once and decide, for every output tensor, its name, its sources and its merge.

The plan is built before the first tensor is produced, from module structure and shapes only (no parameter data
is read and nothing is communicated), so every unsupported adapter, name collision or bad rename is reported before
anything is sent to an inference engine.

The walk mirrors ``nn.Module.named_parameters()``: pre-order over registered children, a module's own parameters
before its children's, each module and each parameter object once. That makes the output order the model's
registration order and makes tied weights come out once, under the name ``named_parameters()`` gives them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .errors import NameCollisionError, UnsupportedAdapterError, UnsupportedModelError
from .merge import DeltaMerge, LoraBiasMerge, LoraTerm, LoraWeightMerge, Merge
from .names import NameNormalizer, join, wrapped_child_attr

if TYPE_CHECKING:
    from .gatherers.base import Gatherer, ParamRef

__all__ = ["Target", "Unit", "plan_model"]


@dataclass
class Target:
    """One output tensor: its final name, the trainer's path it comes from, and how it is computed."""

    name: str
    source: str
    param: ParamRef
    dtype: torch.dtype
    shape: torch.Size
    merge: Merge | None = None


@dataclass
class Unit:
    """The smallest gather unit: one module's own parameters, or one tuner layer with its adapter weights.

    A unit is never split across groups, so a merge always sees its base weight and its adapter factors whole.
    """

    module: str
    targets: list[Target] = field(default_factory=list)
    params: list[ParamRef] = field(default_factory=list)


def _peft_classes() -> dict[str, tuple[Any, ...]]:
    from peft.tuners import lora
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import AuxiliaryTrainingWrapper, ModulesToSaveWrapper

    generic: list[type] = [lora.layer._ConvNd]
    for mod_name, names in (
        ("peft.tuners.loha.layer", ("Linear", "Conv2d", "Conv1d")),
        ("peft.tuners.lokr.layer", ("Linear", "Conv2d", "Conv1d")),
    ):
        try:
            mod = __import__(mod_name, fromlist=list(names))
        except ImportError:  # pragma: no cover - older peft
            continue
        generic += [getattr(mod, n) for n in names if hasattr(mod, n)]
    return {
        "tuner": (BaseTunerLayer,),
        "lora_linear": (lora.layer.Linear,),
        "lora_embedding": (lora.layer.Embedding,),
        "generic": tuple(generic),
        "aux": (AuxiliaryTrainingWrapper,),
        "mts": (ModulesToSaveWrapper,),
    }


def _is_quantized(module: nn.Module) -> bool:
    w = getattr(module, "weight", None)
    kinds = [type(module), type(w)]
    if any(k.__module__.split(".")[0] in ("bitsandbytes", "auto_gptq", "awq", "hqq", "torchao") for k in kinds):
        return True
    return isinstance(w, torch.Tensor) and not (w.is_floating_point() or w.is_meta)


class _Planner:
    def __init__(
        self, gatherer: Gatherer, dtype: torch.dtype | None, normalizer: NameNormalizer, block_bytes: int
    ) -> None:
        self.g = gatherer
        self.dtype = dtype
        self.normalize = normalizer
        self.block_bytes = block_bytes
        self.cls = _peft_classes()
        self.units: list[Unit] = []
        self.seen_modules: set[int] = set()
        self.seen_params: dict[int, str] = {}
        self.names: dict[str, str] = {}
        self.final_names: dict[int, str] = {}
        self.aliases: dict[str, str] = {}

    # -- outputs ---------------------------------------------------------------------------------------------------
    def _target(self, hf: str, src: str, p: ParamRef, merge: Merge | None) -> Target:
        if isinstance(p, torch.Tensor) and p.is_meta:
            raise UnsupportedModelError(
                f"parameter {src!r} is on the meta device; materialize the model (e.g. load its weights) before "
                "streaming it"
            )
        name = self.normalize(hf, src)
        other = self.names.get(name)
        if other is not None:
            raise NameCollisionError(f"parameters {other!r} and {src!r} both normalize to {name!r}")
        self.names[name] = src
        out_dtype = self.dtype or self.g.full_dtype(p)
        return Target(name, src, p, out_dtype, self.g.full_shape(p), merge)

    def _own_params(
        self, module: nn.Module, hf: str, src: str, unit: Unit, merges: dict[str, Merge] | None = None
    ) -> None:
        for pname, p in self.g.module_params(module):
            psrc = join(src, pname)
            if id(p) in self.seen_params:
                # Tied: named_parameters() reports it once, under its first name. Engines that keep the two
                # apart (vLLM on CPU repacks lm_head separately) need the alias, so remember it.
                alias = self.normalize(join(hf, pname), psrc)
                primary = self.final_names.get(id(p))
                if primary is not None and alias not in self.names:
                    self.aliases[alias] = primary
                continue
            self.seen_params[id(p)] = psrc
            merge = (merges or {}).get(pname)
            target = self._target(join(hf, pname), psrc, p, merge)
            self.final_names[id(p)] = target.name
            unit.targets.append(target)
            unit.params.extend(merge.params() if merge is not None else [p])

    def _emit(self, unit: Unit) -> None:
        if unit.targets:
            self.units.append(unit)

    # -- walk ------------------------------------------------------------------------------------------------------
    def visit(self, module: nn.Module, hf: str, src: str) -> None:
        if id(module) in self.seen_modules:
            return
        self.seen_modules.add(id(module))
        if isinstance(module, self.cls["tuner"]):
            self._tuner(module, hf, src)
            return
        if isinstance(module, self.cls["aux"]):
            self._aux(module, hf, src)
            return
        _check_peft_model(module, src)
        unit = Unit(src)
        self._own_params(module, hf, src, unit)
        self._emit(unit)
        wrapped = wrapped_child_attr(module)
        for cname, child in module._modules.items():
            if child is None:
                continue
            self.visit(child, hf if cname == wrapped else join(hf, cname), join(src, cname))

    def _aux(self, wrapper: Any, hf: str, src: str) -> None:
        if not isinstance(wrapper, self.cls["mts"]):
            raise UnsupportedAdapterError(
                f"module {src!r} is a {type(wrapper).__name__}; lora_stream merges LoRA-family adapters and "
                "modules_to_save, not this wrapper"
            )
        # Follow forward(): with adapters disabled, or no active adapter saving this module, the original is used.
        chosen: list[str] = []
        if not wrapper.disable_adapters:
            chosen = [a for a in wrapper.active_adapters if a in wrapper.modules_to_save]
        if len(chosen) > 1:
            raise UnsupportedAdapterError(
                f"module {src!r} has modules_to_save for several active adapters {chosen}; peft cannot merge that "
                "either"
            )
        if chosen:
            self.visit(wrapper.modules_to_save[chosen[0]], hf, join(src, f"modules_to_save.{chosen[0]}"))
        else:
            self.visit(wrapper.original_module, hf, join(src, "original_module"))

    def _tuner(self, layer: Any, hf: str, src: str) -> None:
        kind = f"{type(layer).__module__}.{type(layer).__qualname__}"
        base = layer.get_base_layer()  # type: ignore[operator]
        if _is_quantized(base) or type(layer).__module__.rsplit(".", 1)[-1] in (
            "bnb",
            "gptq",
            "awq",
            "hqq",
            "torchao",
            "eetq",
            "aqlm",
        ):
            raise UnsupportedModelError(
                f"module {src!r} ({kind}) has a quantized base weight; an exact out-of-place merge needs the "
                "unquantized weight (dequantize the base model, or stream the adapter on its own)"
            )
        if getattr(layer, "merged", False):
            raise UnsupportedModelError(
                f"module {src!r} has adapters {list(layer.merged_adapters)} merged into its base weight in place; "
                "call model.unmerge_adapter() first (lora_stream merges out of place and never needs merge_adapter)"
            )
        is_lora = isinstance(layer, self.cls["lora_linear"] + self.cls["lora_embedding"])
        if not is_lora and not isinstance(layer, self.cls["generic"]):
            raise UnsupportedAdapterError(
                f"module {src!r} is a {kind}, whose merge is not an additive delta lora_stream can compute out of "
                "place (supported: peft LoRA/rsLoRA/DoRA on Linear, Conv1D and Embedding; LoRA on convolutions; "
                "LoHa; LoKr)"
            )
        adapters_present = set(_adapter_keys(layer))
        active: list[str] = []
        if not layer.disable_adapters:
            active = [a for a in layer.active_adapters if a in adapters_present]
        bsrc = join(src, "base_layer")
        unit = Unit(src)
        merges: dict[str, Merge] = {}
        weight = dict(self.g.module_params(base)).get("weight")
        if active and weight is not None:
            if id(weight) in self.seen_params:
                raise UnsupportedAdapterError(
                    f"module {src!r} adapts a weight tied to {self.seen_params[id(weight)]!r}, which comes earlier "
                    "in the model and is streamed unmerged; peft's merge would change both"
                )
            if is_lora:
                merges.update(self._lora_merges(layer, base, active, src))
            else:
                merges["weight"] = DeltaMerge(weight, layer, active, self._adapter_params(layer, active))
        self._own_params(base, hf, bsrc, unit, merges)
        self._emit(unit)
        for cname, child in base._modules.items():
            if child is not None:
                self.visit(child, join(hf, cname), join(bsrc, cname))

    def _lora_merges(self, layer: Any, base: Any, active: list[str], src: str) -> dict[str, Merge]:
        from peft.tuners.lora import variants

        embedding = isinstance(layer, self.cls["lora_embedding"])
        dora_kinds = (variants.DoraLinearVariant, variants.DoraEmbeddingVariant)
        terms: list[LoraTerm] = []
        bias_terms: list[tuple[ParamRef, float]] = []
        param = self._param
        fan_in_fan_out = bool(getattr(layer, "fan_in_fan_out", False))
        for a in active:
            variant = getattr(layer, "lora_variant", {}).get(a)
            if variant is not None and not isinstance(variant, dora_kinds):
                raise UnsupportedAdapterError(
                    f"module {src!r} adapter {a!r} uses the LoRA variant {type(variant).__name__}; only plain LoRA, "
                    "rsLoRA and DoRA are merged"
                )
            magnitude = param(layer.lora_magnitude_vector[a], "weight") if variant is not None else None
            scaling = float(layer.scaling[a])
            if embedding:
                # delta = (B @ A).T = A.T @ B.T, with A: [r, num_embeddings], B: [dim, r].
                terms.append(
                    LoraTerm(
                        param(layer.lora_embedding_A, a),
                        param(layer.lora_embedding_B, a),
                        scaling,
                        left_transposed=True,
                        right_transposed=True,
                        magnitude=magnitude,
                    )
                )
            else:
                a_w, b_w = param(layer.lora_A[a], "weight"), param(layer.lora_B[a], "weight")
                if fan_in_fan_out:  # base is [in, out]: delta = (B @ A).T = A.T @ B.T
                    terms.append(LoraTerm(a_w, b_w, scaling, True, True, magnitude))
                else:
                    terms.append(LoraTerm(b_w, a_w, scaling, False, False, magnitude))
                if layer.lora_bias.get(a, False):
                    if "bias" not in dict(self.g.module_params(base)):
                        raise UnsupportedAdapterError(
                            f"module {src!r} adapter {a!r} has lora_bias=True but the base layer has no bias"
                        )
                    bias_terms.append((param(layer.lora_B[a], "bias"), scaling))
        # DoRA's per-channel norm runs over output channels: rows of nn.Linear's [out, in], columns of Conv1D's
        # [in, out] and of an embedding's [num_embeddings, dim] (peft's DoraEmbeddingLayer uses fan_in_fan_out=True).
        has_dora = any(t.magnitude is not None for t in terms)
        channel_dim = 1 if has_dora and (embedding or fan_in_fan_out) else 0
        merges: dict[str, Merge] = {
            "weight": LoraWeightMerge(param(base, "weight"), terms, channel_dim, self.block_bytes)
        }
        if bias_terms:
            merges["bias"] = LoraBiasMerge(param(base, "bias"), bias_terms)
        return merges

    def _param(self, module: nn.Module, name: str) -> ParamRef:
        """A parameter of ``module`` as the gatherer refers to it, looking through wrappers (FSDP1 may wrap each
        LoRA factor in a unit of its own)."""
        while (attr := wrapped_child_attr(module)) is not None:
            module = module._modules[attr]  # type: ignore[assignment]
        return self.g.param(module, name)

    def _adapter_params(self, layer: Any, adapters: list[str]) -> list[ParamRef]:
        """Every parameter of the given adapters, for a merge (``get_delta_weight``) that reads them itself."""
        out: list[ParamRef] = []
        for attr in getattr(layer, "adapter_layer_names", ()):
            container = getattr(layer, attr, None)
            if not isinstance(container, (nn.ModuleDict, nn.ParameterDict)):
                continue
            for a in adapters:
                if a not in container:
                    continue
                if isinstance(container, nn.ParameterDict):
                    out.append(self._param(container, a))
                else:
                    out += [p for m in container[a].modules() for _, p in self.g.module_params(m)]
        return out


def _adapter_keys(layer: Any) -> list[str]:
    keys: list[str] = []
    for attr in getattr(layer, "adapter_layer_names", ()):
        container = getattr(layer, attr, None)
        if isinstance(container, (nn.ModuleDict, nn.ParameterDict, dict)):
            keys += [k for k in container.keys() if k not in keys]
    return keys


def _check_peft_model(module: nn.Module, src: str) -> None:
    config = getattr(module, "active_peft_config", None) if hasattr(module, "peft_config") else None
    if config is not None and getattr(config, "is_prompt_learning", False):
        raise UnsupportedAdapterError(
            f"model {src or '<root>'!r} uses the prompt-learning method {config.peft_type}; it has no weights to "
            "merge into the base model"
        )


def plan_model(
    model: nn.Module, *, gatherer: Gatherer, dtype: torch.dtype | None, normalizer: NameNormalizer, block_bytes: int
) -> tuple[list[Unit], dict[str, str]]:
    """Plan the stream of ``model``: one :class:`Unit` per module that has output tensors, in registration order,
    and the tied aliases (name not yielded -> name of the tensor it shares)."""
    planner = _Planner(gatherer, dtype, normalizer, block_bytes)
    planner.visit(model, "", "")
    return planner.units, planner.aliases
