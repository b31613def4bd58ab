"""Engine side: what a vLLM model holds, for partial syncs -- which committed sync its weights are, and which
checkpoint tensors feed which of its modules.

A sync that sends only the outputs that changed (:mod:`lora_stream.changes`) is exact only if two things hold on
the engine, and both are established here, never assumed:

1. **The engine holds the weights the trainer compared against.** Every commit leaves a token (the committing
   sync's id) on the model; every reload bracket that opens clears it, so a rolled-back, failed or foreign
   lora_stream update leaves none. So does any other call of the model's ``load_weights`` (vLLM's own
   ``reload_weights`` or weight-transfer update, TRL's own sync, a user's ``collective_rpc``: :func:`hold` wraps
   it on the model), and a sleep that discards the weights (``LLM.sleep(level=2)``: the colocated sink wraps the
   engine's ``sleep``; a server's lease counts ``/sleep`` as a write). A partial update names the token it was
   computed against and is refused before a byte is loaded when the model holds another (a restarted server holds
   none).
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
"""

from __future__ import annotations

import bisect
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch

from ..units import merge_units

__all__ = ["LoadMap", "held_by", "hold", "release", "run_before"]

_HELD: weakref.WeakKeyDictionary[torch.nn.Module, str] = weakref.WeakKeyDictionary()
_MAPS: weakref.WeakKeyDictionary[torch.nn.Module, LoadMap] = weakref.WeakKeyDictionary()


def held_by(model: torch.nn.Module) -> str | None:
    """The token of the committed sync whose weights ``model`` serves, or ``None`` (unknown: never written by a
    committed lora_stream sync since it was loaded, or written since by an update that did not commit)."""
    return _HELD.get(model)


def hold(model: torch.nn.Module, token: str | None) -> None:
    """A sync committed on ``model`` (``token``), or an update opened on it (``None``)."""
    if token is None:
        _HELD.pop(model, None)
        return
    _watch_loads(model)
    _HELD[model] = token


def _watch_loads(model: torch.nn.Module) -> None:
    """Make every call of ``model.load_weights`` forget what the model holds first. A reload bracket has already
    forgotten it when it loads (and sets it again at commit); any other caller is a writer this module cannot
    account for, whose write must make the next sync a full one."""
    run_before(model, "load_weights", lambda watched, *_args, **_kwargs: _HELD.pop(watched, None))


def run_before(obj: Any, method: str, hook: Callable[..., object]) -> None:
    """Make every call of ``obj.<method>(...)`` call ``hook(obj, ...)`` first, with the same arguments; once per
    object and method. An instance attribute someone set before is wrapped, not replaced. The wrapper lives on
    ``obj`` and holds it weakly: a strong reference would be a cycle, which keeps a vLLM engine alive past its
    owner's ``del`` (and its late teardown breaks the parallel state of the next engine built in the process), so
    ``hook`` must not hold ``obj`` either."""
    own = obj.__dict__.get(method)
    marker = f"lora_stream_runs_before_{method}"
    if (own is None and not hasattr(type(obj), method)) or getattr(own, marker, False):
        return
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


def release(model: torch.nn.Module) -> None:
    """Forget what ``model`` holds: the next sync into it is a full one."""
    hold(model, None)
    _MAPS.pop(model, None)


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
    def of(cls, model: torch.nn.Module) -> LoadMap:
        found = _MAPS.get(model)
        if found is None:
            found = _MAPS[model] = cls()
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
