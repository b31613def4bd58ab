"""Engine side of the merge in the engine (:mod:`lora_stream.engine_merge`): the base this server's worker keeps,
the inputs of its committed sync, and each update's merges, computed as their inputs arrive.

Contract with the trainer's sink (:class:`~lora_stream.VLLMServerSink` with ``merge="engine"``):

* The update's ``merge`` field carries one recipe per step it loads, in load order, which keys are the frozen base
  (``frozen``), and, for a partial update, the fingerprint the trainer recorded for every base key the recipes read
  (``base_fp``). A partial update whose base this worker does not hold with exactly those fingerprints is refused in
  :meth:`EngineMerger.begin`, before a byte is loaded: merging a new adapter onto another base would serve a model
  the trainer never had.
* A full update sends the base with it; the worker fingerprints every base tensor on arrival and keeps the new base
  only when the update commits (a failed full update leaves the previous base, and the previous weights, in place).
* Steps are computed in recipe order as soon as every input they read is there (received, or in the base), so the
  reload bracket sees whole layers in layer order, as with merged tensors.
* **One host copy per host.** A committed base is written once into a file named by its fingerprints
  (``LORA_STREAM_BASE_DIR``, default ``/dev/shm`` when it has room, else the temporary directory) and every worker
  maps that file (:func:`shared_base`): a server's tensor-parallel workers, and servers on one host fed the same
  base, share one copy in the page cache. The first worker to finish writing publishes it with a hard link; the
  others map the published file.
* **Rollback without a copy.** Once this worker committed a sync whose every output it computed itself, it can
  recompute any output of that sync from the base and the inputs it keeps (adapter-sized), so an update over it
  needs no host copy of the model: :meth:`restorer` gives the reload bracket what to load back on a rollback.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import shutil
import tempfile
import weakref
from collections.abc import Callable, Collection, Mapping
from typing import Any

import torch

from ..buffers import Scratch
from ..engine_merge import Converter, Recipe, checkpoint_converter, compute_step, recipe_keys
from ..fingerprint import fingerprint
from .reload import LOAD_ERROR_TAG, ReloadBracket, VLLMLoadError

__all__ = ["BASE_DIR_ENV", "EngineMerger", "MergeUpdate", "open_merge", "shared_base"]

#: Where committed bases are kept as files shared by every worker on the host (see the module docstring).
BASE_DIR_ENV = "LORA_STREAM_BASE_DIR"
_ALIGN = 64
_FILE_PREFIX = "lora_stream-base-"

_MERGERS: weakref.WeakKeyDictionary[torch.nn.Module, EngineMerger] = weakref.WeakKeyDictionary()


def _base_dir(nbytes: int) -> str:
    chosen = os.environ.get(BASE_DIR_ENV)
    if chosen:
        return chosen
    shm = "/dev/shm"
    try:
        if os.path.isdir(shm) and shutil.disk_usage(shm).free > 2 * nbytes:
            return shm
    except OSError:
        pass
    return tempfile.gettempdir()


_OWNED: set[str] = set()


@atexit.register
def _unlink_owned() -> None:
    # Workers that still map a file keep their pages: unlinking removes only the name.
    for path in list(_OWNED):
        try:
            os.unlink(path)
        except OSError:
            pass


def _collect(directory: str) -> None:
    """Remove base files no living process maps any more (a worker killed without running ``atexit``), leaving
    young ones alone: a worker may have just published one it has not mapped yet."""
    import glob
    import time

    mapped: set[str] = set()
    for maps in glob.glob("/proc/[0-9]*/maps"):
        try:
            with open(maps) as f:
                mapped.update(line.split(None, 5)[-1].strip() for line in f if _FILE_PREFIX in line)
        except OSError:
            continue
    for path in glob.glob(os.path.join(directory, f"{_FILE_PREFIX}*.bin")):
        try:
            if path not in mapped and time.time() - os.path.getmtime(path) > 60:
                os.unlink(path)
        except OSError:
            pass


def shared_base(base: Mapping[str, torch.Tensor], fps: Mapping[str, int]) -> tuple[dict[str, torch.Tensor], str]:
    """``base`` as read-only views of one file that every worker given the same base maps (the page cache holds it
    once), and the file's path. The file is named by the tensors' fingerprints, dtypes and shapes."""
    keys = sorted(base)
    layout: list[tuple[str, int, int]] = []
    offset = 0
    for k in keys:
        n = base[k].numel() * base[k].element_size()
        layout.append((k, offset, n))
        offset += -(-n // _ALIGN) * _ALIGN
    total = max(offset, _ALIGN)
    desc = [(k, int(fps[k]), str(base[k].dtype), list(base[k].shape)) for k in keys]
    ident = hashlib.blake2b(json.dumps(desc).encode(), digest_size=16).hexdigest()
    directory = _base_dir(total)
    path = os.path.join(directory, f"{_FILE_PREFIX}{ident}.bin")
    if os.path.isdir("/proc/self"):
        _collect(directory)
    for _ in range(3):
        if not os.path.exists(path):
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "wb") as f:
                for k, off, _ in layout:
                    f.seek(off)
                    t = base[k].detach().contiguous().cpu()
                    f.write(t.view(-1).view(torch.uint8).numpy().data)
                f.truncate(total)
            try:
                os.link(tmp, path)  # the first to finish publishes; the others map its file
                _OWNED.add(path)
            except FileExistsError:
                pass
            finally:
                os.unlink(tmp)
        try:
            storage = torch.from_file(path, shared=True, size=total, dtype=torch.uint8)
            break
        except (FileNotFoundError, RuntimeError):
            continue  # another worker replaced its base and removed the name meanwhile: write it again
    else:
        raise RuntimeError(f"lora_stream: could not map the shared base file {path!r}")
    views = {}
    for k, off, n in layout:
        t = base[k]
        views[k] = storage.narrow(0, off, n).view(t.dtype).view(t.shape)
    return views, path


class MergeUpdate:
    """One update's merges: fed the received inputs batch by batch, it returns what to load, in order."""

    def __init__(self, merger: EngineMerger, info: Mapping[str, Any], partial: bool) -> None:
        self.merger = merger
        self.convert = merger.convert
        self.partial = partial
        self.recipes: list[Recipe] = list(info.get("recipes") or [])
        self.frozen: set[str] = set(info.get("frozen") or [])
        self.received: dict[str, torch.Tensor] = {}
        #: Fingerprints of the base tensors this update brought (a full update), computed here on arrival.
        self.base_fp: dict[str, int] = {}
        self._next = 0
        self._scratch = Scratch(None)
        self.fingerprint_s = 0.0
        self.merge_s = 0.0

    @property
    def output_names(self) -> list[str]:
        """Every checkpoint name this update loads (tied aliases included)."""
        names: list[str] = []
        for r in self.recipes:
            for name, _, _ in r["outputs"]:
                names.append(name)
                names += r.get("aliases", {}).get(name, [])
        return names

    def _lookup(self, key: str) -> torch.Tensor | None:
        if key in self.received:
            return self.received[key]
        if self.partial:
            return self.merger.base.get(key)
        return None

    def feed(self, pairs: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """Take a batch of received inputs; return the outputs of every step that is now complete, in order."""
        import time

        for key, tensor in pairs:
            if key in self.frozen:
                t = time.perf_counter()
                self.base_fp[key] = fingerprint(tensor)
                self.fingerprint_s += time.perf_counter() - t
            self.received[key] = tensor
        return self._ready(final=False)

    def rest(self) -> list[tuple[str, torch.Tensor]]:
        """Every step not computed yet (all its inputs must be there now)."""
        return self._ready(final=True)

    def _ready(self, final: bool) -> list[tuple[str, torch.Tensor]]:
        import time

        out: list[tuple[str, torch.Tensor]] = []
        t = time.perf_counter()
        while self._next < len(self.recipes):
            recipe = self.recipes[self._next]
            lookup: dict[str, torch.Tensor] = {}
            for key in recipe_keys(recipe):
                found = self._lookup(key)
                if found is None:
                    if final:
                        raise VLLMLoadError(
                            f"{LOAD_ERROR_TAG} merge input {key!r} of {recipe['outputs'][0][0]!r} never arrived and is "
                            "not in this worker's base; nothing of the update stays"
                        )
                    self.merge_s += time.perf_counter() - t
                    return out
                lookup[key] = found
            out += compute_step(recipe, lookup, self._scratch, self.convert)
            self._next += 1
        self.merge_s += time.perf_counter() - t
        return out

    @property
    def kept_bytes(self) -> int:
        """Host bytes this undecided update holds (its inputs, the base of a full update): what a rollback frees."""
        return sum(t.numel() * t.element_size() for t in self.received.values())


class EngineMerger:
    """What one worker's model keeps for engine-side merges (one per model: :meth:`of`)."""

    def __init__(self) -> None:
        #: The trainer's frozen base, as the committed full sync brought it, and each tensor's fingerprint.
        self.base: dict[str, torch.Tensor] = {}
        self.base_fp: dict[str, int] = {}
        #: The trained inputs of the committed state, and the recipe each served output was computed with.
        self.inputs: dict[str, torch.Tensor] = {}
        self.recipe_of: dict[str, Recipe] = {}
        #: The file the committed base is mapped from (``None``: none yet).
        self.base_file: str | None = None
        #: transformers' checkpoint conversion of the served model (set by :func:`open_merge`).
        self.convert: Converter | None = None

    @classmethod
    def of(cls, model: torch.nn.Module) -> EngineMerger:
        merger = _MERGERS.get(model)
        if merger is None:
            merger = _MERGERS[model] = cls()
        return merger

    @property
    def base_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.base.values())

    @property
    def input_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.inputs.values())

    def begin(self, info: Mapping[str, Any], partial: bool) -> MergeUpdate:
        """Open one update's merges. A partial update is checked against the base held here first: every base key
        it reads must be here, with the fingerprint the trainer recorded when it sent it."""
        update = MergeUpdate(self, info, partial)
        if partial:
            expected = {k: int(v) for k, v in (info.get("base_fp") or {}).items()}
            for recipe in update.recipes:
                for key in recipe_keys(recipe):
                    if key not in update.frozen:
                        continue
                    held = self.base_fp.get(key)
                    if held is None or held != expected.get(key):
                        what = "does not hold it" if held is None else f"holds fingerprint {held:#x}"
                        raise VLLMLoadError(
                            f"{LOAD_ERROR_TAG} the engine's base for {recipe['outputs'][0][0]!r} (input {key!r}) is "
                            f"not the trainer's: the trainer sent fingerprint {expected.get(key, 0):#x}, this worker "
                            f"{what}; nothing was loaded, and the next sync sends the base again"
                        )
        return update

    def commit(self, update: MergeUpdate) -> None:
        """The update stands: its base (a full update) and inputs are what later updates and rollbacks merge on."""
        if not update.partial:
            received = {k: t for k, t in update.received.items() if k in update.frozen}
            previous = self.base_file
            self.base, self.base_file = shared_base(received, update.base_fp)
            self.base_fp = dict(update.base_fp)
            if previous is not None and previous != self.base_file and previous in _OWNED:
                _OWNED.discard(previous)
                try:
                    os.unlink(previous)  # the name only: a worker still mapping it keeps its pages until it lets go
                except OSError:
                    pass
            self.inputs = {}
            self.recipe_of = {}
        self.inputs.update({k: t for k, t in update.received.items() if k not in update.frozen})
        for recipe in update.recipes:
            for name, _, _ in recipe["outputs"]:
                self.recipe_of[name] = recipe
                for alias in recipe.get("aliases", {}).get(name, []):
                    self.recipe_of[alias] = recipe

    def forget(self) -> None:
        """The model's weights are no longer what the committed state computes (a load this worker did not merge,
        a rollback it could not recompute): nothing can be recomputed from here."""
        self.inputs = {}
        self.recipe_of = {}

    def restorer(self, names: Collection[str]) -> Callable[[], list[tuple[str, torch.Tensor]]] | None:
        """What a rollback loads back for ``names``, recomputed from the committed base and inputs (``None`` when
        some name was not computed here: the bracket keeps a copy instead). Captures the committed state now."""
        if not names or any(n not in self.recipe_of for n in names):
            return None
        wanted = set(names)
        recipes: list[Recipe] = []
        for n in names:
            r = self.recipe_of[n]
            if not any(r is x for x in recipes):
                recipes.append(r)
        base, inputs, convert = dict(self.base), dict(self.inputs), self.convert

        def produce() -> list[tuple[str, torch.Tensor]]:
            scratch = Scratch(None)
            out: list[tuple[str, torch.Tensor]] = []
            for recipe in recipes:
                lookup = {k: inputs[k] if k in inputs else base[k] for k in recipe_keys(recipe)}
                out += [(n, t) for n, t in compute_step(recipe, lookup, scratch, convert) if n in wanted]
            return out

        return produce


def open_merge(
    bracket: ReloadBracket,
    info: Mapping[str, Any],
    *,
    keep_previous: bool,
    partial: bool,
    base: str | None,
    optional: Collection[str],
) -> MergeUpdate:
    """Open ``bracket`` for an engine-side merge update: refused first if this worker's base is not the trainer's
    (nothing opened); a partial update onto this worker's committed merges rolls back by recomputing instead of a
    copy. Every worker transport (the server's receiver, the child-process worker extension) opens it here."""
    merger = EngineMerger.of(bracket.model)
    if merger.convert is None:
        config = getattr(bracket.model_config, "hf_config", None)
        merger.convert = checkpoint_converter(config) if config is not None else None
    update = merger.begin(info, partial=partial)
    expect = update.output_names if partial else None
    restore = merger.restorer(expect) if expect is not None and keep_previous else None
    bracket.begin(keep_previous=keep_previous, expect=expect, base=base, optional=optional, restore=restore)
    return update


def rolled_back(bracket: ReloadBracket) -> bool:
    """``bracket.rollback()``; if the previous weights could not be recomputed, nothing computed here describes
    the model any more, and the merger forgets its recipes."""
    try:
        return bracket.rollback()
    except BaseException:
        EngineMerger.of(bracket.model).forget()
        raise
