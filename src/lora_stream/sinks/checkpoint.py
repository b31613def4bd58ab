"""Write a merged Hugging Face checkpoint (sharded safetensors) from a stream, one group at a time, atomically.

Under ZeRO-3 or FSDP the usual ways to get a merged LoRA model on disk -- gather the whole model on one rank, merge,
``save_pretrained`` -- need the whole model in one process. :class:`SafetensorsSink` needs one group: every rank
iterates the stream (its gathers are collectives) and rank 0 writes each tensor straight into its shard file. The
shard plan, the index and every safetensors header are computed from ``metadata()`` before the first byte, so a
header is written first and the tensors follow as they arrive; no shard is ever held in memory.

The directory appears whole or not at all: everything is written into a temporary directory beside the target and
renamed at the end. A failure or a kill leaves the previous directory intact, or nothing under the final name.
"""

from __future__ import annotations

import copy
import json
import math
import os
import re
import shutil
import struct
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import torch
from torch import nn

from ..coordination import this_rank
from ..errors import LoraStreamError
from ..lockstep import describe_error
from ..stream import ParamMeta, ParamStream
from .record import SyncRecord
from .source import SyncSource

__all__ = ["CheckpointError", "SafetensorsSink", "ShardPlan", "plan_shards", "save_merged"]

#: safetensors' dtype names.
_ST_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})


class CheckpointError(LoraStreamError):
    """The checkpoint could not be written (target exists, disk full, ...); no partial checkpoint was left behind."""


def parse_size(size: int | str) -> int:
    """``5_000_000_000``, ``"5GB"`` (10**9) or ``"5GiB"`` (2**30), as ``save_pretrained`` reads ``max_shard_size``."""
    if isinstance(size, int):
        if size <= 0:
            raise ValueError(f"max_shard_size must be positive, got {size}")
        return size
    m = _SIZE.match(size)
    if not m:
        raise ValueError(f"max_shard_size {size!r} is not a size like 5GB, 500MiB or 1000000")
    return max(1, int(float(m.group(1)) * _UNITS[(m.group(2) or "").upper()]))


def _nbytes(m: ParamMeta) -> int:
    return math.prod(m.shape) * torch.empty((), dtype=m.dtype).element_size()


@dataclass(frozen=True)
class ShardPlan:
    """Which tensors go to which file, and every file's header, decided before the first byte is written."""

    files: list[str]
    members: list[list[int]]
    headers: list[bytes]
    total_size: int


def plan_shards(
    metadata: list[ParamMeta], max_shard_bytes: int, file_metadata: dict[str, str]
) -> tuple[ShardPlan, dict[str, str]]:
    """Cut ``metadata`` (in stream order) into shards of at most ``max_shard_bytes`` (a larger tensor gets a shard of
    its own, as ``save_pretrained`` does) and build each shard's safetensors header. Returns the plan and the
    index's weight map (``{}`` when there is one file, ``model.safetensors``)."""
    members: list[list[int]] = [[]]
    size = 0
    for i, m in enumerate(metadata):
        n = _nbytes(m)
        if members[-1] and size + n > max_shard_bytes:
            members.append([])
            size = 0
        members[-1].append(i)
        size += n
    if not members[-1]:
        members.pop()
    count = len(members)
    files = (
        ["model.safetensors"] if count <= 1 else [f"model-{k + 1:05d}-of-{count:05d}.safetensors" for k in range(count)]
    )
    headers: list[bytes] = []
    for idx in members or [[]]:
        header: dict[str, Any] = {"__metadata__": dict(file_metadata)}
        offset = 0
        for i in idx:
            m = metadata[i]
            if m.dtype not in _ST_DTYPES:
                raise CheckpointError(f"tensor {m.name!r} has dtype {m.dtype}, which safetensors cannot store")
            n = _nbytes(m)
            header[m.name] = {
                "dtype": _ST_DTYPES[m.dtype],
                "shape": list(m.shape),
                "data_offsets": [offset, offset + n],
            }
            offset += n
        raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
        headers.append(struct.pack("<Q", len(raw)) + raw)
    weight_map = {metadata[i].name: files[k] for k, idx in enumerate(members) for i in idx} if count > 1 else {}
    total = sum(_nbytes(m) for m in metadata)
    return ShardPlan(files, members or [[]], headers, total), weight_map


def _find_config(model: nn.Module) -> Any:
    """The trainer's base model's Hugging Face config (through PEFT, DeepSpeed, DDP, FSDP, compile wrappers)."""
    for module in model.modules():
        cfg = getattr(module, "config", None)
        if cfg is not None and hasattr(cfg, "to_json_string") and hasattr(cfg, "model_type"):
            return cfg
    return None


def _find_generation_config(model: nn.Module) -> Any:
    for module in model.modules():
        gen = getattr(module, "generation_config", None)
        if gen is not None and hasattr(gen, "save_pretrained"):
            return gen
    return None


def _merged_adapters(model: nn.Module) -> list[str]:
    for module in model.modules():
        if hasattr(module, "peft_config") and hasattr(module, "active_adapters"):
            active: Any = module.active_adapters
            return [str(a) for a in (active() if callable(active) else active)]
    return []


class SafetensorsSink:
    """Writes each sync's stream as a Hugging Face checkpoint directory: sharded safetensors, index, config.

    :func:`save_merged` builds one and runs it (docs/recipes/checkpoint.md).

    Implements :class:`~lora_stream.sinks.base.Sink`: every rank that iterates the stream calls ``sync``; rank 0
    writes. The guarantees, on top of the protocol's:

    * The directory is written in ``<parent>/.<name>.tmp-<id>`` and renamed into place at the end: a failure or a
      kill leaves the previous directory intact, or nothing under the final name. An existing directory is refused
      (before anything is gathered) unless ``overwrite=True``.
    * Memory: the stream's group, nothing more: each tensor goes straight into its shard file behind a header
      computed from ``metadata()``.
    * Tied weights: a name the stream does not yield because it is tied (``lm_head.weight``) is not written, as
      ``save_pretrained`` does, and ``config.json`` says ``tie_word_embeddings: true``; a separately trained
      ``lm_head`` on a tied model is written and the config says ``false`` (what peft's ``merge_and_unload`` does).

    Args:
        directory: the checkpoint directory to create.
        max_shard_size: largest shard, as ``save_pretrained`` takes it (``"5GB"`` = 5·10⁹ bytes, ``"5GiB"``, or an
            int); one tensor larger than that gets a shard of its own.
        overwrite: replace an existing directory (atomically: the old one is removed only after the new one is in
            place).
        config: the Hugging Face config to write (``None``: the trainer's base model config, found in the model;
            ``False``: none). Written on a copy with ``dtype`` set to what was written.
        tokenizer: anything with ``save_pretrained`` (a tokenizer or processor) to save beside the weights.
        generation_config: save the model's generation config when it has one.
        progress: a ``tqdm`` bar on rank 0 (``None``: only when stderr is a terminal).
        rank: this rank (``None``: ``torch.distributed``'s, or 0).
    """

    name = "safetensors"

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        max_shard_size: int | str = "5GB",
        overwrite: bool = False,
        config: Any = None,
        tokenizer: Any = None,
        generation_config: bool = True,
        progress: bool | None = None,
        rank: int | None = None,
    ) -> None:
        self.directory = Path(directory)
        self.max_shard_bytes = parse_size(max_shard_size)
        self.overwrite = overwrite
        self.config = config
        self.tokenizer = tokenizer
        self.generation_config = generation_config
        self.progress = progress
        self.rank = this_rank() if rank is None else rank
        #: Called by rank 0 after each tensor is written, with its name (a hook for tests and progress reporting).
        self.on_tensor: Callable[[str], None] | None = None

    @property
    def is_writer(self) -> bool:
        return self.rank == 0

    def sync(self, stream: ParamStream, *, version: str | None = None) -> SyncRecord:
        """Write one full pass of ``stream`` as the checkpoint; every rank calls it. ``version`` goes into the
        safetensors metadata."""
        start = time.perf_counter()
        coordinator = stream.coordinator
        source = SyncSource(stream, {}, version)
        meta = source.metadata()
        tmp: Path | None = None
        error: BaseException | None = None
        if self.is_writer:
            try:
                self._check_target()
                file_metadata = {"format": "pt", "merged_adapters": json.dumps(_merged_adapters(stream.model))}
                if version is not None:
                    file_metadata["version"] = version
                plan, weight_map = plan_shards(meta, self.max_shard_bytes, file_metadata)
                tmp = self._temp_dir()
            except BaseException as exc:
                error = exc
        coordinator.agree(error is None, "before writing the checkpoint (checks on rank 0)", describe_error(error))
        if error is not None:
            raise error
        try:
            if self.is_writer:
                assert tmp is not None
                self._write(source, meta, plan, tmp)
                self._finish(stream, meta, plan, weight_map, tmp)
            else:
                with source.batches() as batches:
                    for _ in batches:
                        pass  # the gathers are collectives: every rank produces the stream
        except BaseException as exc:
            error = exc
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
        # Tell every rank how it ended, unless the pass already did (it ended early on some rank).
        if not source.ended_early:
            coordinator.agree(error is None, "after writing the checkpoint", describe_error(error))
        if error is not None:
            raise error
        record = source.record(self.name, time.perf_counter() - start)
        record.log()
        return record

    def close(self) -> None:
        """Nothing is held between syncs."""

    # -- rank 0 ------------------------------------------------------------------------------------------------------
    def _check_target(self) -> None:
        if self.directory.exists() and not self.overwrite:
            raise CheckpointError(
                f"{self.directory} exists; pass overwrite=True to replace it (the old one is removed only once the "
                "new one is complete)"
            )
        if not self.directory.parent.exists():
            raise CheckpointError(f"the parent directory {self.directory.parent} does not exist")

    def _temp_dir(self) -> Path:
        tmp = self.directory.parent / f".{self.directory.name}.tmp-{uuid.uuid4().hex[:12]}"
        tmp.mkdir()
        return tmp

    def _bar(self, total: int) -> Any:
        show = self.progress if self.progress is not None else sys.stderr.isatty()
        if not show:
            return None
        from tqdm.auto import tqdm

        return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=f"saving {self.directory.name}")

    def _write(self, source: SyncSource, meta: list[ParamMeta], plan: ShardPlan, tmp: Path) -> None:
        shard_of = {i: k for k, idx in enumerate(plan.members) for i in idx}
        bar = self._bar(plan.total_size)
        handle: IO[bytes] | None = None
        current = -1
        index = 0
        try:
            with source.batches() as batches:
                for names, tensors in batches:
                    for name, tensor in zip(names, tensors):
                        m = meta[index]
                        if name != m.name or tuple(tensor.shape) != m.shape or tensor.dtype != m.dtype:
                            raise CheckpointError(
                                f"the stream yielded {name!r} {tuple(tensor.shape)} {tensor.dtype} where metadata() "
                                f"promised {m.name!r} {m.shape} {m.dtype}"
                            )
                        k = shard_of[index]
                        if k != current:
                            if handle is not None:
                                handle.close()
                            handle = open(tmp / plan.files[k], "wb")
                            handle.write(plan.headers[k])
                            current = k
                            if bar is not None:
                                bar.set_postfix_str(f"shard {k + 1}/{len(plan.files)}")
                        assert handle is not None
                        data = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
                        handle.write(data.data)
                        if bar is not None:
                            bar.update(data.nbytes)
                        if self.on_tensor is not None:
                            self.on_tensor(name)
                        index += 1
            if index != len(meta):
                raise CheckpointError(f"the stream yielded {index} tensors where metadata() promised {len(meta)}")
            if not meta:  # an empty stream still makes a loadable (empty) file
                (tmp / plan.files[0]).write_bytes(plan.headers[0])
        finally:
            if handle is not None:
                handle.close()
            if bar is not None:
                bar.close()

    def _finish(
        self, stream: ParamStream, meta: list[ParamMeta], plan: ShardPlan, weight_map: dict[str, str], tmp: Path
    ) -> None:
        if weight_map:
            index = {"metadata": {"total_size": plan.total_size}, "weight_map": weight_map}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        if self.config is not False:
            config = self.config if self.config is not None else _find_config(stream.model)
            if config is not None:
                config = copy.deepcopy(config)
                dtypes = [m.dtype for m in meta if m.dtype.is_floating_point]
                if dtypes:
                    written = max(set(dtypes), key=dtypes.count)
                    config.dtype = written  # transformers 5
                    if "torch_dtype" in vars(config):  # transformers 4 keeps it as a plain attribute
                        config.torch_dtype = written
                tied = bool(stream.tied_aliases())  # names not written because they share a written weight
                if hasattr(config, "tie_word_embeddings"):
                    config.tie_word_embeddings = tied
                    text = getattr(config, "text_config", None)
                    if text is not None and hasattr(text, "tie_word_embeddings"):
                        text.tie_word_embeddings = tied
                config.save_pretrained(str(tmp))
        if self.generation_config:
            gen = _find_generation_config(stream.model)
            if gen is not None:
                gen.save_pretrained(str(tmp))
        if self.tokenizer is not None:
            self.tokenizer.save_pretrained(str(tmp))
        self._publish(tmp)

    def _publish(self, tmp: Path) -> None:
        """Rename ``tmp`` into place. With ``overwrite``, the old directory moves aside first and is removed only
        after the new one is in place: at no moment is a partial checkpoint under the final name."""
        old: Path | None = None
        if self.directory.exists():
            if not self.overwrite:
                raise CheckpointError(f"{self.directory} appeared while saving; not replacing it")
            old = self.directory.parent / f".{self.directory.name}.old-{uuid.uuid4().hex[:12]}"
            os.replace(self.directory, old)
        os.replace(tmp, self.directory)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def save_merged(
    model_or_stream: nn.Module | ParamStream,
    directory: str | os.PathLike[str],
    *,
    max_shard_size: int | str = "5GB",
    overwrite: bool = False,
    dtype: torch.dtype | None = None,
    config: Any = None,
    tokenizer: Any = None,
    generation_config: bool = True,
    progress: bool | None = None,
    **stream_options: Any,
) -> SyncRecord:
    """Save the trainer's model, adapters merged, as a Hugging Face checkpoint directory; every rank calls it.

    >>> record = save_merged(  # doctest: +SKIP
    ...     model, out_dir, dtype=torch.bfloat16, max_shard_size="2GB", tokenizer=tokenizer, overwrite=True
    ... )

    ``model_or_stream`` is what :class:`~lora_stream.ParamStream` takes (a DeepSpeed engine, an FSDP model, a
    ``PeftModel``, ...) or a stream; ``dtype`` and ``stream_options`` build the stream. See
    :class:`SafetensorsSink` for the rest.
    """
    stream = (
        model_or_stream
        if isinstance(model_or_stream, ParamStream)
        else ParamStream(model_or_stream, dtype=dtype, **stream_options)
    )
    sink = SafetensorsSink(
        directory,
        max_shard_size=max_shard_size,
        overwrite=overwrite,
        config=config,
        tokenizer=tokenizer,
        generation_config=generation_config,
        progress=progress,
    )
    return sink.sync(stream)
