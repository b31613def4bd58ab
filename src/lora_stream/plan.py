"""Planning: walk the trainer's model once and decide, for every output tensor, its name, its sources and its merge.

The plan is built before the first tensor is produced, from module structure and shapes only (no parameter data
is read and nothing is communicated), so every unsupported adapter, name collision or bad rename is reported before
anything is sent to an inference engine.

The walk mirrors ``nn.Module.named_parameters()``: pre-order over registered children, a module's own parameters
before its children's, each module and each parameter object once. That makes the output order the model's
registration order and makes tied weights come out once, under the name ``named_parameters()`` gives them.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .base_weights import QUANTIZED_DEFAULT_DTYPE, BaseWeight, DenseWeight, base_weight_of
from .checkpoint_format import CheckpointFormat, Layout
from .core import Output, ParamRef, Step, Target, Unit
from .errors import NameCollisionError, UnsupportedAdapterError, UnsupportedModelError
from .merge import (
    DEFAULT_MERGE_BLOCK_BYTES,
    BufferRead,
    ExpertLoraMerge,
    LoraBiasMerge,
    LoraTerm,
    LoraWeightMerge,
    LycorisMerge,
    Merge,
)
from .names import NameNormalizer, join, wrapped_child_attr
from .rules import LayerRule, lora_spec, lycoris_spec, rule_for
from .witness import PlanWitness

if TYPE_CHECKING:
    from .gatherers.base import Gatherer

__all__ = ["Planner", "Target", "Unit", "active_adapters", "check_unmerged", "plan_model"]


def _peft_classes() -> dict[str, tuple[Any, ...]]:
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import AuxiliaryTrainingWrapper, ModulesToSaveWrapper

    return {"tuner": (BaseTunerLayer,), "aux": (AuxiliaryTrainingWrapper,), "mts": (ModulesToSaveWrapper,)}


class Planner:
    """The walk over a model that turns it into gather units (what :func:`plan_model` runs).

    ``visit(model, "", "")`` walks the module tree as ``named_parameters()`` does and fills :attr:`units` (and the
    tied :attr:`aliases`). By default it emits the merged model: every module's own parameters (and, with
    ``buffers``, its persistent buffers), each peft tuner layer's base weight merged with its active adapters.

    A stream that emits something else from the same walk (:class:`~lora_stream.AdapterStream`: only the LoRA
    factors) uses the documented seam instead of the walk's internals:

    * ``base_weights=False``: no module's own parameters or buffers are emitted, so the base model is never
      gathered or read; only what the hooks emit comes out.
    * :meth:`visit_tuner` (each peft tuner layer) and :meth:`visit_wrapper` (each peft ``AuxiliaryTrainingWrapper``:
      ``modules_to_save``, trainable tokens) may be overridden; a hook builds its outputs with :meth:`target`
      (name checks included), :meth:`param` (a parameter as the gatherer refers to it) and :meth:`emit`, and may
      continue the walk with :meth:`visit`.
    * :func:`active_adapters` and :func:`check_unmerged` read a tuner layer as the planner does.

    Args:
        gatherer: the stream's gatherer (shapes, dtypes and parameter refs come from it; nothing is communicated).
        dtype: output dtype of every target (``None``: each parameter's own).
        block_bytes: a merge's float32 block size.
        buffers: emit persistent buffers too (the checkpoint layout).
        base_weights: emit modules' own parameters and buffers (``False``: only what the hooks emit).
        witness: where the walk records what it read from the model (:class:`~lora_stream.witness.PlanWitness`), so
            that every pass can check it again; a fresh one by default (:attr:`witness`).
    """

    def __init__(
        self,
        gatherer: Gatherer,
        dtype: torch.dtype | None,
        block_bytes: int = DEFAULT_MERGE_BLOCK_BYTES,
        buffers: bool = False,
        *,
        base_weights: bool = True,
        witness: PlanWitness | None = None,
    ) -> None:
        self.g = gatherer
        #: Every fact the walk read from the model (structure, parameter objects and shapes, adapter state).
        self.witness = witness if witness is not None else PlanWitness()
        self.dtype = dtype
        self.block_bytes = block_bytes
        self.buffers = buffers
        self.base_weights = base_weights
        #: The first module that is not a wrapper: its state_dict() keys are the names the planner gives.
        self.root: nn.Module | None = None
        self.cls = _peft_classes()
        self.units: list[Unit] = []
        self.seen_modules: set[int] = set()
        self.seen_params: dict[int, str] = {}
        self.hf_names: dict[int, str] = {}
        self.names: dict[str, str] = {}
        self.aliases: dict[str, str] = {}
        #: Parameters an active adapter changes (id -> source name): a later module tied to one would be served the
        #: merged weight, which the trainer's forward never applies there.
        self.adapted_params: dict[int, str] = {}
        self._where = ""

    # -- outputs ---------------------------------------------------------------------------------------------------
    def target(self, hf: str, src: str, p: ParamRef, merge: Merge | None) -> Target:
        """A target named ``hf`` (checked unique), read from ``p`` (whose path in the model is ``src``) through
        ``merge`` (``None``: as gathered), in the planner's dtype; refuses parameters on the meta device."""
        if isinstance(p, torch.Tensor) and p.is_meta:
            raise UnsupportedModelError(
                f"parameter {src!r} is on the meta device; materialize the model (e.g. load its weights) before "
                "streaming it"
            )
        other = self.names.get(hf)
        if other is not None:
            raise NameCollisionError(f"parameters {other!r} and {src!r} are both named {hf!r}")
        self.names[hf] = src
        name = hf
        base = getattr(merge, "base", None)
        if isinstance(base, BaseWeight) and base.quantized:
            # A dequantized base has its logical shape, not its storage's, and no dtype of its own to keep.
            return Target(name, src, p, self.dtype or QUANTIZED_DEFAULT_DTYPE, base.shape, merge)
        out_dtype = self.dtype or self.g.full_dtype(p)
        return Target(name, src, p, out_dtype, self.g.full_shape(p), merge)

    def _base_weight(self, module: nn.Module, src: str) -> BaseWeight | None:
        """``module``'s weight as a merge reads it (dequantized if bitsandbytes stores it); ``None`` if it has none."""
        weight = dict(self.g.module_params(module)).get("weight")
        shape = self.g.full_shape(weight) if weight is not None else torch.Size()
        bw = base_weight_of(module, weight, shape, repr(src))
        if bw is None:
            return None
        if bw.quantized and self.g.collective:
            raise UnsupportedModelError(
                f"module {src!r} has a quantized base weight under the {self.g.name} gatherer; quantized (QLoRA) "
                "bases are streamed with the plain/DDP gatherer only"
            )
        return bw

    @property
    def gatherer(self) -> Gatherer:
        """The gatherer the plan is made for."""
        return self.g

    def _own_params(
        self, module: nn.Module, hf: str, src: str, unit: Unit, merges: dict[str, Merge] | None = None
    ) -> None:
        if not self.base_weights:
            return  # the seam's base_weights=False: module parameters and buffers are someone else's
        g = self.g
        self.witness.params(module, src, lambda: g.module_params(module), g.full_shape, g.full_dtype)
        adapted = set(merges or {})
        merges = dict(merges or {})
        if "weight" not in merges:
            bw = self._base_weight(module, src)
            if bw is not None and bw.quantized:  # a quantized layer without an adapter: dequantize it
                merges["weight"] = LoraWeightMerge(bw, [], 0, self.block_bytes)
        for pname, p in self.g.module_params(module):
            psrc = join(src, pname)
            if id(p) in self.seen_params:
                # Tied: named_parameters() reports it once, under its first name. Engines that keep the two
                # apart (vLLM on CPU repacks lm_head separately) need the alias, so remember it.
                alias = join(hf, pname)
                primary = self.hf_names.get(id(p))
                if id(p) in self.adapted_params:
                    raise UnsupportedAdapterError(
                        f"{psrc!r} is tied to {self.adapted_params[id(p)]!r}, which an adapter changes: peft applies "
                        "that adapter to its own module only (an embedding LoRA to the lookup), so the trainer's "
                        f"{src!r} keeps the base weight while an engine that ties them would serve the merged one. "
                        "Untie the weights (tie_word_embeddings=False and a separate copy saved), or leave the tied "
                        "module out of target_modules"
                    )
                if primary is not None and alias not in self.names:
                    self.aliases[alias] = primary
                continue
            self.seen_params[id(p)] = psrc
            if pname in adapted:
                self.adapted_params[id(p)] = psrc
            merge = merges.get(pname)
            target = self.target(join(hf, pname), psrc, p, merge)
            self.hf_names[id(p)] = target.name
            unit.targets.append(target)
            unit.params.extend(merge.params() if merge is not None else [p])
        if self.buffers:
            # What state_dict() (and so save_pretrained) holds besides parameters: persistent buffers.
            for bname, buf in module._buffers.items():
                if buf is None or bname in module._non_persistent_buffers_set or id(buf) in self.seen_params:
                    continue
                self.seen_params[id(buf)] = join(src, bname)
                name = join(hf, bname)
                if name in self.names:
                    raise NameCollisionError(f"buffer {join(src, bname)!r} and {self.names[name]!r} are both {name!r}")
                self.names[name] = join(src, bname)
                read = BufferRead(module, bname)
                unit.targets.append(Target(name, join(src, bname), None, buf.dtype, buf.shape, read))

    def emit(self, unit: Unit) -> None:
        """Append ``unit`` to the plan (one gather unit; dropped if it has no targets)."""
        if unit.targets:
            self.units.append(unit)

    # -- walk ------------------------------------------------------------------------------------------------------
    def visit(self, module: nn.Module, hf: str, src: str) -> None:
        """Walk ``module``, whose output name prefix is ``hf`` and path in the trainer's model ``src``."""
        if id(module) in self.seen_modules:
            return
        self.seen_modules.add(id(module))
        self.witness.module(module, src)
        self._where = src  # names the adapter factors param() reaches inside this module
        if isinstance(module, self.cls["tuner"]):
            self.witness.tuner(module, src)
            self.visit_tuner(module, hf, src)
            return
        if isinstance(module, self.cls["aux"]):
            self.witness.wrapper(module, src)
            self.visit_wrapper(module, hf, src)
            return
        _check_peft_model(module, src)
        if self.root is None and wrapped_child_attr(module) is None:
            self.root = module
        unit = Unit(src)
        self._own_params(module, hf, src, unit)
        self.emit(unit)
        wrapped = wrapped_child_attr(module)
        for cname, child in module._modules.items():
            if child is None:
                continue
            self.visit(child, hf if cname == wrapped else join(hf, cname), join(src, cname))

    def visit_wrapper(self, wrapper: Any, hf: str, src: str) -> None:
        """A peft ``AuxiliaryTrainingWrapper``: the merged stream follows the copy forward uses
        (``modules_to_save``) and refuses any other wrapper (trainable tokens). A hook of the seam."""
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

    def visit_tuner(self, layer: Any, hf: str, src: str) -> None:
        """A peft tuner layer: its base weights merged with its active adapters, checked against the rule table.
        A hook of the seam."""
        base = layer.get_base_layer()
        check_unmerged(layer, src)
        # The table decides, for every tuner layer, adapters active or not: an unknown layer is refused up front.
        rule = rule_for(layer, src)
        if rule.layout == "param":
            self._param_wrappers(layer, hf, src)
            return
        active = active_adapters(layer)
        bsrc = join(src, "base_layer")
        unit = Unit(src)
        merges: dict[str, Merge] = {}
        bw = self._base_weight(base, src)
        if active and bw is not None:
            if id(bw.param) in self.adapted_params:
                raise UnsupportedAdapterError(
                    f"module {src!r} and {self.adapted_params[id(bw.param)]!r} adapt one tied weight with two adapters "
                    "(peft's ensure_weight_tying): the trainer applies each to its own module, and one served tensor "
                    "cannot hold both; untie the weights (tie_word_embeddings=False) to stream this model"
                )
            if id(bw.param) in self.seen_params:
                raise UnsupportedAdapterError(
                    f"module {src!r} adapts a weight tied to {self.seen_params[id(bw.param)]!r}, which comes earlier "
                    "in the model and is streamed unmerged; peft's merge would change both"
                )
            if rule.family == "lora":
                merges.update(self._lora_merges(rule, layer, base, bw, active, src))
            else:
                specs = [lycoris_spec(rule, layer, a, src) for a in active]
                # sorted: every rank must gather the same parameters in the same order, and set order is per process
                factors = [
                    (sp.scaling, {k: self.param(getattr(layer, k), sp.adapter) for k in sorted(sp.keys)})
                    for sp in specs
                ]
                merges["weight"] = LycorisMerge(rule.family, bw, factors)
        self._own_params(base, hf, bsrc, unit, merges)
        self.emit(unit)
        for cname, child in base._modules.items():
            if child is not None:
                self.visit(child, join(hf, cname), join(bsrc, cname))

    def _param_wrappers(self, layer: Any, hf: str, src: str) -> None:
        """LoRA on parameters (``target_parameters``): one ``ParamWrapper`` per adapted parameter of the innermost
        module, nested through ``base_layer`` when a module has several (MoE experts' ``gate_up_proj`` and
        ``down_proj``)."""
        wrappers: list[tuple[Any, str, LayerRule]] = []
        module, msrc = layer, src
        while isinstance(module, self.cls["tuner"]):
            check_unmerged(module, msrc)
            rule = rule_for(module, msrc)
            if rule.layout != "param":
                raise UnsupportedAdapterError(
                    f"module {msrc!r} is a {type(module).__name__} nested inside a ParamWrapper; lora_stream merges "
                    "nested ParamWrappers only"
                )
            wrappers.append((module, msrc, rule))
            if module is not layer:  # the outermost one was recorded by visit()
                self.witness.module(module, msrc)
                self.witness.tuner(module, msrc)
            module, msrc = module.base_layer, join(msrc, "base_layer")
        own = dict(self.g.module_params(module))
        merges: dict[str, Merge] = {}
        for wrapper, wsrc, rule in wrappers:
            pname = wrapper.parameter_name
            param = own.get(pname)
            if param is None or pname in merges:
                raise UnsupportedAdapterError(
                    f"module {wsrc!r} adapts parameter {pname!r}, which its base module does not hold or another "
                    "ParamWrapper adapts too"
                )
            active = active_adapters(wrapper)
            if not active:
                continue
            psrc = join(msrc, pname)
            if id(param) in self.seen_params:
                tied = self.seen_params[id(param)]
                raise UnsupportedAdapterError(f"{psrc!r} is tied to {tied!r}; peft's merge would change both")
            shape = self.g.full_shape(param)
            if self.g.full_dtype(param) not in (torch.float32, torch.bfloat16, torch.float16):
                raise UnsupportedAdapterError(f"{psrc!r} is {self.g.full_dtype(param)}; only float weights are merged")
            terms = []
            for a in active:
                lora_spec(rule, wrapper, a, wsrc, base_has_bias=False)
                a_w, b_w = self.param(wrapper.lora_A[a], "weight"), self.param(wrapper.lora_B[a], "weight")
                terms.append((a_w, b_w, float(wrapper.scaling[a])))
            if len(shape) == 2:  # peft merges it as nn.Linear's [out, in]
                lora_terms = [LoraTerm(b, a, s, False, False) for a, b, s in terms]
                merges[pname] = LoraWeightMerge(DenseWeight(param, shape), lora_terms, 0, self.block_bytes)
            elif len(shape) == 3:
                transposed = not wrapper._did_swap_in_out_features
                if transposed and shape[0] == 1:
                    raise UnsupportedAdapterError(
                        f"{psrc!r} is one expert stored [1, in, out]; peft's own merge adds the delta in [out, in] "
                        "there, so there is no right answer to reproduce"
                    )
                merges[pname] = ExpertLoraMerge(param, shape, terms, transposed, self.block_bytes)
            else:
                raise UnsupportedAdapterError(f"{psrc!r} has {len(shape)} dimensions; peft adapts 2-D and 3-D only")
        unit = Unit(src)
        self._own_params(module, hf, msrc, unit, merges)
        # One unit per tensor: an MoE layer's fused expert weights are each as large as a dense layer, and each is
        # merged and converted on its own, so a byte budget may put them in different groups (a conversion that
        # reads several of them joins them again, see _join_conversions).
        for target in unit.targets:
            merge = target.merge
            self.emit(Unit(src, [target], merge.params() if merge is not None else [target.param]))
        for cname, child in module._modules.items():
            if child is not None:
                self.visit(child, join(hf, cname), join(msrc, cname))

    def _lora_merges(
        self, rule: LayerRule, layer: Any, base: Any, bw: BaseWeight, active: list[str], src: str
    ) -> dict[str, Merge]:
        embedding = rule.layout == "embedding"
        has_bias = "bias" in dict(self.g.module_params(base))
        terms: list[LoraTerm] = []
        bias_terms: list[tuple[ParamRef, float]] = []
        param = self.param
        fan_in_fan_out = bool(getattr(layer, "fan_in_fan_out", False))
        for a in active:
            spec = lora_spec(rule, layer, a, src, has_bias)
            magnitude = param(layer.lora_magnitude_vector[a], "weight") if spec.dora else None
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
                continue
            a_w, b_w = param(layer.lora_A[a], "weight"), param(layer.lora_B[a], "weight")
            if fan_in_fan_out:  # base is [in, out]: delta = (B @ A).T = A.T @ B.T
                terms.append(LoraTerm(a_w, b_w, scaling, True, True, magnitude))
            else:  # nn.Linear [out, in], and a convolution as the matrix [out, in * kernel]
                terms.append(LoraTerm(b_w, a_w, scaling, False, False, magnitude))
            if spec.bias:
                bias_terms.append((param(layer.lora_B[a], "bias"), scaling))
        # DoRA's per-channel norm runs over output channels: rows of nn.Linear's [out, in] and of a convolution's
        # [out, in * kernel], columns of Conv1D's [in, out] and of an embedding's [num_embeddings, dim] (peft's
        # DoraEmbeddingLayer uses fan_in_fan_out=True).
        has_dora = any(t.magnitude is not None for t in terms)
        channel_dim = 1 if has_dora and (embedding or fan_in_fan_out) else 0
        merges: dict[str, Merge] = {"weight": LoraWeightMerge(bw, terms, channel_dim, self.block_bytes)}
        if bias_terms:
            merges["bias"] = LoraBiasMerge(param(base, "bias"), bias_terms)
        return merges

    def param(self, module: nn.Module, name: str) -> ParamRef:
        """A parameter of ``module`` as the gatherer refers to it, looking through wrappers (FSDP1 may wrap each
        LoRA factor in a unit of its own)."""
        while (attr := wrapped_child_attr(module)) is not None:
            module = module._modules[attr]  # type: ignore[assignment]
        g = self.g
        ref = g.param(module, name)
        self.witness.param(module, name, self._where, lambda: g.param(module, name), g.full_shape, g.full_dtype)
        return ref


def check_unmerged(layer: Any, src: str) -> None:
    """Refuse a tuner layer whose adapters peft merged into its base weight in place."""
    if getattr(layer, "merged", False):
        raise UnsupportedModelError(
            f"module {src!r} has adapters {list(layer.merged_adapters)} merged into its base weight in place; "
            "call model.unmerge_adapter() first (lora_stream merges out of place and never needs merge_adapter)"
        )


def active_adapters(layer: Any) -> list[str]:
    """The adapters ``layer``'s forward applies (none while adapters are disabled)."""
    if layer.disable_adapters:
        return []
    present = set(_adapter_keys(layer))
    return [a for a in layer.active_adapters if a in present]


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
    model: nn.Module,
    *,
    gatherer: Gatherer,
    dtype: torch.dtype | None,
    normalizer: NameNormalizer,
    block_bytes: int,
    layout: Layout = "checkpoint",
    witness: PlanWitness | None = None,
) -> tuple[list[Unit], dict[str, str]]:
    """Plan the stream of ``model``: its units, in registration order, each with the :class:`Step` s that turn its
    targets into outputs, and the tied aliases (output name not yielded -> output name of the tensor it shares).
    What the walk read from the model is recorded in ``witness``."""
    if layout not in ("checkpoint", "memory"):
        raise ValueError(f"layout must be 'checkpoint' or 'memory', got {layout!r}")
    planner = Planner(gatherer, dtype, block_bytes, buffers=layout == "checkpoint", witness=witness)
    planner.visit(model, "", "")
    units = planner.units
    fmt = CheckpointFormat(planner.root if layout == "checkpoint" else None)
    if fmt.converts:
        ignored = set(getattr(planner.root, "_keys_to_ignore_on_save", None) or ())
        if ignored:  # save_pretrained drops these keys
            for u in units:
                u.targets = [t for t in u.targets if t.name not in ignored]
            units = [u for u in units if u.targets]
    units = _join_conversions(units, fmt)
    names: dict[str, str] = {}
    for u in units:
        for step in u.steps:
            sources = ", ".join(t.source for t in step.inputs)
            renamed = [Output(normalizer(o.name, sources), o.dtype, o.shape) for o in step.outputs]
            for o in renamed:
                if o.name in names:
                    other = names[o.name]
                    raise NameCollisionError(f"parameters {other!r} and {sources!r} both normalize to {o.name!r}")
                names[o.name] = sources
            step.outputs = renamed
    return units, _output_aliases(planner.aliases, units, fmt, normalizer)


def _join_conversions(units: list[Unit], fmt: CheckpointFormat) -> list[Unit]:
    """Give every unit its steps, joining consecutive units whose targets one conversion reads together (q, k and v
    concatenated into one checkpoint tensor), so that a conversion never straddles two groups."""
    where: dict[str, tuple[int, Target]] = {t.name: (i, t) for i, u in enumerate(units) for t in u.targets}
    fsteps = fmt.plan([Output(n, t.dtype, tuple(t.shape)) for n, (_, t) in where.items()])
    # Each unit index -> the last unit index it must travel with.
    reach = list(range(len(units)))
    for fs in fsteps:
        idx = [where[n][0] for n in fs.inputs]
        lo, hi = min(idx), max(idx)
        for i in range(lo, hi + 1):
            reach[i] = max(reach[i], hi)
    joined: list[Unit] = []
    owner: dict[int, Unit] = {}
    i = 0
    while i < len(units):
        end = reach[i]
        j = i
        while j <= end:
            end = max(end, reach[j])
            j += 1
        if end == i:
            unit = units[i]
        else:
            unit = Unit(units[i].module)
            for u in units[i : end + 1]:
                unit.targets += u.targets
                unit.params += u.params
        for k in range(i, end + 1):
            owner[k] = unit
        joined.append(unit)
        i = end + 1
    for fs in fsteps:
        inputs = [where[n][1] for n in fs.inputs]
        outputs = list(fs.outputs)
        convert = functools.partial(fmt.apply, fs) if fs.convert else None
        owner[where[fs.inputs[0]][0]].steps.append(Step(inputs, outputs, convert))
    return joined


def _output_aliases(
    aliases: dict[str, str], units: list[Unit], fmt: CheckpointFormat, normalizer: NameNormalizer
) -> dict[str, str]:
    """Tied aliases under output names. An alias whose tensor the checkpoint format converts (rather than
    renames) has no single tensor to stand for and is dropped; none of transformers' models ties such a weight."""
    out_of = {s.inputs[0].name: s.outputs[0].name for u in units for s in u.steps if s.convert is None}
    result: dict[str, str] = {}
    for alias, primary in aliases.items():
        if primary not in out_of:
            continue
        spec = Output(alias, torch.float32, ())
        steps = fmt.plan([spec])
        if len(steps) == 1 and not steps[0].convert:
            result[normalizer(steps[0].outputs[0].name, alias)] = out_of[primary]
    return result
