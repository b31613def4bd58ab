"""``AdapterStream``: only the active LoRA adapter's factors, under peft's adapter-checkpoint names, group by group.

After a LoRA step only the adapter changed. An inference engine that serves the frozen base with a LoRA adapter
(vLLM's ``enable_lora``) needs just the factors: for r=16 on every linear layer of a 0.25 B model about 10 MB
instead of the whole merged model, and under ZeRO-3 or FSDP2 the base weights are never gathered (FSDP1 unshards
whole FSDP units, base weights included).

What the stream yields is a plain peft adapter checkpoint, the tensors ``save_pretrained`` writes into
``adapter_model.safetensors``: ``base_model.model.<module>.lora_A.weight`` (``[r, in]``) and
``base_model.model.<module>.lora_B.weight`` (``[out, r]``), with one difference that makes the engine's product
exact: each ``lora_B`` comes **with its layer's scaling folded in** (``scaling * B``, computed in float32 and
rounded once), and :meth:`AdapterStream.adapter_config` gives every module ``lora_alpha`` equal to its rank (scaling
1; a module whose rank is not the largest through ``rank_pattern`` / ``alpha_pattern``). The engine then applies
exactly the ``scaling * B @ A`` the trainer's forward applies, whatever peft computed the scaling from
(``lora_alpha / r``, rsLoRA, ``rank_pattern`` / ``alpha_pattern``, ``set_scale``), and it never has to reinterpret
peft's scaling rules. Loading the tensors with that config into peft gives the trainer's forward.

Exact or refused: only plain LoRA on linear layers (``nn.Linear``, GPT-2's ``Conv1D``) is streamed. QLoRA bases,
DoRA, ``lora_bias``, LoRA on embeddings, convolutions or MoE expert parameters, LoHa, LoKr, ``modules_to_save`` for
an active adapter, trainable tokens (``trainable_token_indices``), several active adapters, or none, are refused
at construction with :class:`~lora_stream.UnsupportedAdapterError`; stream those models merged
(:class:`~lora_stream.ParamStream`).
"""

from __future__ import annotations

import enum
import math
import re
from typing import Any

import torch
from torch import nn

from .base_weights import is_quantized
from .core import Output, Step, Target, Unit
from .errors import UnsupportedAdapterError
from .gatherers import Gatherer
from .gatherers.base import KEEP_BYTES
from .grouping import DEFAULT_BUDGET_BYTES, GroupBy
from .merge import DEFAULT_MERGE_BLOCK_BYTES, ScaledFactor
from .names import join
from .plan import Planner, active_adapters, check_unmerged
from .rules import lora_spec, rule_for
from .stream import ParamStream
from .witness import PlanWitness

__all__ = ["ADAPTER_PREFIX", "AdapterStream"]

#: peft's adapter checkpoints name every tensor under the ``PeftModel``'s ``base_model.model``.
ADAPTER_PREFIX = "base_model.model."

_USE_MERGED = "stream this model merged (ParamStream) instead"


class _AdapterPlanner(Planner):
    """The merged stream's walk (through :class:`~lora_stream.plan.Planner`'s seam), emitting only each LoRA
    layer's two factors; base weights are never touched (``base_weights=False``)."""

    def __init__(self, gatherer: Gatherer, dtype: torch.dtype | None, witness: PlanWitness | None = None) -> None:
        super().__init__(gatherer, dtype, DEFAULT_MERGE_BLOCK_BYTES, buffers=False, base_weights=False, witness=witness)
        self.adapters: set[str] = set()
        #: module path in the base model (the checkpoint name without ``base_model.model.``) -> its LoRA rank.
        self.ranks: dict[str, int] = {}
        #: leaf module names with a LoRA, for the config's ``target_modules``.
        self.leaves: set[str] = set()

    def visit_wrapper(self, wrapper: Any, hf: str, src: str) -> None:
        mts = self.cls["mts"]
        if not isinstance(wrapper, mts):
            # Trainable tokens (TrainableTokensWrapper) or a wrapper peft adds later: it changes base weights (rows
            # of an embedding) in a way an adapter-serving engine does not take, whichever adapter it belongs to.
            what = "trainable tokens (trainable_token_indices)" if "TrainableTokens" in type(wrapper).__name__ else ""
            raise UnsupportedAdapterError(
                f"module {src!r} is a {type(wrapper).__name__}{f' ({what})' if what else ''}: it replaces base "
                f"weights, which an adapter-serving engine does not take; {_USE_MERGED}"
            )
        if not wrapper.disable_adapters and any(a in wrapper.modules_to_save for a in wrapper.active_adapters):
            raise UnsupportedAdapterError(
                f"module {src!r} is a {type(wrapper).__name__} of the active adapter (modules_to_save): it "
                f"replaces base weights, which an adapter-serving engine does not take; {_USE_MERGED}"
            )
        original = getattr(wrapper, "original_module", None)
        if original is not None:
            self.visit(original, hf, join(src, "original_module"))

    def visit_tuner(self, layer: Any, hf: str, src: str) -> None:
        check_unmerged(layer, src)
        rule = rule_for(layer, src)  # an unknown tuner layer is refused here, as in the merged stream
        active = active_adapters(layer)
        if not active:
            return
        if rule.family != "lora" or rule.layout != "linear":
            what = (
                "LoRA on parameters (target_parameters)"
                if rule.layout == "param"
                else f"{rule.family} on a {type(layer).__name__} layer"
            )
            raise UnsupportedAdapterError(
                f"module {src!r}: {what}; adapter sync streams plain LoRA on linear layers only; {_USE_MERGED}"
            )
        if len(active) > 1:
            raise UnsupportedAdapterError(
                f"module {src!r} applies several adapters {active}; an engine serves one adapter per request; "
                f"{_USE_MERGED}"
            )
        base = layer.get_base_layer()
        if is_quantized(base):
            raise UnsupportedAdapterError(
                f"module {src!r}: LoRA on a quantized base (QLoRA). The trainer's forward adds the adapter to the "
                "quantized weight, an adapter engine to the base it serves; that they agree is not verified; "
                f"{_USE_MERGED} (it streams the dequantized merge)"
            )
        a = active[0]
        spec = lora_spec(rule, layer, a, src, base_has_bias="bias" in dict(self.gatherer.module_params(base)))
        if spec.dora or spec.bias:
            feature = "DoRA" if spec.dora else "lora_bias"
            raise UnsupportedAdapterError(
                f"module {src!r} adapter {a!r} uses {feature}, which vLLM's LoRA layers do not compute; {_USE_MERGED}"
            )
        scaling = float(layer.scaling[a])
        if not math.isfinite(scaling):
            raise UnsupportedAdapterError(f"module {src!r} adapter {a!r} has scaling {scaling}")
        self.adapters.add(a)
        a_ref = self.param(layer.lora_A[a], "weight")
        b_ref = self.param(layer.lora_B[a], "weight")
        prefix = ADAPTER_PREFIX + hf
        unit = Unit(src)
        targets = [
            self.target(f"{prefix}.lora_A.weight", join(src, f"lora_A.{a}.weight"), a_ref, None),
            self.target(
                f"{prefix}.lora_B.weight",
                join(src, f"lora_B.{a}.weight"),
                b_ref,
                ScaledFactor(b_ref, scaling) if scaling != 1.0 else None,
            ),
        ]
        rank = int(self.gatherer.full_shape(a_ref)[0])
        if any(t.dtype not in (torch.float32, torch.bfloat16, torch.float16) for t in targets):
            raise UnsupportedAdapterError(f"module {src!r} adapter {a!r} has non-float factors")
        unit.targets, unit.params = targets, [a_ref, b_ref]
        self.ranks[hf] = rank
        self.leaves.add(hf.rsplit(".", 1)[-1])
        self.emit(unit)


class AdapterStream(ParamStream):
    """The active LoRA adapter of a peft model as ``(name, tensor)`` pairs of its adapter checkpoint, one group of
    LoRA modules at a time; the base model's weights are never gathered, read or yielded.

    >>> sink = VLLMLoRASink(llm, lora_name="policy")  # doctest: +SKIP
    >>> record = sink.sync(AdapterStream(model), version=f"step-{step}")  # every trainer rank
    >>> out = llm.generate(["t5 t17 t42"], greedy, lora_request=record.lora_request, use_tqdm=False)

    Everything :class:`~lora_stream.ParamStream` promises holds (metadata without communication, groups, lockstep
    across ranks, read-only, early stop), with these outputs instead of the merged model's:

    * names are peft's adapter-checkpoint names, ``base_model.model.<module>.lora_A.weight`` and ``.lora_B.weight``,
      with ``<module>`` the module's path in the base model (as in ``named_modules()``, wrappers dropped);
    * ``lora_A`` as trained; ``lora_B`` multiplied by its layer's scaling (in float32, rounded once to ``dtype``),
      so that :meth:`adapter_config`'s scaling of 1 reproduces the trainer's forward exactly;
    * ``dtype`` (default: each factor's own, usually float32) is the output dtype of both factors.

    Args:
        model: a ``PeftModel`` (or one wrapped by DDP, DeepSpeed, FSDP, ``torch.compile``) with exactly one active
            LoRA adapter.
        dtype: output dtype of both factors (default: each factor's own).
        gatherer: as for :class:`~lora_stream.ParamStream`. The ZeRO-3 or FSDP2 gatherer this stream builds
            itself (``None``) keeps its gather buffers between syncs when they hold at most
            :data:`~lora_stream.gatherers.base.KEEP_BYTES` (64 MiB; ``keep_bytes``); ``close()`` frees them.
        group_by: as for :class:`~lora_stream.ParamStream`, but ``"budget"`` by default: the factors are small,
            so one group holds many layers' and a sync makes few all-gathers.
        budget_bytes: as for :class:`~lora_stream.ParamStream`, counting the factors only.
        timeout: as for :class:`~lora_stream.ParamStream`.
        measure_rss: as for :class:`~lora_stream.ParamStream`.

    Raises:
        UnsupportedAdapterError: the model has no active LoRA adapter, or one this stream refuses (see the module
            documentation): before anything is gathered.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        dtype: torch.dtype | None = None,
        gatherer: Gatherer | None = None,
        group_by: GroupBy = "budget",
        budget_bytes: int = DEFAULT_BUDGET_BYTES,
        timeout: float = 300.0,
        measure_rss: bool = False,
    ) -> None:
        self._config: dict[str, Any] = {}
        self.adapter_name = ""
        super().__init__(
            model,
            dtype=dtype,
            gatherer=gatherer,
            group_by=group_by,
            budget_bytes=budget_bytes,
            timeout=timeout,
            measure_rss=measure_rss,
            layout="memory",
        )
        if gatherer is None and getattr(self.gatherer, "keep_bytes", None) == 0:
            # An adapter's buffers are small (its factors gathered, plus staging): keeping them between syncs spares
            # faulting their pages in again every sync. Counted by held_bytes() and last_stats.kept_bytes between
            # passes; freed by close().
            self.gatherer.keep_bytes = KEEP_BYTES  # type: ignore[attr-defined]

    def _plan(
        self, model: nn.Module, dtype: torch.dtype | None, renames: Any, block_bytes: int, layout: Any
    ) -> tuple[list[Unit], dict[str, str]]:
        planner = _AdapterPlanner(self.gatherer, dtype, self._witness)
        planner.visit(model, "", "")
        if not planner.units:
            raise UnsupportedAdapterError(
                "the model has no active LoRA adapter on any layer (adapters disabled, or not a peft model): "
                "there is nothing to sync as an adapter"
            )
        if len(planner.adapters) != 1:
            raise UnsupportedAdapterError(
                f"layers apply different adapters {sorted(planner.adapters)}; an engine serves one adapter per "
                f"request; {_USE_MERGED}"
            )
        self.adapter_name = next(iter(planner.adapters))
        self._config = _engine_config(model, self.adapter_name, planner.ranks, sorted(planner.leaves))
        for u in planner.units:
            u.steps = [_plain_step(t) for t in u.targets]
        return planner.units, {}

    def adapter_config(self) -> dict[str, Any]:
        """The ``adapter_config.json`` that goes with the tensors: the adapter's own peft configuration, with every
        module's ``lora_alpha`` equal to its rank (scaling 1: the scaling is in ``lora_B``) and ``use_rslora`` off.

        ``r == lora_alpha ==`` the largest rank; a module of a smaller rank (the trainer's ``rank_pattern``) is
        named in ``rank_pattern`` and ``alpha_pattern`` (both its rank) by its exact path, the checkpoint name
        without ``base_model.model.``, as peft's and vLLM's pattern matching read it. So loading the tensors with
        this config into peft (``PeftModel.from_pretrained``) reproduces the trainer's forward, and vLLM (0.32's
        ``PEFTHelper`` resolves the patterns the same way and checks the largest rank against ``max_lora_rank``)
        serves it. An engine that ignored the patterns would still apply scaling 1 everywhere (``lora_alpha / r``)
        and read each module's rank from its tensors. JSON-serializable. Options the engine must refuse
        (``use_dora``, ``init_lora_weights``, ...) are kept, so its own validation still sees them."""
        return dict(self._config)


def _plain_step(t: Target) -> Step:
    return Step([t], [Output(t.name, t.dtype, tuple(t.shape))])


def _peft_config(model: nn.Module, adapter: str) -> Any:
    for m in model.modules():
        configs = getattr(m, "peft_config", None)
        if isinstance(configs, dict) and adapter in configs:
            return configs[adapter]
    raise UnsupportedAdapterError(f"adapter {adapter!r} has no peft_config on the model")


def _engine_config(model: nn.Module, adapter: str, ranks: dict[str, int], leaves: list[str]) -> dict[str, Any]:
    config = _peft_config(model, adapter)
    if str(getattr(config, "peft_type", "")).removeprefix("PeftType.") != "LORA":
        raise UnsupportedAdapterError(f"adapter {adapter!r} is {config.peft_type}, not LoRA; {_USE_MERGED}")
    top = max(ranks.values())
    # Every module's scaling is in its lora_B, so every module must get lora_alpha == its rank. The modules whose
    # rank is not the largest say so through rank_pattern / alpha_pattern, one exact key per module: peft
    # (get_pattern_key) and vLLM (PEFTHelper.get_rank_and_scaling) both match a key K against a module's path as
    # the regex "(.*\.)?(K)$"; the path is escaped, and anchored where it is also the tail of another module's.
    patterns: dict[str, int] = {}
    for module, rank in ranks.items():
        if rank == top:
            continue
        key = re.escape(module)
        if any(other != module and other.endswith("." + module) for other in ranks):
            key = "^" + key
        patterns[key] = rank
    out: dict[str, Any] = _jsonable(config.to_dict())
    out.update(
        r=top,
        lora_alpha=top,
        use_rslora=False,
        rank_pattern=patterns,
        alpha_pattern=dict(patterns),
        target_modules=leaves,
        lora_dropout=0.0,
    )
    return out


def _jsonable(value: Any) -> Any:
    """peft's config as JSON types: sets as sorted lists, enums by value, anything else unknown as text."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (set, frozenset)):
        return sorted(_jsonable(v) for v in value)
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, enum.Enum):
        return _jsonable(value.value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)
