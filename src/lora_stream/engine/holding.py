"""Engine side: what a vLLM model holds, for partial syncs -- which committed sync its weights are, and which
checkpoint tensors feed which of its modules.

A sync that sends only the outputs that changed (:mod:`lora_stream.changes`) is exact only if two things hold on
the engine, and both are established here, never assumed:

1. **The engine holds the weights the trainer compared against.** Every commit leaves a token (the committing
   sync's id) on the model and records a digest of every module's state (:mod:`lora_stream.engine.state_digest`).
   What proves the state is the digest, not the token: before a partial update loads a byte, the engine digests
   every module the update will not touch and compares with the record (``ReloadBracket.begin``), and the sinks'
   pre-flight asks :func:`held_state`, which checks every module, so that a difference makes that very sync a full
   one and names the module. Writers cannot all be watched -- vLLM's ``reload_weights(is_checkpoint_format=False)``
   writes with ``param.copy_``, a runner's ``CUDAGraphWrapper`` hides ``load_weights``, a user's ``apply_model``
   writes anywhere -- so the token is only a fast path: every reload bracket that opens clears it (a rolled-back,
   failed or foreign lora_stream update leaves none), so does any call of the model's ``load_weights`` where
   :func:`hold` could install its watch (through any wrapper; where it cannot, it says so in the log and the digest
   alone protects), and a sleep that discards the weights (``LLM.sleep(level=2)``: the colocated sink wraps the
   engine's ``sleep``; a server's lease counts ``/sleep`` as a write). A partial update names the token it was
   computed against and is refused before a byte is loaded when the model holds another (a restarted server holds
   none) or when a module it leaves differs from the record.
2. **Every vLLM module gets all of its weights or none of them.** vLLM fuses checkpoint tensors into one module
   (``q_proj``, ``k_proj`` and ``v_proj`` into ``qkv_proj``; every expert of a layer into one ``FusedMoE``); a module
   that got only some of them is rebuilt with the rest missing. The :class:`LoadMap` asks vLLM instead of
   predicting it: during every reload it records, for each weight a module's loader buffered, which of the tensors
   handed to ``load_weights`` it reads (by memory: the tensor itself or a view of it), so after one full sync it
   knows which checkpoint names feed each module. The trainer sends together every name of a module
   (:meth:`LoadMap.units`); a partial update snapshots only the modules it feeds, and a module it was to leave
   untouched that receives a weight anyway fails the update before vLLM processes it.

A loader that copies a tensor before handing it on (no view of what was sent) cannot be traced: the map is then
incomplete and the engine takes full syncs only.

Every table here is keyed by the ``nn.Module`` itself, under any wrapper (:func:`~lora_stream.engine.state_digest.
unwrap_model`): a model runner may hand out its model wrapped in vLLM's ``CUDAGraphWrapper``.
"""

from __future__ import annotations

import bisect
import logging
import weakref
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import torch

from ..units import merge_units
from .state_digest import first_difference, forget, unwrap_model

__all__ = [
    "Held",
    "LoadMap",
    "Proof",
    "held_by",
    "held_state",
    "hold",
    "proof_stands",
    "release",
    "run_before",
    "take_proof",
    "watched",
]

logger = logging.getLogger("lora_stream")

_HELD: weakref.WeakKeyDictionary[torch.nn.Module, str] = weakref.WeakKeyDictionary()
_MAPS: weakref.WeakKeyDictionary[torch.nn.Module, LoadMap] = weakref.WeakKeyDictionary()
#: Models whose ``load_weights`` watch is proven installed (reached through the object the engine hands out).
_WATCHED: weakref.WeakKeyDictionary[torch.nn.Module, bool] = weakref.WeakKeyDictionary()

#: Why a model whose token is gone holds no committed sync, when nothing more precise is known.
NOT_HELD = "another sink or update wrote it, or a sleep discarded it"
#: Why the watch dropped a model's token (a ``load_weights`` outside any lora_stream update), until the next commit.
_DROPPED: weakref.WeakKeyDictionary[torch.nn.Module, str] = weakref.WeakKeyDictionary()
_FOREIGN_LOAD = (
    "its load_weights was called outside a lora_stream sync (vLLM's reload_weights or weight update, TRL's own "
    "sync, a user's collective_rpc)"
)


def held_by(model: Any) -> str | None:
    """The token of the committed sync whose weights ``model`` serves, or ``None`` (unknown: never written by a
    committed lora_stream sync since it was loaded, or written since by an update that did not commit, or by a
    writer the watch saw). The token alone proves nothing about writers the watch cannot see: what the sinks ask
    before a partial sync is :func:`held_state`."""
    return _HELD.get(unwrap_model(model))


class Held(NamedTuple):
    """What :func:`held_state` found: the committed sync whose weights the model provably serves (``token``), or
    ``None`` and why not (``why``)."""

    token: str | None
    why: str | None


def held_state(model: Any) -> Held:
    """The committed sync ``model`` serves, *proven*: its token, and every module's state equal to what that commit
    left (:func:`~lora_stream.engine.state_digest.first_difference`, which reads every byte digested: one pass over
    the engine's weights). Asked by the sinks' pre-flight (the colocated sink in its process, the worker extension
    over ``collective_rpc``) so that a difference makes *this* sync a full one, with ``why`` naming the module.

    A difference also drops the token (the model no longer holds that sync): ``ReloadBracket.begin`` then refuses a
    partial update even if a caller skipped this check. Without a token nothing is read."""
    key = unwrap_model(model)
    token = _HELD.get(key)
    if token is None:
        return Held(None, _DROPPED.get(key, NOT_HELD))
    _PROVEN.discard(key)
    why = first_difference(key)
    if why is not None:
        _HELD.pop(key, None)
        return Held(None, why)
    _PROVEN.add(key)
    return Held(token, None)


class Proof(NamedTuple):
    """What one :func:`held_state` proof found, for the reload bracket that the same sync opens right after it
    (:func:`take_proof`, :func:`proof_stands`): the token it proved, the model's epoch (bumped by every
    :func:`hold` and every foreign ``load_weights``), and each parameter and buffer (held, so that no other tensor
    can take its place under the same address), with its storage address and version counter."""

    token: str
    epoch: int
    marks: tuple[tuple[torch.Tensor, int, int], ...]


#: The models :func:`held_state` proved in their current epoch, until :func:`take_proof` takes the proof.
_PROVEN: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
#: Per model, how many times its token was set, cleared or dropped: a proof made before stands no longer.
_EPOCH: weakref.WeakKeyDictionary[torch.nn.Module, int] = weakref.WeakKeyDictionary()


def _next_epoch(key: torch.nn.Module) -> None:
    _PROVEN.discard(key)
    _EPOCH[key] = _EPOCH.get(key, 0) + 1


def _marks(model: torch.nn.Module) -> tuple[tuple[torch.Tensor, int, int], ...] | None:
    """``O(1)`` per tensor, nothing read: each parameter and buffer, its storage address and its autograd version
    counter (bumped by every in-place op that autograd sees: ``copy_``, ``index_copy_``, indexing). ``None`` where
    a tensor has none of these to give (an inference tensor has no version counter; a sparse tensor or a wrapper
    subclass, no storage): the bracket then reads."""
    try:
        return tuple(
            (t, t.untyped_storage().data_ptr() if t.device.type != "meta" else 0, t._version)
            for t in (*model.parameters(), *model.buffers())
        )
    except Exception:  # any tensor that cannot say: no proof, and the bracket reads
        return None


def _same(a: tuple[tuple[torch.Tensor, int, int], ...], b: tuple[tuple[torch.Tensor, int, int], ...]) -> bool:
    return len(a) == len(b) and all(x[0] is y[0] and x[1:] == y[1:] for x, y in zip(a, b, strict=True))


def take_proof(model: Any) -> Proof | None:
    """The proof of the last :func:`held_state` on ``model``, once (``None``: none since the model's token last
    changed, already taken, or a tensor that cannot be marked). Who calls it: the colocated sink, right after its
    pre-flight, to hand to ``ReloadBracket.begin`` in the same sync (``proven``)."""
    key = unwrap_model(model)
    token = _HELD.get(key)
    if key not in _PROVEN or token is None:
        return None
    _PROVEN.discard(key)
    marks = _marks(key)
    return None if marks is None else Proof(token, _EPOCH.get(key, 0), marks)


def proof_stands(model: Any, proof: Proof | None) -> bool:
    """Whether ``proof`` (:func:`take_proof`) may stand for a read of ``model``'s state now: the model still holds
    the token it proved, and no parameter or buffer was replaced, moved or written in place through autograd since.

    This is not a proof of its own -- a write through ``.data`` or a kernel's pointer bumps no counter. It is only
    safe where nothing can run on the engine between :func:`held_state` and the caller: the colocated sink's own
    sync, whose pre-flight and bracket run in one call on one thread, with only the ranks' agreement and exchange
    between them (a verified sync's probe runs a forward there: the sink then hands no proof). Anywhere else (a
    server, whose workers serve requests between the two), read again."""
    key = unwrap_model(model)
    return (
        proof is not None
        and _HELD.get(key) == proof.token
        and _EPOCH.get(key, 0) == proof.epoch
        and (marks := _marks(key)) is not None
        and _same(marks, proof.marks)
    )


def hold(model: Any, token: str | None) -> None:
    """A sync committed on ``model`` (``token``), or an update opened on it (``None``). The caller
    (:class:`~lora_stream.engine.reload.ReloadBracket`) records the modules' digest at the same time; a token
    without a record proves nothing (a partial update is then refused)."""
    key = unwrap_model(model)
    _DROPPED.pop(key, None)
    _next_epoch(key)
    if token is None:
        _HELD.pop(key, None)
        return
    _watch_loads(model)
    _HELD[key] = token


def watched(model: Any) -> bool:
    """Whether a foreign ``load_weights`` on ``model`` drops its token at once (the watch is proven installed, see
    :func:`run_before`). Where it is not, the digest check at the next partial sync is what catches the write."""
    return _WATCHED.get(unwrap_model(model), False)


def _watch_loads(model: Any) -> None:
    """Make every call of the model's ``load_weights`` forget what the model holds first -- a fast path only. A
    reload bracket has already forgotten it when it loads (and sets it again at commit); any other caller is a
    writer this module cannot account for, whose write must make the next sync a full one. Installed on the module
    under any wrapper (so calls through the wrapper and calls on the module are both seen), and checked again at
    every commit (someone may have replaced the method since); where it cannot be proven installed, says so once in
    the log: the digest check still catches the write, at the next sync's pre-flight."""
    key = unwrap_model(model)
    key_ref = weakref.ref(key)  # the hook must not hold the model (see run_before)
    installed = run_before(model, "load_weights", lambda _owner, *_args, **_kwargs: _drop_token(key_ref))
    if not installed and _WATCHED.get(key) is not False:
        logger.warning(
            "lora_stream: cannot watch %s.load_weights on this engine (no such method on the model or what it "
            "wraps, or a lookup that does not reach the watch); a foreign write is caught by the state check "
            "before the next partial sync instead",
            type(model).__name__,
        )
    _WATCHED[key] = installed


def _drop_token(ref: weakref.ref[Any]) -> None:
    """The watch saw a ``load_weights``: a token still held means no lora_stream update is open (every bracket drops
    the token when it opens), so the caller is a foreign writer; say so at the next pre-flight."""
    model = ref()
    if model is not None and _HELD.pop(model, None) is not None:
        _DROPPED[model] = _FOREIGN_LOAD
    if model is not None:
        _next_epoch(model)


def _owner_of(obj: Any, method: str) -> Any | None:
    """The object whose ``method`` a call of ``obj.<method>`` runs: ``obj`` when it (or its class) defines it;
    otherwise, through wrappers that forward attributes (vLLM's ``CUDAGraphWrapper``: ``unwrap()`` or
    ``runnable``), the first wrapped object that does. ``None`` when there is none."""
    seen = 0
    while obj is not None and seen < 8:
        seen += 1
        d = getattr(obj, "__dict__", None)
        if (isinstance(d, dict) and method in d) or hasattr(type(obj), method):
            return obj
        unwrap = getattr(type(obj), "unwrap", None)
        inner = unwrap(obj) if callable(unwrap) else (d.get("runnable") if isinstance(d, dict) else None)
        if inner is obj:
            return None
        obj = inner
    return None


def run_before(obj: Any, method: str, hook: Callable[..., object]) -> bool:
    """Make every call of ``obj.<method>(...)`` call ``hook(owner, ...)`` first, with the same arguments; once per
    object and method. ``owner`` is ``obj``, or the object under ``obj``'s wrappers that defines ``method``
    (:func:`_owner_of`): the wrapper is installed there, so that calls through the wrapper and calls on the wrapped
    object are both seen. An instance attribute someone set before is wrapped, not replaced. The wrapper lives on
    ``owner`` and holds it weakly: a strong reference would be a cycle, which keeps a vLLM engine alive past its
    owner's ``del`` (and its late teardown breaks the parallel state of the next engine built in the process), so
    ``hook`` must not hold ``owner`` either.

    Returns whether the hook is *proven* installed: ``obj.<method>``, looked up as a caller would, is the wrapper.
    ``False`` (nothing installed, or a lookup that bypasses it) is never silent to the caller: it must fall back
    on something that does not depend on seeing the call."""
    marker = f"lora_stream_runs_before_{method}"
    owner = _owner_of(obj, method)
    if owner is None:
        return False
    own = owner.__dict__.get(method)
    if not getattr(own, marker, False):
        _install(owner, method, hook, own, marker)
    return bool(getattr(getattr(obj, method, None), marker, False))


def _install(obj: Any, method: str, hook: Callable[..., object], own: Any, marker: str) -> None:
    ref = weakref.ref(obj)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        this = ref()
        assert this is not None  # reached through the object
        hook(this, *args, **kwargs)
        if own is not None:
            return own(*args, **kwargs)
        return getattr(type(this), method)(this, *args, **kwargs)

    setattr(wrapper, marker, True)
    object.__setattr__(obj, method, wrapper)


def release(model: Any) -> None:
    """Forget what ``model`` holds: the next sync into it is a full one."""
    hold(model, None)
    forget(model)
    _MAPS.pop(unwrap_model(model), None)


class LoadMap:
    """Which checkpoint names feed which modules of one vLLM model, learned while it reloads (see the module
    docstring). One per model (:meth:`of`), shared by every bracket on it."""

    def __init__(self) -> None:
        #: checkpoint name -> the qualified names of the modules whose loaders read it.
        self.receivers: dict[str, set[str]] = {}
        #: Whether every weight a loader buffered so far was traced to a name (and a full reload was seen).
        self.traced = True
        self.full_seen = False

    @classmethod
    def of(cls, model: Any) -> LoadMap:
        key = unwrap_model(model)
        found = _MAPS.get(key)
        if found is None:
            found = _MAPS[key] = cls()
        return found

    @property
    def complete(self) -> bool:
        """A full reload was traced, and nothing was ever left untraced."""
        return self.full_seen and self.traced

    def modules_of(self, names: Iterable[str]) -> set[str] | None:
        """The modules ``names`` feed, or ``None`` if a name was never seen (then nothing can be left out)."""
        out: set[str] = set()
        for n in names:
            found = self.receivers.get(n)
            if found is None:
                return None
            out |= found
        return out

    def units(self) -> list[list[str]]:
        """The names that must travel together: two names are in one unit when one module reads both (directly or
        through a chain). Units of one name are left out."""
        readers: dict[str, list[str]] = {}
        for name, modules in self.receivers.items():
            for m in modules:
                readers.setdefault(m, []).append(name)
        return merge_units(list(readers.values()), []) or []


class BatchIndex:
    """The tensors of one ``load_weights`` batch by memory, so that what a loader reads can be traced to a name."""

    def __init__(self, pairs: list[tuple[str, torch.Tensor]]) -> None:
        spans: list[tuple[int, int, str]] = []
        for name, t in pairs:
            if t.numel() == 0:
                continue
            start = t.data_ptr()
            spans.append((start, start + t.numel() * t.element_size(), name))
        spans.sort()
        self._spans = spans
        self._starts = [s for s, _, _ in spans]

    def names_of(self, t: Any) -> list[str]:
        """Every name whose tensor ``t`` is, or is a view into (tied aliases share one tensor)."""
        if not isinstance(t, torch.Tensor) or t.numel() == 0:
            return []
        try:
            ptr = t.data_ptr()
        except RuntimeError:
            return []
        # Spans never overlap but for tied aliases, which share one tensor (the same span): look at the last
        # span starting at or before ptr, and at the spans sharing its start.
        j = bisect.bisect_right(self._starts, ptr) - 1
        found: list[str] = []
        if j < 0:
            return found
        first = self._starts[j]
        while j >= 0 and self._starts[j] == first:
            _, end, name = self._spans[j]
            if ptr < end:
                found.append(name)
            j -= 1
        return found


def loaded_tensor(bound_args: Any) -> Any:
    """The checkpoint tensor a buffered weight-loader call reads: its ``loaded_weight`` argument, or the first
    tensor argument after the parameter."""
    args = getattr(bound_args, "arguments", {})
    if "loaded_weight" in args:
        return args["loaded_weight"]
    for key, value in args.items():
        if key != "param" and isinstance(value, torch.Tensor):
            return value
    return None
