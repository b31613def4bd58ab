"""FSDP2 (``fully_shard``): parameters are DTensors; a group is made whole by all-gathering just its params.

``DTensor.full_tensor()`` allocates a fresh tensor per parameter on every call; over a sync of many groups that churn
grows a CPU process (glibc keeps freed heap; the FSDP2 benchmark measured 316-418 MiB of growth without
``malloc_trim``). The direct path all-gathers each parameter's local shard into one byte buffer per pass, sized by the
largest group and reused by every group. A ``Shard(0)`` DTensor is split with ``torch.chunk`` semantics: rank ``r``
holds rows ``[r * c, r * c + len_r)`` with ``c = ceil(rows / world)``, so after all-gathering every rank's shard
padded to ``c`` rows, the whole tensor is the first ``rows`` rows. A group's small parameters (whole size at most
``coalesce_bytes``, 1 MiB by default: LoRA factors, norms) share one all-gather of a flat byte buffer, copied out to
their places afterwards (as ``fully_shard``'s own all-gather does for a unit); a larger one is all-gathered straight
into its place. Anything else -- other placements, a mesh of more than one dimension or another group, a shard on
another device than the mesh's (CPU offload) -- goes through ``full_tensor()``, per parameter.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..core import FullTensor
from .base import (
    COALESCE_BYTES,
    FlatGather,
    FlatRange,
    ShardedGathererBase,
    aligned,
    coalesced,
    flat_part,
    reusable_buffer,
)

__all__ = ["Fsdp2Gatherer", "is_dtensor"]


def is_dtensor(t: object) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    return isinstance(t, DTensor)


def _whole(p: Any) -> torch.Tensor:
    """All-gather one DTensor parameter into a plain tensor (a collective over its mesh)."""
    from torch.distributed.tensor import DTensor

    t = p.detach()
    local = t.to_local()
    mesh = t.device_mesh
    if local.device.type != mesh.device_type:
        # CPU offload: the shard lives on the CPU while the mesh communicates on the accelerator.
        t = DTensor.from_local(local.to(mesh.device_type), mesh, t.placements, shape=t.shape, stride=t.stride())
    full: torch.Tensor = t.full_tensor()
    return full


def _fsdp_params(model: nn.Module) -> dict[tuple[int, str], Any]:
    """``(id(module), parameter name) -> FSDPParam`` for every parameter ``fully_shard`` manages (tied ones under
    each of their names); empty where torch's FSDP2 internals differ (the registered parameters are used then)."""
    out: dict[tuple[int, str], Any] = {}
    try:
        for m in model.modules():
            get_state = getattr(m, "_get_fsdp_state", None)
            if get_state is None:
                continue
            for group in get_state()._fsdp_param_groups:
                for fsdp_param in group.fsdp_params:
                    info = fsdp_param._module_info
                    out[(id(info.module), info.param_name)] = fsdp_param
                    for shared, shared_name in zip(info.shared_modules, info.shared_param_names):
                        out[(id(shared), shared_name)] = fsdp_param
    except (AttributeError, AssertionError, TypeError):  # another torch's FSDP2 internals
        return {}
    return out


@dataclass
class _Layout:
    """One group's place in the buffer, kept with the buffer (``keep_bytes``) so that a sync does not rebuild the
    views: the flat all-gather of its small parameters, the large ones' places, every whole tensor."""

    buf: torch.Tensor
    whole_bytes: int
    small: list[Any] = field(default_factory=list)
    flat: FlatGather | None = None
    #: ``(param, its place, elements every rank sends)``
    large: list[tuple[Any, torch.Tensor, int]] = field(default_factory=list)
    full: dict[int, torch.Tensor] = field(default_factory=dict)


class Fsdp2Gatherer(ShardedGathererBase):
    """One group of DTensor parameters made whole at a time, never the whole model; read-only.

    ``fully_shard``'s own ``unshard()`` works on a whole FSDP unit (usually a decoder layer) and changes the module's
    state; gathering the group's DTensors leaves FSDP's state alone, needs no knowledge of the unit layout, and keeps
    the stream's groups independent of how the model was wrapped. Shapes and dtypes come from the DTensors' global
    metadata, so planning and ``metadata()`` communicate nothing.

    Args:
        model: the ``fully_shard``-ed model.
        direct: all-gather ``Shard(0)`` parameters into buffers the stream owns (default); ``False`` uses
            ``full_tensor()`` for every parameter.
        coalesce_bytes: on the direct path, a group's parameters of at most this many whole bytes (padded to the
            shards) share one all-gather of a flat buffer; each larger one gets its own (default
            :data:`~lora_stream.gatherers.base.COALESCE_BYTES`, 1 MiB; ``0``: one all-gather per parameter).
        keep_bytes: when a pass ends, keep the direct path's buffer for the next pass if it holds at most this many
            bytes (default ``0``: freed at the end of every pass), from the gatherer's second pass on (a stream built
            for a single sync frees it as before). A kept buffer's pages stay resident, so the next
            sync does not fault them in again; it holds the last group's gathered bytes until then, and
            :meth:`held_bytes` counts it. :meth:`release` (and the stream's ``close()``) frees it.
            :class:`~lora_stream.AdapterStream` sets :data:`~lora_stream.gatherers.base.KEEP_BYTES` on the gatherer
            it builds itself.
    """

    name = "fsdp2"

    def __init__(
        self, model: nn.Module, *, direct: bool = True, coalesce_bytes: int = COALESCE_BYTES, keep_bytes: int = 0
    ) -> None:
        self._direct_options(coalesce_bytes, keep_bytes)
        dtensors = [p for p in model.parameters() if is_dtensor(p)]
        if not dtensors:
            raise ValueError("Fsdp2Gatherer needs a model with DTensor parameters (torch.distributed.fsdp.fully_shard)")
        mesh: Any = dtensors[0].device_mesh  # type: ignore[attr-defined]
        self._group = mesh.get_group() if mesh.ndim == 1 else None
        self._held = 0
        self.direct = direct
        #: Parameters gathered by each path since this gatherer was built.
        self.path_counts: dict[str, int] = {"direct": 0, "fallback": 0}
        self.fallback_reason: str | None = None
        self._buffer: torch.Tensor | None = None
        #: The layouts of the groups gathered into the buffer (kept only with ``keep_bytes``).
        self._layouts: dict[tuple[int, ...], _Layout] = {}
        self._fsdp_params = _fsdp_params(model)

    def module_params(self, module: nn.Module) -> list[tuple[str, Any]]:
        """``module``'s own parameters, each as its sharded DTensor whatever FSDP's state: after a forward that was
        not followed by a backward (an eval or no-grad pass), ``fully_shard`` leaves the root's parameters
        (embeddings, final norm, ``lm_head``) unsharded, registered as other objects that the next reshard frees."""
        return [(n, self._sharded(module, n, p)) for n, p in module._parameters.items() if p is not None]

    def param(self, module: nn.Module, name: str) -> Any:
        return self._sharded(module, name, super().param(module, name))

    def local_shard(self, param: Any) -> torch.Tensor | tuple[torch.Tensor, ...] | None:
        """This rank's shard of a DTensor parameter (``to_local()``); a plain parameter whole."""
        if is_dtensor(param):
            local: torch.Tensor = param.detach().to_local()
            return local
        return super().local_shard(param)

    def flat_range(self, param: Any, numel: int) -> FlatRange | str:
        """This rank's ``Shard(0)`` local shard of a DTensor parameter as a flat range (``flat_range`` in the gatherer
        contract): whole rows, from its first row's offset. Other placements, and a shard that is not contiguous,
        cannot say."""
        if not is_dtensor(param):
            return super().flat_range(param, numel)
        from torch.distributed.tensor import Shard
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        placements = tuple(param.placements)
        if param.device_mesh.ndim != 1 or placements != (Shard(0),):
            return f"an FSDP2 placement other than Shard(0) on one mesh dimension: {placements}"
        local = param.detach().to_local()
        _, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, placements)
        row = 1
        for d in param.shape[1:]:
            row *= int(d)
        if not local.is_contiguous():
            return "an FSDP2 local shard that is not contiguous"
        return FlatRange(int(offset[0]) * row, local.reshape(-1))

    def _sharded(self, module: nn.Module, name: str, registered: Any) -> Any:
        fsdp_param = self._fsdp_params.get((id(module), name))
        return fsdp_param.sharded_param if fsdp_param is not None else registered

    @property
    def reuses_buffers(self) -> bool:
        """The direct path reuses its buffer for every group (the stream copies unmerged outputs out of it)."""
        return self.direct

    def direct_refusal(self, p: Any) -> str | None:
        """Why ``p`` cannot take the direct path (``None``: it can). Depends only on the parameter's placement, mesh
        and device, which every rank shares."""
        from torch.distributed.tensor import Shard

        if not self.direct:
            return "direct=False"
        mesh = p.device_mesh
        if mesh.ndim != 1 or self._group is None or mesh.get_group() is not self._group:
            return "a mesh of more than one dimension or another process group"
        if tuple(p.placements) != (Shard(0),):
            return f"placements {tuple(p.placements)}"
        if p.to_local().device.type != mesh.device_type:
            return "a shard on another device than the mesh's (CPU offload)"
        if p.dim() == 0:
            return "a 0-dimensional parameter"
        return None

    @contextmanager
    def gather(self, params: Sequence[nn.Parameter]) -> Iterator[FullTensor]:
        self.kept_bytes = 0  # a pass is running: its buffer is in use again, counted as its groups' bytes
        whole: dict[int, torch.Tensor] = {}
        try:
            with torch.no_grad():
                unique = [p for p in {id(p): p for p in params}.values() if is_dtensor(p)]
                kept = self._layouts.get(tuple(id(p) for p in unique))
                # A kept layout holds these very parameters, all of which took the direct path; a refusal depends
                # only on a parameter's placement, mesh and device, none of which FSDP2 changes on an object.
                direct = list(unique) if self.direct and kept is not None and kept.buf is self._buffer else []
                for p in unique if not direct else ():
                    reason = self.direct_refusal(p)
                    if reason is None:
                        direct.append(p)
                        continue
                    self.path_counts["fallback"] += 1
                    self.fallback_reason = reason
                    whole[id(p)] = full = _whole(p)
                    self._held += full.numel() * full.element_size()
                whole.update(self._gather_direct(direct))

            def full_of(p: nn.Parameter) -> torch.Tensor:
                t = whole.get(id(p))
                return t if t is not None else p.detach()

            yield full_of
        finally:
            whole.clear()
            self._held = 0

    def _gather_direct(self, params: list[Any]) -> dict[int, torch.Tensor]:
        import torch.distributed as dist

        if not params:
            return {}
        key = tuple(id(p) for p in params)
        layout = self._layouts.get(key)
        if layout is None or layout.buf is not self._buffer:
            layout = self._lay_out(params)
            if self.keep_bytes and self._cache_layouts:  # the buffer may outlive the pass: so may its views
                self._layouts[key] = layout
        out = dict(layout.full)
        self._held += layout.whole_bytes
        handles = []
        copy_out = None
        if layout.flat is not None:
            locals_ = [p.to_local().detach().contiguous().view(-1).view(torch.uint8) for p in layout.small]
            handles.append(layout.flat.start(locals_, self._group))
            copy_out = layout.flat.copy_out
        for p, gathered, n_send in layout.large:
            local = p.to_local().detach()
            if local.numel() == n_send and local.is_contiguous():
                send = local.reshape(-1)
            else:  # the last ranks' shards are shorter (or empty): pad to the common chunk
                send = torch.zeros(n_send, dtype=p.dtype, device=gathered.device)
                send[: local.numel()].copy_(local.reshape(-1))
            handles.append(dist.all_gather_into_tensor(gathered, send, group=self._group, async_op=True))
        for h in handles:
            h.wait()
        if copy_out is not None:
            copy_out()
        self.path_counts["direct"] += len(params)
        return out

    def _lay_out(self, params: list[Any]) -> _Layout:
        """Where ``params`` go in the buffer (grown if needed): what :meth:`_gather_direct` all-gathers into."""
        import torch.distributed as dist

        world = dist.get_world_size(self._group)  # type: ignore[arg-type]
        placed = []
        size = 0
        for p in params:
            rows = p.shape[0]
            chunk = -(-rows // world)
            row_numel = p.numel() // rows if rows else 0
            n = chunk * row_numel * world * p.element_size()
            placed.append((p, size, n))
            size = aligned(size + n)
        small, staging = coalesced(placed, self.coalesce_bytes, world)  # one flat all-gather for the small ones
        old = self._buffer
        buf = self._buffer = reusable_buffer(old, size + staging, params[0].to_local().device)
        if buf is not old:
            self._layouts.clear()  # views into the old buffer: let it go
        layout = _Layout(buf, sum(p.numel() * p.element_size() for p in params))
        layout.small, layout.flat, flat = flat_part(buf, small, size, staging, world)
        for p, off, n in placed:
            gathered = buf.narrow(0, off, n).view(p.dtype)
            layout.full[id(p)] = gathered.narrow(0, 0, p.numel()).view(p.shape)
            if id(p) not in flat:
                layout.large.append((p, gathered, n // world // p.element_size()))
        return layout

    def end_pass(self) -> None:
        """Free the pass's gather buffer, or keep it when it holds at most ``keep_bytes`` (the stream calls this
        when a pass ends)."""
        self._keep_or_release(self._buffer.numel() if self._buffer is not None else 0)

    def release(self) -> None:
        self._buffer = None
        self._layouts = {}
        super().release()

    def held_bytes(self) -> int:
        """Whole bytes of the group's parameters held gathered because of the stream; between passes, the buffer
        kept for the next one (``keep_bytes``)."""
        return self._held + self.kept_bytes
