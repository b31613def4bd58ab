"""The gatherer contract: make one group of parameters whole, then let go of it."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from ..core import FullTensor, ParamRef

__all__ = [
    "BUFFER_ALIGN",
    "COALESCE_BYTES",
    "FlatGather",
    "FlatRange",
    "KEEP_BYTES",
    "Gatherer",
    "GathererBase",
    "ParamRef",
    "ShardedGathererBase",
    "aligned",
    "detached",
    "flat_all_gather",
    "flat_staging_bytes",
    "nbytes",
    "reusable_buffer",
    "whole_range",
]


def detached(param: ParamRef) -> torch.Tensor:
    """The parameter's tensor without a copy; ``detach()`` keeps the consumer out of the trainer's autograd graph."""
    t: torch.Tensor = param.detach()
    return t


@dataclass(frozen=True)
class FlatRange:
    """The flat range ``[offset, offset + values.numel())`` of a parameter that this rank holds, and its values (a
    view of the rank's own storage): what ``flat_range`` answers (:class:`Gatherer`)."""

    offset: int
    values: torch.Tensor


def whole_range(param: ParamRef, numel: int, name: str) -> FlatRange | str:
    """The whole parameter as its one flat range, where nothing is sharded, or why not (``name``: the gatherer's)."""
    whole = param.detach() if isinstance(param, torch.Tensor) else None
    if whole is None or whole.numel() != numel:
        return f"the {name} gatherer does not hold this parameter whole"
    return FlatRange(0, whole.reshape(-1))


#: Tensors laid out in one gather buffer start at multiples of this many bytes, so that a view of any dtype is legal.
BUFFER_ALIGN = 64


def aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to :data:`BUFFER_ALIGN`: the offset of the next tensor in a gather buffer."""
    return (nbytes + BUFFER_ALIGN - 1) // BUFFER_ALIGN * BUFFER_ALIGN


def reusable_buffer(buf: torch.Tensor | None, nbytes: int, device: torch.device) -> torch.Tensor:
    """``buf`` if it holds at least ``nbytes`` on ``device``, else a fresh byte buffer of that size: the gather
    buffer a direct path owns and reuses for every group of a pass."""
    if buf is None or buf.numel() < nbytes or buf.device != device:
        buf = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=device)
    return buf


#: A direct path gathers every parameter of a group whose whole size (padded to the shards) is at most this many
#: bytes in one all-gather of a flat buffer (:func:`flat_all_gather`); a larger parameter gets an all-gather of its
#: own, straight into place. A collective costs a fixed latency (about 0.1-1 ms over gloo, tens of microseconds over
#: NCCL) whatever its size, and the flat buffer costs a copy of the parameter in and out and staging bytes: below
#: this size the latency dominates (LoRA factors, norms, biases), above it the copy would. ``coalesce_bytes=0`` on a
#: gatherer gives every parameter its own all-gather.
COALESCE_BYTES = 1 << 20


#: What :class:`~lora_stream.AdapterStream` passes as ``keep_bytes`` to the ZeRO-3 or FSDP2 gatherer it builds:
#: a direct path's buffers of at most this many bytes in all (an adapter's factors, gathered, plus the flat
#: all-gather's staging) stay allocated between passes, so each sync does not fault their pages in again (measured:
#: see ``docs/adapter_sync.md``). A merged stream's gatherer frees them at the end of every pass unless asked.
KEEP_BYTES = 64 << 20


def flat_staging_bytes(sizes: Sequence[int], world: int) -> int:
    """Staging bytes :func:`flat_all_gather` needs for pieces of ``sizes`` bytes a rank: the packed pieces and
    ``world`` times as many gathered."""
    return sum(sizes) * (world + 1)


def coalesced(placed: Sequence[tuple[Any, int, int]], coalesce_bytes: int, world: int) -> tuple[list[Any], int]:
    """Which of a group's parameters share one flat all-gather, and its staging bytes. ``placed``: ``(param,
    offset, whole bytes)`` in the group's buffer. The small ones (LoRA factors, norms, biases: at most
    ``coalesce_bytes`` whole, at least two of them) share it; each large one is all-gathered straight into its place.
    Sizes are global, so every rank splits the group alike; the staging follows the group's tensors in the buffer."""
    small = [(p, off, n) for p, off, n in placed if 0 < n <= coalesce_bytes]
    if len(small) < 2:
        small = []
    return small, flat_staging_bytes([n // world for _, _, n in small], world) if small else 0


def flat_part(
    buf: torch.Tensor, small: Sequence[tuple[Any, int, int]], size: int, staging: int, world: int
) -> tuple[list[Any], FlatGather | None, set[int]]:
    """The small parameters' shared flat all-gather over ``buf`` (:func:`coalesced`'s ``small`` and ``staging``; the
    staging starts at ``size``, after the group's tensors): the parameters, its :class:`FlatGather` (``None``: no
    shared gather), and their ids (the large ones are gathered straight into their places)."""
    if not small:
        return [], None, set()
    outs = [buf.narrow(0, off, n) for _, off, n in small]
    flat = FlatGather([n // world for _, _, n in small], outs, buf.narrow(0, size, staging), world)
    return [p for p, _, _ in small], flat, {id(p) for p, _, _ in small}


class FlatGather:
    """The buffer side of :func:`flat_all_gather`, laid out once: where each piece's ``world * n`` bytes go, the
    packed and gathered staging, and the views the copy out writes through. A direct path that keeps its buffer
    between passes keeps this too, so a sync does not rebuild hundreds of views of the same bytes.

    ``outs[i]`` receives ``world * sizes[i]`` bytes (every rank's ``sizes[i]``, in rank order); ``staging`` holds
    :func:`flat_staging_bytes` of ``sizes``.
    """

    def __init__(self, sizes: Sequence[int], outs: Sequence[torch.Tensor], staging: torch.Tensor, world: int) -> None:
        self.sizes = list(sizes)
        self.world = world
        total = sum(self.sizes)
        self.recv = staging.narrow(0, 0, total * world)
        self.send = staging.narrow(0, total * world, total)
        self._recv_rows = self.recv.view(world, total)
        self._outs = [out.view(world, n) for out, n in zip(outs, self.sizes, strict=True)]
        self._zeros: torch.Tensor | None = None

    def start(self, locals_: Sequence[torch.Tensor], group: object | None) -> Any:
        """Pack this rank's bytes (``locals_[i]``: 1-D ``uint8``, at most ``sizes[i]``; the rest is padding,
        zeroed) and start the all-gather; returns its work handle."""
        import torch.distributed as dist

        pad = max(n - local.numel() for local, n in zip(locals_, self.sizes, strict=True))
        if pad and (self._zeros is None or self._zeros.numel() < pad):
            self._zeros = torch.zeros(pad, dtype=torch.uint8, device=self.send.device)
        chunks = []
        for local, n in zip(locals_, self.sizes):
            chunks.append(local)
            if local.numel() < n:  # a short shard (FSDP2's last ranks): padding, never read
                assert self._zeros is not None
                chunks.append(self._zeros.narrow(0, 0, n - local.numel()))
        torch.cat(chunks, out=self.send)
        return dist.all_gather_into_tensor(self.recv, self.send, group=group, async_op=True)  # type: ignore[arg-type]

    def copy_out(self) -> None:
        """Copy every rank's bytes to each piece's place; once the handle was waited for."""
        torch.split_with_sizes_copy(self._recv_rows, self.sizes, dim=1, out=self._outs)


def flat_all_gather(
    pieces: Sequence[tuple[torch.Tensor, int, torch.Tensor]], staging: torch.Tensor, group: object | None, world: int
) -> tuple[Any, Callable[[], None]]:
    """One all-gather for many parameters: this rank's pieces packed into one byte buffer, all-gathered at once,
    then copied out to each parameter's place.

    Each piece is ``(local, n, out)``: this rank's bytes ``local`` (1-D ``uint8``, at most ``n`` of them; the rest of
    its ``n`` is padding, zeroed) and ``out``, ``world * n`` contiguous bytes that receive every rank's ``n`` in rank
    order. ``staging`` (at least :func:`flat_staging_bytes` bytes) holds the packed and the gathered bytes; it is
    part of the gatherer's own buffer, reused by every group of a pass. Returns the collective's work handle and the
    function that copies the result out once the handle was waited for (:class:`FlatGather` keeps the layout for
    the next time).

    What every gatherer's direct path does for its small parameters: DeepSpeed's ``allgather_coalesced`` and FSDP2's
    ``foreach_all_gather`` do the same for their units. The copies are byte copies, so the result equals a separate
    all-gather per parameter bit for bit, whatever the dtypes; every rank must pass pieces of the same sizes in the
    same order (they follow from global shapes, which every rank shares).
    """
    flat = FlatGather([n for _, n, _ in pieces], [out for _, _, out in pieces], staging, world)
    handle = flat.start([local for local, _, _ in pieces], group)
    return handle, flat.copy_out


def nbytes(shape: torch.Size, dtype: torch.dtype) -> int:
    bits = torch.finfo(dtype).bits if dtype.is_floating_point else torch.iinfo(dtype).bits
    return int(shape.numel()) * bits // 8


@runtime_checkable
class Gatherer(Protocol):
    """Makes the parameters of one group whole on this rank, and releases them.

    :class:`~lora_stream.ParamStream` asks the gatherer for each module's parameters and their whole shapes and dtypes
    while planning (and from ``metadata()``), then, for each group in order, enters ``gather(params)`` once, reads
    whole tensors through the accessor it yields, and exits before the next group is gathered. A new gatherer
    (Megatron, a custom sharding) implements this protocol, usually by subclassing :class:`GathererBase`.

    Optional members the stream uses when present (ZeRO-3's and FSDP2's direct paths have them):

    * ``reuses_buffers`` (bool): the tensors ``gather`` hands out live in buffers the next group overwrites; the
      stream then copies what it yields unmerged, so consumers that keep a tensor past its group stay correct.
    * ``prefetch(params)``: start gathering the next group; called (with ``ParamStream(prefetch=True)``) right after
      the current group became whole, at the same point on every rank, so a collective started there always has
      its partners.
    * ``end_pass()``: called when a pass ends, however it ends: wait for anything in flight, free per-pass buffers
      (or keep them for the next pass when they hold at most the gatherer's ``keep_bytes``).
    * ``kept_bytes`` / ``release()``: bytes kept for the next pass (copied into
      :attr:`~lora_stream.stream_pass.StreamStats.kept_bytes`, counted by ``held_bytes()`` between passes), and the
      call that frees them (:meth:`~lora_stream.ParamStream.close` makes it).
    * ``path_counts`` / ``fallback_reason``: copied into :class:`~lora_stream.stream_pass.StreamStats` as
      ``gather_paths``; ``path_counts`` counts parameters (``{"direct": n, "fallback": m}``: parameters made whole
      by each path).
    * ``local_shard(param)``: this rank's own bytes of ``param`` (its shard, or the whole tensor where nothing is
      sharded; a tuple of tensors where a gather may read more than one buffer -- every buffer it may read),
      read without communication: what a sync fingerprints to prove a frozen source unchanged
      (:mod:`lora_stream.changes`). ``None`` (or no such method): the gatherer cannot say, and every output reading
      ``param`` is sent at every sync.
    * ``flat_range(param, numel)``: the :class:`FlatRange` of ``param`` (``numel`` elements whole) this rank holds,
      read without communication, or why it has none an element sync can use (a sentence, the same on every rank):
      what an element sync diffs (:mod:`lora_stream.elements`). No such method: a collective gatherer cannot say,
      and a gatherer that is not holds the parameter whole.
    * ``gather_key(param)``: see :meth:`GathererBase.gather_key`; with it (and :class:`GathererBase`'s
      ``gather_bytes``) budget grouping is linear in the number of parameters.
    """

    #: Short name used in errors and logs ("plain", "zero3", "fsdp2", "fsdp1").
    name: str

    def module_params(self, module: nn.Module) -> list[tuple[str, ParamRef]]:
        """``module``'s own parameters as ``(attribute name, ref)``, in registration order, without recursing.

        The planner walks the module tree and asks this for every module, so the stream's coverage and order follow
        it. Must not communicate (it runs in ``ParamStream(...)``, which ranks need not call together).
        """
        ...

    def param(self, module: nn.Module, name: str) -> ParamRef:
        """The ref of ``module``'s parameter ``name`` (how the planner reaches adapter factors such as
        ``lora_A[adapter].weight``). Raises ``KeyError`` if there is none."""
        ...

    def full_shape(self, param: ParamRef) -> torch.Size:
        """The parameter's whole (unsharded) shape.

        Called from ``metadata()``: it must not communicate or allocate, or ``metadata()`` stops being free and,
        worse, becomes a collective that every rank must call together.
        """
        ...

    def full_dtype(self, param: ParamRef) -> torch.dtype:
        """The dtype the whole tensor has once gathered. Same no-communication rule as ``full_shape``."""
        ...

    def gather_bytes(self, params: Sequence[ParamRef]) -> int:
        """Bytes this gatherer holds while ``params`` are gathered (what budgets and the memory bound count).

        Usually the whole size of the parameters; a gatherer whose unit of gathering is coarser (FSDP1 unshards a
        whole FSDP unit) counts what it really materializes, so that groups are cut where the bound holds.
        """
        ...

    def gather(self, params: Sequence[ParamRef]) -> AbstractContextManager[FullTensor]:
        """Make exactly ``params`` whole for the duration of the ``with`` block.

        Yields a function returning the whole tensor of any of ``params``. The tensors it returns may alias the
        trainer's storage; callers must not write to them. On exit every gathered buffer is released (re-sharded)
        so that at most one group is held; a gatherer that keeps buffers past exit breaks the stream's memory
        bound. Entering is a collective for sharded gatherers: every rank of ``process_group`` must gather the same
        groups in the same order, or they deadlock -- which is why the stream runs a status exchange before each
        group when ``collective`` is true.
        """
        ...

    @property
    def collective(self) -> bool:
        """Whether ``gather`` communicates, so ranks must iterate in lockstep."""
        ...

    @property
    def process_group(self) -> object | None:
        """The ``torch.distributed`` group ``gather`` communicates over (``None``: the default group)."""
        ...

    def held_bytes(self) -> int:
        """Bytes this gatherer currently holds whole because of the stream (a probe for tests and stats)."""
        ...


class GathererBase:
    """Defaults for gatherers whose refs are the model's own ``nn.Parameter`` objects."""

    name = "base"

    def module_params(self, module: nn.Module) -> list[tuple[str, ParamRef]]:
        return [(n, p) for n, p in module._parameters.items() if p is not None]

    def param(self, module: nn.Module, name: str) -> ParamRef:
        p = module._parameters.get(name)
        if p is None:
            raise KeyError(name)
        return p

    def full_shape(self, param: ParamRef) -> torch.Size:
        return torch.Size(param.shape)

    def full_dtype(self, param: ParamRef) -> torch.dtype:
        dtype: torch.dtype = param.dtype
        return dtype

    def local_shard(self, param: ParamRef) -> torch.Tensor | tuple[torch.Tensor, ...] | None:
        """The whole parameter: nothing is sharded (``local_shard`` in :class:`Gatherer`)."""
        return detached(param) if isinstance(param, torch.Tensor) else None

    def flat_range(self, param: ParamRef, numel: int) -> FlatRange | str:
        """The whole parameter: nothing is sharded (``flat_range`` in :class:`Gatherer`)."""
        return whole_range(param, numel, self.name)

    def gather_key(self, param: ParamRef) -> tuple[Hashable, int]:
        """What gathering ``param`` materializes, as ``(key, bytes)``: parameters with the same key are
        materialized together, once (here each parameter by itself; FSDP1: its whole unit).

        :meth:`gather_bytes` is the sum over the distinct keys of a group, which lets the budget grouping
        (:func:`lora_stream.grouping.partition`) count a growing group incrementally. A subclass that overrides
        ``gather_bytes`` instead is grouped by calling it (exact, but quadratic in the group's size)."""
        return id(param), nbytes(self.full_shape(param), self.full_dtype(param))

    def gather_bytes(self, params: Sequence[ParamRef]) -> int:
        held: dict[Hashable, int] = {}
        for p in params:
            key, n = self.gather_key(p)
            held.setdefault(key, n)
        return sum(held.values())

    @property
    def collective(self) -> bool:
        return False

    @property
    def process_group(self) -> object | None:
        return None

    def held_bytes(self) -> int:
        return 0


class ShardedGathererBase(GathererBase):
    """Defaults for gatherers whose ``gather`` is a collective over ``self._group``, counting what they hold."""

    _group: object | None = None
    _held: int = 0

    @property
    def collective(self) -> bool:
        return True

    @property
    def process_group(self) -> object | None:
        return self._group

    def held_bytes(self) -> int:
        """Whole bytes this gatherer currently holds because of the stream."""
        return self._held

    def flat_range(self, param: ParamRef, numel: int) -> FlatRange | str:
        """A sharded gatherer says which elements it holds only where it knows its layout (ZeRO-3, FSDP2)."""
        return f"the {self.name} gatherer does not say which elements of this parameter this rank holds"

    def _direct_options(self, coalesce_bytes: int, keep_bytes: int) -> None:
        """The direct path's options both sharded gatherers take, checked; and the state of keeping its buffers."""
        if coalesce_bytes < 0:
            raise ValueError(f"coalesce_bytes must be >= 0, got {coalesce_bytes}")
        if keep_bytes < 0:
            raise ValueError(f"keep_bytes must be >= 0, got {keep_bytes}")
        self.coalesce_bytes = coalesce_bytes
        self.keep_bytes = keep_bytes
        self._passes_ended = 0
        self._cache_layouts = True  # off only to measure what keeping the layouts saves (benchmarks)
        #: Bytes of buffers kept since the last pass ended (counted by ``held_bytes`` until the next gather).
        self.kept_bytes = 0

    def _keep_or_release(self, kept: int) -> None:
        """At the end of a pass holding ``kept`` buffer bytes: keep them when they are at most ``keep_bytes``, from
        the second pass on (a stream built for one sync, and dropped or kept by a sink until the next one, frees
        them as before; only a stream that is used again keeps them); otherwise :meth:`release` them."""
        self._passes_ended += 1
        if 0 < kept <= self.keep_bytes and self._passes_ended > 1:
            self.kept_bytes = kept
        else:
            self.release()

    def release(self) -> None:
        """Free the buffers kept between passes (``keep_bytes``). Between passes only."""
        self.kept_bytes = 0
