"""Write a merged Hugging Face checkpoint (sharded safetensors) from a stream, one group at a time, atomically; or,
from an :class:`~lora_stream.AdapterStream`, the adapter in peft's layout.

Under ZeRO-3 or FSDP the usual ways to get a merged LoRA model on disk -- gather the whole model on one rank, merge,
``save_pretrained`` -- need the whole model in one process. :class:`SafetensorsSink` needs one group: every rank
iterates the stream (its gathers are collectives) and rank 0 writes each tensor straight into its shard file. The
shard plan, the index and every safetensors header are computed from ``metadata()`` before the first byte, so a
header is written first and the tensors follow as they arrive; no shard is ever held in memory. The plan and the
headers are :mod:`~lora_stream.sinks.safetensors_shards`'s; the renames and fsyncs below are
:mod:`~lora_stream.sinks.durable_files`'s.

Publishing (rank 0), the contract:

* Everything is written into ``<parent>/.<name>.tmp-<12 hex>`` and fsynced there (every file, then the directory)
  before anything is renamed; after the rename the parent directory is fsynced.
* Nothing is renamed before every rank voted that its side succeeded (its pass, and rank 0's writing); after the
  publish the ranks vote once more, so that a failure of the publish raises on every rank too.
* On Linux the checkpoint is published by one ``renameat2`` call: ``RENAME_EXCHANGE`` when the target exists (the
  new and the old copy swap names in one step; the old one, now under the temporary name, is removed afterwards),
  ``RENAME_NOREPLACE`` when it does not. The target name therefore always holds a whole checkpoint, old or new, at
  every instant, a ``SIGKILL`` at any step included (after a machine crash, the filesystem's own rename atomicity
  applies to data that is already on disk).
* Where ``renameat2`` is unavailable (not Linux, an old C library, or a filesystem answering ``EINVAL``/``ENOSYS``),
  or with the environment variable ``LORA_STREAM_NO_RENAME_EXCHANGE=1`` (a test and debug knob), the old copy is
  renamed to ``<parent>/.<name>.old-<12 hex>`` and the new one into place: a kill between those two renames leaves
  nothing under the target name, and the next save into the same target moves the old copy back first.
* The next save into a target finds what a killed save left beside it (entries named exactly
  ``.<name>.tmp-<12 hex>`` or ``.<name>.old-<12 hex>``, nothing else), recovers or removes them before anything else
  and says so in one log line (logger ``lora_stream``, ``WARNING``). One save at a time per target: a second,
  concurrent save into the same target would remove the first one's temporary directory.
* Any failure removes the temporary directory (including a failure of the ranks' agreement before writing); one
  before the publishing rename, on any rank, leaves the target as it was.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import os
import re
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import torch
from torch import nn

from ..adapter import AdapterStream
from ..coordination import this_rank
from ..errors import CheckpointError
from ..reporting import progress_bar
from ..stream import ParamStream
from ..stream_pass import ParamMeta
from ..transaction import Transaction, fault_point
from .durable_files import NO_RENAME_EXCHANGE_ENV as NO_RENAME_EXCHANGE_ENV
from .durable_files import (
    RENAME_EXCHANGE,
    RENAME_NOREPLACE,
    fsync_dir,
    fsync_tree,
    remove_path,
    rename_noreplace,
    renameat2,
    renameat2_enabled,
    tree_size,
)
from .record import SyncRecord
from .safetensors_shards import ShardPlan, is_whole, parse_size, plan_shards
from .source import SyncSource

__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
    "CheckpointError",
    "SafetensorsSink",
    "ShardPlan",
    "plan_shards",
    "save_merged",
]

logger = logging.getLogger("lora_stream")

#: The suffix of a leftover beside target ``name``: ``.{name}.tmp-<id>`` (being written, or, after an exchange, the
#: old copy being removed) or ``.{name}.old-<id>`` (the old copy, moved aside by the fallback).
_LEFTOVER = re.compile(r"(tmp|old)-[0-9a-f]{12}")

#: What peft's ``save_pretrained`` writes for an adapter, and the only names ``PeftModel.from_pretrained`` loads.
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


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

    :func:`save_merged` builds one and runs it (docs/checkpoint.md).

    Implements :class:`~lora_stream.sinks.base.Sink`: every rank that iterates the stream calls ``sync``; rank 0
    writes. The guarantees, on top of the protocol's:

    * Before anything is gathered, rank 0 checks the target (an existing one is refused unless ``overwrite=True``;
      a missing, non-directory or unwritable parent is refused) and creates the temporary directory
      ``<parent>/.<name>.tmp-<id>``; every rank learns the outcome, so a refusal is a :class:`CheckpointError` on
      rank 0 and a :class:`~lora_stream.StreamAbortedError` naming it on the others.
    * Atomic: the checkpoint is written and fsynced (each file, then the directory) in the temporary directory;
      every rank votes; only if every rank succeeded is it published, by one ``renameat2`` (``RENAME_EXCHANGE``
      over an existing target, directory or regular file; ``RENAME_NOREPLACE`` otherwise), and the parent directory
      fsynced; the old copy is removed only after that. A second vote carries the publish's outcome, so a failure
      there raises on every rank. At every instant, a ``SIGKILL`` included, the target name holds a whole
      checkpoint, old or new. Where ``renameat2`` is unavailable (or ``LORA_STREAM_NO_RENAME_EXCHANGE=1``), the old
      copy is renamed to ``.<name>.old-<id>`` first: a kill between the two renames leaves the target name empty
      until the next save.
    * Leftovers: a sync first recovers what a killed save left beside the target: if the target name is missing and
      a whole ``.<name>.old-<id>`` exists, it is renamed back; every other ``.<name>.tmp-<id>`` and
      ``.<name>.old-<id>`` is removed; one ``WARNING`` line on the ``lora_stream`` logger says which and how many
      bytes. Only those exact names are touched. Two saves into the same target at once are not supported (the
      second would remove the first's temporary directory).
    * Any failure (disk full, a bad tensor, a failed stream or agreement between ranks, a failure on any rank
      before the vote) removes the temporary directory; one before the publishing rename leaves the target as it
      was. A failure between the fallback's two renames (an exception, not a kill) renames the old copy back at
      once; one after the rename (fsyncing the parent) leaves the new checkpoint in place.
    * Memory: the stream's group, nothing more: each tensor goes straight into its shard file behind a header
      computed from ``metadata()``.
    * Tied weights: a name the stream does not yield because it is tied (``lm_head.weight``) is not written, as
      ``save_pretrained`` does, and ``config.json`` says ``tie_word_embeddings: true``; a separately trained
      ``lm_head`` on a tied model is written and the config says ``false`` (what peft's ``merge_and_unload`` does).
    * Dtypes: every dtype safetensors stores (float64 to float8 ``F8_E4M3``/``F8_E5M2``, signed and unsigned
      integers, bool); another one is refused before anything is gathered.
    * An :class:`~lora_stream.AdapterStream` is written as peft's ``save_pretrained`` writes an adapter:
      ``adapter_model.safetensors`` (one file, whatever ``max_shard_size``: peft loads no other) and
      ``adapter_config.json`` (:meth:`~lora_stream.AdapterStream.adapter_config`: each ``lora_B`` carries its
      layer's scaling, and the config says scaling 1), so ``PeftModel.from_pretrained(base, directory)`` gives the
      trainer's forward. No ``config.json`` or generation config is written (``config`` and ``generation_config``
      are ignored); the tokenizer is, when given. Same atomicity as a merged checkpoint.

    Args:
        directory: the checkpoint directory to create.
        max_shard_size: largest shard, as ``save_pretrained`` takes it (``"5GB"`` = 5·10⁹ bytes, ``"5GiB"``, or an
            int); one tensor larger than that gets a shard of its own.
        overwrite: replace an existing directory or file (atomically, see above).
        config: the Hugging Face config to write (``None``: the trainer's base model config, found in the model;
            ``False``: none). Written on a copy with ``dtype`` set to what was written.
        tokenizer: anything with ``save_pretrained`` (a tokenizer or processor) to save beside the weights.
        generation_config: save the model's generation config when it has one.
        progress: a ``tqdm`` bar on rank 0 (``None``: only when stderr is a terminal, or as the environment's
            ``LORA_STREAM_PROGRESS=0``/``1`` says; :func:`lora_stream.reporting.progress_bar`).
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
        #: Called by rank 0 at each step of publishing, with its name (a hook for tests that kill the process there):
        #: ``"synced"`` (everything is on disk in the temporary directory and every rank voted to publish, nothing
        #: renamed yet), ``"renamed"`` (the exchange, the fallback's move of the old copy aside, or the only rename
        #: when there was no old copy, is done), ``"published"`` (the new checkpoint is under the target name and the
        #: parent directory is fsynced; the old copy, if any, is removed next).
        self.on_publish: Callable[[str], None] | None = None

    @property
    def is_writer(self) -> bool:
        return self.rank == 0

    def sync(self, stream: ParamStream, *, version: str | None = None) -> SyncRecord:
        """Write one full pass of ``stream`` as the checkpoint; every rank calls it. ``version`` goes into the
        safetensors metadata."""
        start = time.perf_counter()
        tx = Transaction.for_stream(stream, self.name)
        source = SyncSource(stream, {}, version)
        source.progress = False  # rank 0's bar is the writing's (_bar: bytes on disk, the shard)
        meta = source.metadata()
        prepared: list[Any] = []  # rank 0's plan, index and temporary directory, once made

        def prepare() -> None:
            if not self.is_writer:
                return
            self._check_parent()
            self._recover_leftovers()
            self._check_target()
            adapter = isinstance(stream, AdapterStream)
            file_metadata = {"format": "pt"}
            if not adapter:
                file_metadata["merged_adapters"] = json.dumps(_merged_adapters(stream.model))
            if version is not None:
                file_metadata["version"] = version
            plan, weight_map = plan_shards(meta, 1 << 62 if adapter else self.max_shard_bytes, file_metadata)
            if adapter:  # one file, under the only name peft loads
                plan = dataclasses.replace(plan, files=[ADAPTER_WEIGHTS])
            prepared.extend([plan, weight_map, self._temp_dir()])

        try:
            tx.prepare(prepare)
        except BaseException:
            if prepared:
                remove_path(prepared[2])
            raise
        # Written and fsynced, not yet published: a peer may still fail (under DDP its pass does not talk to rank
        # 0's, so only the vote below tells rank 0), and the old checkpoint must then stay under the target name.
        with tx.attempt():
            if self.is_writer:
                plan, weight_map, tmp = prepared
                synced = self._write(source, meta, plan, tmp)
                self._finish(stream, meta, plan, weight_map, tmp, synced)
            else:
                with source.batches() as batches:
                    for _ in batches:
                        pass  # the gathers are collectives: every rank produces the stream
            fault_point("commit")
        # A vote that saw a failure told every rank (a pass that ended early under a sharded gatherer told them
        # already, so that vote is skipped on every rank): after it, none exchanges again and the counts match.
        if tx.vote("before publishing the checkpoint", known=source.ended_early):
            with tx.attempt():
                if self.is_writer:
                    self._step("synced")
                    self._publish(prepared[2])
            # Only rank 0 can fail since the first vote: this one carries a publish failure to every rank.
            tx.vote("while publishing the checkpoint")
        # The abort removes the temporary directory: the unpublished new copy, or (after an exchange) the old one.
        tx.conclude(lambda: None, lambda error: self._discard(prepared))
        record = source.record(self.name, time.perf_counter() - start)
        record.log(self.rank)
        return record

    def close(self) -> None:
        """Nothing is held between syncs."""

    # -- rank 0 ------------------------------------------------------------------------------------------------------
    def _discard(self, prepared: list[Any]) -> None:
        """After a failed sync: remove rank 0's temporary directory (nothing on the other ranks, nor once it was
        renamed into place). Best effort: what stays behind is a leftover the next save removes."""
        if prepared:
            remove_path(prepared[2])

    def _check_parent(self) -> None:
        parent = self.directory.parent
        if not parent.exists():
            raise CheckpointError(f"the parent directory {parent} does not exist")
        if not parent.is_dir():
            raise CheckpointError(f"cannot write {self.directory}: its parent {parent} is not a directory")
        if not os.access(parent, os.W_OK | os.X_OK, effective_ids=os.access in os.supports_effective_ids):
            raise CheckpointError(_unwritable(self.directory, "it is not writable by this process"))

    def _check_target(self) -> None:
        if os.path.lexists(self.directory) and not self.overwrite:
            what = "exists" if self.directory.is_dir() else "exists and is not a directory"
            raise CheckpointError(
                f"{self.directory} {what}; pass overwrite=True to replace it (the old one is removed only once the "
                "new one is complete)"
            )

    def _temp_dir(self) -> Path:
        tmp = self._beside("tmp")
        try:
            tmp.mkdir()
        except OSError as exc:
            raise CheckpointError(_unwritable(self.directory, f"creating {tmp.name} there failed ({exc})")) from exc
        return tmp

    def _beside(self, kind: str) -> Path:
        return self.directory.parent / f".{self.directory.name}.{kind}-{uuid.uuid4().hex[:12]}"

    def _leftovers(self) -> list[Path]:
        """Every ``.<name>.tmp-<id>`` and ``.<name>.old-<id>`` beside the target, and nothing else."""
        prefix = f".{self.directory.name}."
        with os.scandir(self.directory.parent) as entries:
            names = [e.name for e in entries if e.name.startswith(prefix)]
        return sorted(self.directory.parent / n for n in names if _LEFTOVER.fullmatch(n[len(prefix) :]))

    def _recover_leftovers(self) -> None:
        """Recover from a save killed mid-way: put a moved-aside old copy back when the target name is empty, remove
        every other leftover, and log one line saying so."""
        found = self._leftovers()
        if not found:
            return
        target = self.directory
        restored: Path | None = None
        notes: list[str] = []
        if not os.path.lexists(target):
            whole = [p for p in found if p.name.startswith(f".{target.name}.old-") and is_whole(p)]
            if whole:
                restored = max(whole, key=lambda p: p.lstat().st_ctime_ns)
                size = tree_size(restored)
                rename_noreplace(restored, target)
                fsync_dir(target.parent)
                notes.append(f"moved {restored.name} ({size:,} bytes) back to {target.name}: it had been moved aside")
        rest = [p for p in found if p != restored]
        if rest:
            sizes = [tree_size(p) for p in rest]
            failed = []
            for p in rest:
                why = remove_path(p)
                if why:
                    failed.append(f"{p.name}: {why}")
            notes.append(
                f"removed {len(rest) - len(failed)} of {len(rest)} leftover(s) ({sum(sizes):,} bytes): "
                + ", ".join(p.name for p in rest)
                + (f"; could not remove {'; '.join(failed)}" if failed else "")
            )
        logger.warning(
            "lora_stream checkpoint %s: an earlier save into it was interrupted; %s", target, "; ".join(notes)
        )

    def _bar(self, total: int) -> Any:
        return progress_bar(total, f"saving {self.directory.name}", show=self.progress, rank=self.rank)

    def _write(self, source: SyncSource, meta: list[ParamMeta], plan: ShardPlan, tmp: Path) -> set[Path]:
        """Write every shard into ``tmp``; returns the shard files, each already fsynced."""
        shard_of = {i: k for k, idx in enumerate(plan.members) for i in idx}
        bar = self._bar(plan.total_size)
        handle: IO[bytes] | None = None
        current = -1
        index = 0
        synced: set[Path] = set()

        def close_synced(h: IO[bytes]) -> None:
            h.flush()
            os.fsync(h.fileno())
            h.close()
            synced.add(Path(h.name))

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
                                close_synced(handle)
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
            if handle is not None:
                close_synced(handle)
            if not meta:  # an empty stream still makes a loadable (empty) file
                (tmp / plan.files[0]).write_bytes(plan.headers[0])
        finally:
            if handle is not None:
                handle.close()
            if bar is not None:
                bar.close()
        return synced

    def _finish(
        self,
        stream: ParamStream,
        meta: list[ParamMeta],
        plan: ShardPlan,
        weight_map: dict[str, str],
        tmp: Path,
        synced: set[Path],
    ) -> None:
        """Write the index, the configs and the tokenizer beside the shards, then fsync ``tmp`` (every file not in
        ``synced``, then every directory). Nothing is renamed: publishing waits for the ranks' vote."""
        if isinstance(stream, AdapterStream):
            config_text = json.dumps(stream.adapter_config(), indent=2, sort_keys=True)
            (tmp / ADAPTER_CONFIG).write_text(config_text + "\n")
            if self.tokenizer is not None:
                self.tokenizer.save_pretrained(str(tmp))
            fsync_tree(tmp, synced)
            return
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
        fsync_tree(tmp, synced)

    def _step(self, name: str) -> None:
        if self.on_publish is not None:
            self.on_publish(name)

    def _publish(self, tmp: Path) -> None:
        """Put the synced ``tmp`` under the target name: one exchange (or a no-replace rename), else the fallback's
        two renames; fsync the parent; then remove the old copy. The caller removes ``tmp`` if this raises."""
        target = self.directory
        exchange = renameat2_enabled()
        old: Path | None = None  # where the old copy is once the new one is in place
        if os.path.lexists(target):
            if not self.overwrite:
                raise CheckpointError(f"{target} appeared while saving; not replacing it")
            if exchange and renameat2(tmp, target, RENAME_EXCHANGE):
                old = tmp  # the old copy now has the temporary name; the new one is whole under the target name
                self._step("renamed")
            else:
                # Fallback: until the second rename nothing is under the target name; a kill here leaves the old
                # copy whole under .<name>.old-<id>, and the next save moves it back.
                old = self._beside("old")
                os.rename(target, old)
                try:
                    self._step("renamed")
                    os.rename(tmp, target)
                except BaseException:
                    os.rename(old, target)  # a failure (not a kill) here puts the old copy back at once
                    raise
        else:
            try:
                if not (exchange and renameat2(tmp, target, RENAME_NOREPLACE)):
                    os.rename(tmp, target)
            except FileExistsError as exc:
                raise CheckpointError(f"{target} appeared while saving; not replacing it") from exc
            self._step("renamed")
        try:
            fsync_dir(target.parent)
            self._step("published")
        finally:  # the new checkpoint is in place: the old copy goes, even if the fsync failed
            if old is not None:
                remove_path(old)  # best effort: what stays behind is a leftover the next save removes


def _unwritable(target: Path, why: str) -> str:
    return (
        f"cannot write the checkpoint {target}: {why} ({target.parent}). It is written into a temporary directory "
        "beside the target and renamed into place, so the parent directory must be writable: fix its permissions "
        "or mount, or save to a directory elsewhere"
    )


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
