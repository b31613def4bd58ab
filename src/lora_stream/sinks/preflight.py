"""Pre-flight: compare a stream's metadata with the checkpoint an engine was started from, before touching it.

An engine that receives a name it does not know either raises half-way through an update (leaving some layers new
and some old) or, worse, ignores it silently. Both are caught here, from the safetensors headers alone (no tensor
data is read), and reported in one error that lists every problem.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import LoraStreamError
from ..stream_pass import ParamMeta

__all__ = [
    "CheckpointMismatchError",
    "CheckpointTensor",
    "EngineCheckpoint",
    "checkpoint_metadata",
    "adapter_preflight",
    "compare_with_checkpoint",
    "preflight",
]


class CheckpointMismatchError(LoraStreamError):
    """The stream does not fit the engine's checkpoint: unknown names, missing names or wrong shapes.

    Raised before anything is sent; the engine still serves the weights it had.
    """

    def __init__(
        self,
        message: str,
        *,
        unknown: list[str],
        missing: list[str],
        wrong_shape: list[tuple[str, tuple[int, ...], tuple[int, ...]]],
    ) -> None:
        super().__init__(message)
        self.unknown = unknown
        self.missing = missing
        self.wrong_shape = wrong_shape


@dataclass(frozen=True)
class CheckpointTensor:
    name: str
    dtype: str
    shape: tuple[int, ...]


def checkpoint_metadata(path: str | Path) -> dict[str, CheckpointTensor]:
    """Names, dtypes and shapes of every tensor in a Hugging Face safetensors checkpoint directory (headers only)."""
    from safetensors import safe_open

    root = Path(path)
    files = sorted(root.glob("*.safetensors")) if root.is_dir() else [root]
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {root}: the pre-flight check needs the checkpoint")
    out: dict[str, CheckpointTensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as handle:
            for name in handle.keys():
                sl = handle.get_slice(name)
                out[name] = CheckpointTensor(name, str(sl.get_dtype()), tuple(int(d) for d in sl.get_shape()))
    return out


def tied_output_names(path: str | Path) -> set[str]:
    """Names a checkpoint may omit because the model ties them (``tie_word_embeddings``: ``lm_head.weight``)."""
    cfg_path = Path(path) / "config.json" if Path(path).is_dir() else Path(path).parent / "config.json"
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, ValueError):
        return set()
    text = cfg.get("text_config", cfg)
    tie = cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    return {"lm_head.weight"} if tie else set()


def compare_with_checkpoint(
    metadata: Iterable[ParamMeta],
    checkpoint: Mapping[str, CheckpointTensor],
    *,
    may_be_missing: Iterable[str] = (),
    extra_names: Mapping[str, str] | None = None,
) -> None:
    """Raise :class:`CheckpointMismatchError` listing every name the checkpoint lacks, every checkpoint name the
    stream does not produce (except ``may_be_missing``) and every shape that differs.

    ``extra_names`` maps aliases the sink sends besides the stream's own names (tied weights) to their source.
    """
    shapes = {m.name: tuple(m.shape) for m in metadata}
    for alias, primary in (extra_names or {}).items():
        if primary in shapes:
            shapes[alias] = shapes[primary]
    optional = set(may_be_missing) | set(extra_names or {})
    unknown = [n for n in shapes if n not in checkpoint and n not in optional]
    missing = [n for n in checkpoint if n not in shapes and n not in optional]
    wrong = [(n, s, checkpoint[n].shape) for n, s in shapes.items() if n in checkpoint and checkpoint[n].shape != s]
    if unknown or missing or wrong:
        parts = []
        if unknown:
            parts.append(f"{len(unknown)} name(s) the checkpoint does not have: {unknown[:20]}")
        if missing:
            parts.append(f"{len(missing)} checkpoint name(s) the stream does not produce: {missing[:20]}")
        if wrong:
            parts.append(f"{len(wrong)} shape mismatch(es) (name, stream, checkpoint): {wrong[:20]}")
        raise CheckpointMismatchError(
            "the stream does not match the engine's checkpoint; nothing was sent. " + "; ".join(parts),
            unknown=unknown,
            missing=missing,
            wrong_shape=wrong,
        )


@dataclass(frozen=True)
class EngineCheckpoint:
    """What the pre-flight knows of the checkpoint an engine was started from: its tensors' names, dtypes and shapes
    (safetensors headers) and the names its config ties to the input embedding."""

    path: str
    tensors: dict[str, CheckpointTensor]
    tied: frozenset[str] = field(default_factory=frozenset)

    @classmethod
    def read(cls, path: str | Path) -> EngineCheckpoint:
        return cls(str(path), checkpoint_metadata(path), frozenset(tied_output_names(path)))


def preflight(
    metadata: Iterable[ParamMeta], tied_aliases: Mapping[str, str], checkpoint: EngineCheckpoint
) -> dict[str, str]:
    """The one pre-flight of every vLLM sink; returns the tied aliases to send besides the stream's own tensors.

    Called by the sink (on the rank that talks to the engine) before anything reaches the engine. Raises
    :class:`CheckpointMismatchError` when

    * the checkpoint ties a name (``lm_head.weight``) to the embedding but the stream yields it as a tensor of its own
      (``modules_to_save=["lm_head"]`` on a tied model): the engine would serve one of the two for both;
    * a name is unknown to the checkpoint, a checkpoint name is not produced, or a shape differs.

    Aliases: a name the stream does not yield because its weight is tied to one it does (``tied_aliases()``) is sent
    under both names when the checkpoint has it or ties it: vLLM on CPU keeps a tied ``lm_head`` as a separately
    repacked copy that must be reloaded too.
    """
    meta = list(metadata)
    names = {m.name for m in meta}
    aliases = {a: p for a, p in tied_aliases.items() if a in checkpoint.tensors or a in checkpoint.tied}
    distinct_tied = sorted(n for n in checkpoint.tied if n in names)
    if distinct_tied:
        raise CheckpointMismatchError(
            f"the engine's checkpoint ties {distinct_tied} to the input embedding, but the stream yields them as "
            "separate tensors (e.g. modules_to_save on lm_head); the engine cannot serve that. Start vLLM from a "
            "checkpoint whose config has tie_word_embeddings=false.",
            unknown=[],
            missing=[],
            wrong_shape=[],
        )
    compare_with_checkpoint(meta, checkpoint.tensors, may_be_missing=checkpoint.tied, extra_names=aliases)
    return aliases


def adapter_preflight(metadata: Iterable[ParamMeta], checkpoint: EngineCheckpoint, prefix: str) -> None:
    """The pre-flight of an adapter sync: every LoRA pair ``<prefix><module>.lora_A.weight`` (``[r, in]``) and
    ``.lora_B.weight`` (``[out, r]``) must adapt a weight ``<module>.weight`` of shape ``[out, in]`` in the engine's
    checkpoint. Raises :class:`CheckpointMismatchError` listing every module that does not, before anything is
    gathered or sent."""
    shapes = {m.name: tuple(m.shape) for m in metadata}
    unknown: list[str] = []
    wrong: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = []
    for name, a_shape in shapes.items():
        if not name.endswith(".lora_A.weight"):
            continue
        module = name[len(prefix) : -len(".lora_A.weight")]
        b_shape = shapes.get(name.replace(".lora_A.weight", ".lora_B.weight"))
        base = checkpoint.tensors.get(f"{module}.weight")
        if base is None or b_shape is None:
            unknown.append(f"{module}.weight")
            continue
        expected = (b_shape[0], a_shape[1])
        if base.shape != expected:
            wrong.append((f"{module}.weight", expected, base.shape))
    if unknown or wrong:
        parts = []
        if unknown:
            parts.append(f"{len(unknown)} adapted weight(s) the checkpoint does not have: {unknown[:20]}")
        if wrong:
            parts.append(f"{len(wrong)} shape mismatch(es) (weight, adapter's [out, in], checkpoint): {wrong[:20]}")
        raise CheckpointMismatchError(
            "the adapter does not fit the engine's checkpoint; nothing was sent. " + "; ".join(parts),
            unknown=unknown,
            missing=[],
            wrong_shape=wrong,
        )
