"""DeepSpeed ZeRO-3: gather exactly one group's partitioned parameters into buffers the stream owns, then let go.

DeepSpeed's own ``GatheredParameters`` allocates a fresh flat tensor per parameter on every entry and frees them on
exit. Over a sync of many groups that churn is what grows a CPU process (glibc keeps freed heap) and what
``malloc_trim`` had to undo. The direct path here all-gathers each parameter's partition (``ds_tensor``) into one
byte buffer per pass, sized by the largest group and reused by every group, with DeepSpeed's own layout: rank ``r``
holds elements ``[r * P, (r + 1) * P)`` of the flattened parameter, ``P = ds_tensor.ds_numel`` (padded), so the
whole parameter is the first ``ds_numel`` elements of the gathered ``P * world``. A group's small parameters
(whole size at most ``coalesce_bytes``, 1 MiB by default: LoRA factors, norms) share one all-gather: their partitions
are packed into one flat byte buffer, all-gathered at once and copied out to their places (what DeepSpeed's own
``allgather_coalesced`` does), so an adapter's group costs one collective, not one per factor; a larger parameter is
all-gathered straight into its place. The bytes are those ``GatheredParameters`` produces (the same partitions,
all-gathered; tested bit for bit), and the parameter itself is never touched: its ``ds_status`` stays
``NOT_AVAILABLE`` and ``param.data`` stays empty. The flat all-gather's staging (this rank's packed partitions and
the gathered ``world`` times as many bytes) lies in the same owned buffer, after the group's tensors.

Configurations the direct path cannot prove equal fall back to ``GatheredParameters``, for the whole group: ZeRO++
hierarchical partitions (``ds_secondary_tensor``), quantized partitions, parameters offloaded to NVMe or kept on
another device than the parameter's, partitions of another process group, parameters in flight. Most of these are
configuration, which every rank shares, but a parameter's ``ds_status`` (in flight, or already whole) is each
rank's own state. Both gathers are collectives, so the ranks must agree: a flag per parameter plus one, ANDed over
the ranks, decides, on every rank alike, whether the group goes direct (only if it can on every rank) and which
parameters need no all-gather (only those whole on every rank). The stream sends the flags along its own status
exchange before the group (:meth:`ZeroThreeGatherer.agreement`, :meth:`ZeroThreeGatherer.agreed`), so the agreement
costs no collective of its own; with prefetch (the next group decided inside the current one) or called directly,
:meth:`ZeroThreeGatherer.decide` agrees in one small ``all_reduce`` (MIN) of its own. ``path_counts`` (parameters
made whole by each path) and ``fallback_reason`` report what was used.

With ``prefetch`` the stream asks for the next group's gather as soon as the current group is whole; it runs
asynchronously into a second buffer while the current group is merged and consumed. Memory: two groups instead of one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..core import FullTensor
from .base import (
    COALESCE_BYTES,
    FlatGather,
    FlatRange,
    ShardedGathererBase,
    aligned,
    coalesced,
    detached,
    flat_part,
    reusable_buffer,
)

__all__ = ["PathDecision", "ZeroThreeGatherer", "is_zero3_model"]


def is_zero3_model(model: nn.Module) -> bool:
    """Whether ``model``'s parameters are ZeRO-3 partitioned (engine, its ``.module``, or built under zero.Init)."""
    return any(hasattr(p, "ds_id") for p in model.parameters())


@dataclass(frozen=True)
class PathDecision:
    """Which path one group takes, agreed by every rank (:meth:`ZeroThreeGatherer.decide`)."""

    #: The group's parameter ids, in order (what the decision is for).
    key: tuple[int, ...]
    #: Why the group falls back to ``GatheredParameters`` (``None``: the direct path).
    reason: str | None
    #: Parameters whole (``AVAILABLE``) on every rank: read where they are, not all-gathered.
    whole: frozenset[int] = frozenset()


@dataclass
class _Layout:
    """One group's place in a slot's buffer, kept with the buffer (``keep_bytes``) so that a sync does not rebuild
    the views: the flat all-gather of its small parameters, the large ones' places, every whole tensor."""

    buf: torch.Tensor
    whole_bytes: int
    small: list[Any] = field(default_factory=list)
    flat: FlatGather | None = None
    large: list[tuple[Any, torch.Tensor]] = field(default_factory=list)
    full: dict[int, torch.Tensor] = field(default_factory=dict)


@dataclass
class _Gathered:
    """One group's gather into a buffer slot: the work handles and each parameter's whole tensor."""

    key: tuple[int, ...]
    slot: int
    nbytes: int
    handles: list[Any] = field(default_factory=list)
    full: dict[int, torch.Tensor] = field(default_factory=dict)
    #: Copies the flat all-gather of the small parameters out to their places, once it completed.
    copy_out: Callable[[], None] | None = None

    def wait(self) -> None:
        handles, self.handles = self.handles, []
        for h in handles:
            h.wait()
        copy_out, self.copy_out = self.copy_out, None
        if copy_out is not None:
            copy_out()


class ZeroThreeGatherer(ShardedGathererBase):
    """One group at a time out of a ZeRO-3 partitioned model; read-only.

    Args:
        model: the DeepSpeed engine, its ``.module``, or a model built under ``zero.Init``.
        direct: gather into the stream's own buffers where provably equal to ``GatheredParameters`` (default);
            ``False`` always uses ``GatheredParameters(group, modifier_rank=None)``.
        coalesce_bytes: on the direct path, a group's parameters of at most this many whole bytes (padded) share
            one all-gather of a flat buffer; each larger one gets its own (default
            :data:`~lora_stream.gatherers.base.COALESCE_BYTES`, 1 MiB; ``0``: one all-gather per parameter).
        keep_bytes: when a pass ends, keep the direct path's buffers for the next pass if together they hold at most
            this many bytes (default ``0``: freed at the end of every pass), from the gatherer's second pass on (a
            stream built for a single sync frees them as before). A kept buffer's pages stay resident, so
            the next sync does not fault them in again; it holds the last group's gathered bytes until then, and
            :meth:`held_bytes` counts it. :meth:`release` (and the stream's ``close()``) frees it.
            :class:`~lora_stream.AdapterStream` sets :data:`~lora_stream.gatherers.base.KEEP_BYTES` on the gatherer
            it builds itself.

    Either way the local partition (``ds_tensor``) is never written, and shapes come from ``ds_shape``, so planning
    and ``metadata()`` communicate nothing.
    """

    name = "zero3"

    def __init__(
        self, model: nn.Module, *, direct: bool = True, coalesce_bytes: int = COALESCE_BYTES, keep_bytes: int = 0
    ) -> None:
        self._direct_options(coalesce_bytes, keep_bytes)
        self._agree_in_lockstep = True  # off only to measure what agreeing in the status exchange saves
        self._refusal: tuple[tuple[int, ...], str | None] | None = None
        self._params: list[Any] = [p for p in model.parameters() if hasattr(p, "ds_id")]
        if not self._params:
            raise ValueError("ZeroThreeGatherer needs a model whose parameters are ZeRO-3 partitioned")
        self._group = getattr(self._params[0], "ds_process_group", None)
        self.direct = direct
        #: Parameters made whole by each path since this gatherer was built.
        self.path_counts: dict[str, int] = {"direct": 0, "fallback": 0}
        #: Why the latest fallback group could not take the direct path.
        self.fallback_reason: str | None = None
        self._buffers: list[torch.Tensor | None] = [None, None]
        #: Per slot, the layouts of the groups gathered into its buffer (kept only with ``keep_bytes``).
        self._layouts: list[dict[Any, _Layout]] = [{}, {}]
        self._current: _Gathered | None = None
        self._pending: _Gathered | None = None
        #: The decision ``prefetch`` took for the next group (whichever path), so ``gather`` does not take it again.
        self._decided: PathDecision | None = None
        self._agree_device: torch.device | None = None

    @property
    def reuses_buffers(self) -> bool:
        """The direct path reuses its buffers for every group: the stream copies what it yields unmerged out of
        them (``GatheredParameters`` hands out fresh tensors each time)."""
        return self.direct

    def full_shape(self, param: nn.Parameter) -> torch.Size:
        shape = getattr(param, "ds_shape", None)
        return torch.Size(shape) if shape is not None else param.shape

    # -- which path -------------------------------------------------------------------------------------------------
    def direct_refusal(self, params: Sequence[Any]) -> str | None:
        """Why ``params`` cannot be gathered by the direct path on this rank (``None``: they can). Mostly the
        parameters' configuration, which every rank shares, but also their ``ds_status``, which is this rank's
        own: :meth:`decide` turns it into the decision every rank takes."""
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        if not self.direct:
            return "direct=False"
        for p in params:
            if not hasattr(p, "ds_tensor"):
                return f"a parameter of shape {tuple(p.shape)} is not ZeRO-3 partitioned"
            if getattr(p, "ds_secondary_tensor", None) is not None:
                return "ZeRO++ hierarchical partitioning (ds_secondary_tensor)"
            t = p.ds_tensor
            if hasattr(t, "ds_quant_scale") or t.dtype != p.dtype:
                return f"quantized or recast partitions ({t.dtype} partition of a {p.dtype} parameter)"
            if getattr(t, "final_location", None) is not None or t.device.type != p.device.type:
                return "offloaded parameters"
            if getattr(p, "ds_process_group", self._group) is not self._group:
                return "parameters partitioned over different process groups"
            if p.ds_status not in (ZeroParamStatus.NOT_AVAILABLE, ZeroParamStatus.AVAILABLE):
                return f"a parameter in state {p.ds_status.name}"
        return None

    def decide(self, params: Sequence[Any]) -> PathDecision:
        """The path ``params`` (one group) take, the same on every rank: direct only if every rank can go direct,
        and a parameter skips the all-gather only if it is whole on every rank.

        A collective over the gatherer's process group (one ``all_reduce`` of ``len(params) + 1`` ints) when the
        direct path is on and there is more than one rank; every rank must call it for the same group at the same
        point, as for ``gather``. The stream avoids it where it can: it sends :meth:`agreement` along its own status
        exchange before the group and hands the result to :meth:`agreed`."""
        unique = list({id(p): p for p in params}.values())
        key = tuple(id(p) for p in unique)
        if not self.direct:  # a constructor argument: every rank passes the same
            return PathDecision(key, "direct=False")
        reason, flags = self._local_flags(unique)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(self._group) > 1:  # type: ignore[arg-type]
            t = torch.tensor([int(f) for f in flags], dtype=torch.int32, device=self._device())
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self._group)  # type: ignore[arg-type]
            flags = [bool(f) for f in t.tolist()]
        return self._decision(key, reason, flags)

    def agreement(self, params: Sequence[Any]) -> list[bool] | None:
        """This rank's side of :meth:`decide` for ``params``, for the stream to send along its status exchange
        before the group (every flag ANDed over the ranks is what ``decide``'s MIN ``all_reduce`` computes):
        ``[can go direct, *whole]``, one flag per distinct parameter. ``None`` where ``decide`` needs no
        agreement (``direct=False``)."""
        if not self.direct or not self._agree_in_lockstep:
            return None
        unique = list({id(p): p for p in params}.values())
        reason, flags = self._local_flags(unique)
        self._refusal = (tuple(id(p) for p in unique), reason)
        return flags

    def agreed(self, params: Sequence[Any], flags: Sequence[bool]) -> None:
        """Take the decision for ``params`` from :meth:`agreement`'s flags ANDed over every rank; the next
        ``gather(params)`` uses it instead of calling :meth:`decide`. Called on every rank alike by the stream."""
        key = tuple(id(p) for p in {id(p): p for p in params}.values())
        refusal, self._refusal = self._refusal, None
        if refusal is None or refusal[0] != key:
            raise RuntimeError("agreed() without agreement() for the same group")
        self._decided = self._decision(key, refusal[1], list(flags))

    def _local_flags(self, unique: list[Any]) -> tuple[str | None, list[bool]]:
        """Why this rank cannot go direct (or ``None``), and its flags: ``[can go direct, *whole]``."""
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        reason = self.direct_refusal(unique)
        whole = [getattr(p, "ds_status", None) == ZeroParamStatus.AVAILABLE for p in unique]
        return reason, [reason is None, *whole]

    @staticmethod
    def _decision(key: tuple[int, ...], reason: str | None, agreed: list[bool]) -> PathDecision:
        """The decision from this rank's ``reason`` and the flags agreed by every rank."""
        if not agreed[0] and reason is None:
            reason = "another rank cannot take the direct path for this group (a parameter's state differs there)"
        if reason is not None:
            return PathDecision(key, reason)
        return PathDecision(key, None, frozenset(k for k, whole in zip(key, agreed[1:]) if whole))

    def _device(self) -> torch.device:
        """Where the decision's ints live: the CPU for gloo, DeepSpeed's accelerator otherwise (nccl)."""
        if self._agree_device is None:
            backend = str(dist.get_backend(self._group))  # type: ignore[arg-type]
            if "gloo" in backend:
                self._agree_device = torch.device("cpu")
            else:
                from deepspeed.accelerator import get_accelerator

                self._agree_device = torch.device(get_accelerator().current_device_name())
        return self._agree_device

    # -- gathering --------------------------------------------------------------------------------------------------
    @contextmanager
    def gather(self, params: Sequence[Any]) -> Iterator[FullTensor]:
        self.kept_bytes = 0  # a pass is running: its buffers are in use again, counted as its groups' bytes
        unique = list({id(p): p for p in params}.values())
        key = tuple(id(p) for p in unique)
        decided, self._decided = self._decided, None
        decision = decided if decided is not None and decided.key == key else self.decide(unique)
        if decision.reason is not None:
            self.path_counts["fallback"] += len(unique)
            self.fallback_reason = decision.reason
            self._drain()
            import deepspeed

            with deepspeed.zero.GatheredParameters(unique, modifier_rank=None):
                yield detached
            return
        self.path_counts["direct"] += len(unique)
        pending, self._pending = self._pending, None
        if pending is not None and pending.key != key:  # the stream asked for another group: never reuse it
            pending.wait()
            self._release(pending)
            pending = None
        gathered = pending if pending is not None else self._start(unique, self._free_slot(), decision.whole)
        self._current = gathered
        try:
            gathered.wait()
            full = gathered.full

            def whole(param: Any) -> torch.Tensor:
                t = full.get(id(param))
                return t if t is not None else detached(param)  # persistent: ZeRO keeps it whole

            yield whole
        finally:
            self._current = None
            self._release(gathered)

    def prefetch(self, params: Sequence[Any]) -> None:
        """Start gathering ``params`` (the stream's next group) now, into the other buffer; ``gather(params)``
        then only waits for it. A collective: every rank must ask for the same group at the same point (the stream
        does, right after its current group became whole). Ignored where the direct path does not apply."""
        unique = list({id(p): p for p in params}.values())
        if self._pending is not None or self._decided is not None:
            return
        # Decided now, on every rank alike (the stream prefetches at the same point everywhere); gather() reuses
        # the decision, so a group costs one agreement whether prefetched or not.
        self._decided = decision = self.decide(unique)
        if decision.reason is None:
            self._pending = self._start(unique, self._free_slot(), decision.whole)

    def end_pass(self) -> None:
        """Wait for a gather still in flight (the peers started it too) and free the buffers, or keep them when
        together they hold at most ``keep_bytes``. The stream calls this when a pass ends, however it ends."""
        self._decided = None
        self._drain()
        self._keep_or_release(sum(b.numel() for b in self._buffers if b is not None))

    def release(self) -> None:
        self._buffers = [None, None]
        self._layouts = [{}, {}]
        super().release()

    def _drain(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            try:
                pending.wait()
            finally:
                self._release(pending)

    def _free_slot(self) -> int:
        used = {g.slot for g in (self._current, self._pending) if g is not None}
        return next(s for s in (0, 1) if s not in used)

    def _start(self, params: list[Any], slot: int, whole: frozenset[int]) -> _Gathered:
        key = (tuple(id(p) for p in params), whole)
        layout = self._layouts[slot].get(key)
        if layout is None or layout.buf is not self._buffers[slot]:
            layout = self._lay_out(params, slot, whole)
            if self.keep_bytes and self._cache_layouts:  # the buffer may outlive the pass: so may its views
                self._layouts[slot][key] = layout
        gathered = _Gathered(key[0], slot, layout.whole_bytes)
        if layout.flat is not None:
            locals_ = [self._partition(p).view(torch.uint8) for p in layout.small]
            gathered.handles.append(layout.flat.start(locals_, self._group))
            gathered.copy_out = layout.flat.copy_out
        for p, out in layout.large:
            handle = dist.all_gather_into_tensor(out, self._partition(p), group=self._group, async_op=True)
            gathered.handles.append(handle)
        gathered.full.update(layout.full)
        self._held += layout.whole_bytes
        return gathered

    def _lay_out(self, params: list[Any], slot: int, whole: frozenset[int]) -> _Layout:
        """Where ``params`` go in the slot's buffer (grown if needed): what :meth:`_start` all-gathers into."""
        world = dist.get_world_size(self._group)  # type: ignore[arg-type]
        placed: list[tuple[Any, int, int]] = []
        size = 0
        for p in params:
            if id(p) in whole:
                continue  # persistent (or gathered by someone else) on every rank: already whole
            n = p.ds_tensor.ds_numel * world * p.element_size()
            placed.append((p, size, n))
            size = aligned(size + n)
        small, staging = coalesced(placed, self.coalesce_bytes, world)  # one flat all-gather for the small ones
        device = params[0].ds_tensor.device if params else torch.device("cpu")
        old = self._buffers[slot]
        buf = self._buffers[slot] = reusable_buffer(old, size + staging, device)
        if buf is not old:
            self._layouts[slot].clear()  # views into the old buffer: let it go
        layout = _Layout(buf, sum(int(p.ds_numel) * p.element_size() for p, _, _ in placed))
        layout.small, layout.flat, flat = flat_part(buf, small, size, staging, world)
        for p, off, n in placed:
            out = buf.narrow(0, off, n).view(p.dtype)
            if id(p) not in flat:
                layout.large.append((p, out))
            layout.full[id(p)] = out.narrow(0, 0, p.ds_numel).view(p.ds_shape)
        return layout

    def flat_range(self, param: Any, numel: int) -> FlatRange | str:
        """This rank's partition of ``param`` (``flat_range`` in the gatherer contract): an equal flat range per rank,
        the last one padded (the padding is not part of the range). None for a partition on NVMe, or a persistent
        parameter (whole on every rank, so its partition is not what a gather reads)."""
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        part = getattr(param, "ds_tensor", None)
        if part is None:
            return super().flat_range(param, numel)
        if "nvme" in str(getattr(part, "final_location", "") or "").lower():
            return "ZeRO-3 keeps its partition on NVMe"
        if getattr(param, "ds_status", None) == ZeroParamStatus.AVAILABLE:
            return "a persistent ZeRO-3 parameter (whole on every rank)"
        size = int(part.ds_numel)
        rank = dist.get_rank(getattr(param, "ds_process_group", None))
        lo = min(rank * size, numel)
        hi = min(lo + size, numel)
        return FlatRange(lo, part.view(-1).narrow(0, 0, hi - lo))

    def local_shard(self, param: Any) -> torch.Tensor | tuple[torch.Tensor, ...] | None:
        """Every buffer of ``param`` this rank's gather may read: its partition (``ds_tensor``), and, where the
        parameter is whole here (a persistent parameter, below ``stage3_param_persistence_threshold``, which
        DeepSpeed keeps whole on every rank; or one made available by someone else), its whole ``.data`` too,
        which the gather then reads instead of the partitions. The two are separate buffers on 2+ ranks: a write
        through ``.data`` changes only the second. A persistent parameter is whole only from the first forward on,
        so the first sync after that sends its outputs once more. ``None`` when DeepSpeed keeps the partition on
        NVMe."""
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        part = getattr(param, "ds_tensor", None)
        if part is None:
            return super().local_shard(param)
        if "nvme" in str(getattr(part, "final_location", "") or "").lower():
            return None
        if getattr(param, "ds_status", None) == ZeroParamStatus.AVAILABLE:
            return (self._partition(param), param.data)
        return self._partition(param)

    @staticmethod
    def _partition(p: Any) -> torch.Tensor:
        """This rank's partition of ``p``, padded as DeepSpeed pads it (every rank's is ``ds_tensor.ds_numel``)."""
        part: torch.Tensor = p.ds_tensor.view(-1).narrow(0, 0, p.ds_tensor.ds_numel)
        return part

    def _release(self, gathered: _Gathered) -> None:
        self._held -= gathered.nbytes
        gathered.full.clear()

    def held_bytes(self) -> int:
        """Whole bytes of parameters held gathered because of the stream: the direct path's current and prefetched
        groups, and whatever ``GatheredParameters`` holds (persistent parameters not counted); between passes, the
        buffers kept for the next one (``keep_bytes``)."""
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        fallback = sum(
            p.ds_numel * p.element_size()
            for p in self._params
            if p.ds_status == ZeroParamStatus.AVAILABLE and not getattr(p, "ds_persist", False)
        )
        return int(self._held + fallback + self.kept_bytes)


def _zero3_offload(model: nn.Module) -> Any | None:
    """DeepSpeed's ``DeepSpeedZeRoOffload`` whose hooks fetch and release ``model``'s partitioned parameters in a
    forward: the engine's (``engine.optimizer`` without an optimizer, else ``engine.optimizer.parameter_offload``),
    or, for the module itself, the one its start-of-forward hook belongs to (DeepSpeed keeps no other reference)."""
    optimizer = getattr(model, "optimizer", None)
    candidates = [optimizer, getattr(optimizer, "parameter_offload", None)]
    for module in (model, getattr(model, "module", None)):
        for hook in list(getattr(module, "_forward_pre_hooks", {}).values()):
            candidates.extend(cell.cell_contents for cell in getattr(hook, "__closure__", None) or ())
    for c in candidates:
        if callable(getattr(c, "get_param_coordinator", None)) and hasattr(c, "param_coordinator"):
            return c
    return None


@contextmanager
def untraced_forward(model: nn.Module) -> Iterator[None]:
    """A forward of the ZeRO-3 ``model`` that DeepSpeed does not learn from: it runs under a parameter coordinator
    of its own, a copy of the trainer's with an empty trace, and the trainer's is put back after it.

    Why: DeepSpeed records the order in which the first step after a reset fetches each submodule, and from then on
    prefetches and releases parameters by that trace. A forward of lora_stream's own (verification's probe, run
    between the trainer's steps) would otherwise be recorded as the step's trace, or invalidate it. Under TRL that
    broke the next backward: the probe's forward calls ``lm_head``, which TRL's fused loss reads directly, so the
    trace prefetched ``lm_head.weight``, TRL's fused head skipped its own gather, and the gradient met a released
    weight (``The size of tensor a (0) must match the size of tensor b ...``).

    The copy shares the parameters and the in-flight registry (the probe's gathers and releases are real), and
    nothing else it changes: every parameter the probe fetched is released by DeepSpeed's own hooks after its
    submodule's forward, as in any step without a complete trace. Raises :class:`~lora_stream.LoraStreamError` when
    DeepSpeed's coordinator cannot be found (a DeepSpeed release that keeps it elsewhere): the forward would then
    change the trainer's state."""
    import copy

    from ..errors import LoraStreamError

    offload = _zero3_offload(model)
    if offload is None:
        raise LoraStreamError(
            "verify= under DeepSpeed ZeRO-3: this DeepSpeed keeps the parameter coordinator of the model's forward "
            "where lora_stream cannot find it, so the probe's forward would change the trace DeepSpeed prefetches "
            "by and break the next backward. Pass the DeepSpeedEngine (not its module) to the stream, or sync "
            "without verify="
        )
    trainer_coordinator = offload.param_coordinator
    own = copy.copy(trainer_coordinator)
    # Fresh trace structures for the copy, so nothing it records lands in the trainer's lists.
    if own.is_invalid_trace():
        own._clear_trace_structures()
    else:
        own._invalidate_trace()
    offload.param_coordinator = own
    try:
        yield
    finally:
        offload.param_coordinator = trainer_coordinator
