"""The trainer side of the ``gloo`` backend: a ``TrainerWeightTransferEngine`` vLLM's factory can build.

Rank 0 of the trainer sends; every rank iterates the source (a :class:`~lora_stream.ParamStream`), because its gathers
are collectives. Per sync the sender: sends the metadata once (``/update_weights``, on a helper thread, since the
server answers only once every byte arrived), packs the stream's tensors into chunks as they are produced (so at
most one chunk buffer is held beyond the stream's own group), broadcasts each chunk, and polls the HTTP call between
chunks so that a server-side failure ends the sync at once instead of at the broadcast timeout.
"""

from __future__ import annotations

import concurrent.futures
import time
from contextlib import AbstractContextManager, closing, nullcontext
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from vllm.distributed.weight_transfer.base import (  # type: ignore[import-not-found,unused-ignore]
    TrainerInitInfo,
    TrainerWeightTransferEngine,
)

from ..errors import TransferError
from .gloo_engine import TransferGroup
from .packing import plan_chunks

__all__ = ["GlooTrainerInitInfo", "GlooTrainerWeightTransferEngine", "TransferError"]


@dataclass(kw_only=True)
class GlooTrainerInitInfo(TrainerInitInfo):  # type: ignore[misc]
    backend: ClassVar[str] = "gloo"
    master_address: str
    master_port: int
    world_size: int
    buffer_bytes: int = 256 * 1024 * 1024
    timeout_s: float = 120.0


def _ending(source: Any) -> AbstractContextManager[Any]:
    """The source's groups, in a block that ends its pass when it exits: lora_stream's ``SyncSource.batches()``
    also sends the exception that ended it to the other trainer ranks; another source's iterator is closed if it
    can be."""
    if hasattr(source, "batches"):
        return source.batches()  # type: ignore[no-any-return]
    batches = source.iter_groups()
    return closing(batches) if hasattr(batches, "close") else nullcontext(batches)


def _send(
    group: TransferGroup, payload: torch.Tensor, pending: concurrent.futures.Future[Any], timeout_s: float
) -> None:
    """Broadcast one chunk, failing fast if the server's HTTP call already failed or the data plane broke."""
    deadline = time.monotonic() + timeout_s
    try:
        work = group.broadcast(payload)
        while not work.is_completed():
            if pending.done() and pending.exception() is not None:
                raise TransferError(f"the server failed the update while receiving: {pending.exception()}")
            if time.monotonic() > deadline:
                raise TransferError(f"a chunk broadcast did not complete within {timeout_s} s")
            time.sleep(0.0005)
        work.wait()
    except RuntimeError as exc:  # gloo: the server's worker went away ("Connection closed by peer")
        raise TransferError(f"the data plane to the vLLM server broke mid-transfer: {exc}") from exc


class GlooTrainerWeightTransferEngine(TrainerWeightTransferEngine[GlooTrainerInitInfo]):  # type: ignore[misc]
    """Sends a ``WeightSource`` to vLLM's workers over a gloo group (see ``gloo_engine`` for the receiving side).

    The weight version the server reports after a sync is the source's ``weight_version`` attribute, if it has one
    (:class:`~lora_stream.sinks.source.SyncSource` does), so the engine is never reconfigured between syncs.
    """

    group: Any = None
    init_info: GlooTrainerInitInfo

    @classmethod
    def trainer_init(
        cls, init_info: GlooTrainerInitInfo, *, client: Any, source: Any = None
    ) -> GlooTrainerWeightTransferEngine:
        engine = cls(client=client, source=source, is_sender=init_info.is_sender)
        engine.init_info = init_info
        if not engine.is_sender:
            return engine
        payload = {
            "master_address": init_info.master_address,
            "master_port": init_info.master_port,
            "world_size": init_info.world_size,
            "rank_offset": 1,
            "buffer_bytes": init_info.buffer_bytes,
            "timeout_s": init_info.timeout_s,
        }
        # Both sides block in the rendezvous, so the HTTP call runs on a thread while this one hosts the store.
        pool = concurrent.futures.ThreadPoolExecutor(1)
        try:
            pending = pool.submit(client.init_weight_transfer_engine, payload)
            try:
                engine.group = TransferGroup(
                    init_info.master_address, init_info.master_port, 0, init_info.world_size, init_info.timeout_s
                )
            except Exception as exc:
                if pending.done() and pending.exception() is not None:
                    raise TransferError(
                        f"the server refused to join the transfer group: {pending.exception()}"
                    ) from exc
                raise
            pending.result(timeout=init_info.timeout_s)
        finally:
            pool.shutdown(wait=False)
        return engine

    def send_weights(self) -> None:
        source: Any = self.source
        if not self.is_sender:
            with _ending(source) as batches:
                for _ in batches:
                    pass  # the gathers are collectives: every trainer rank produces the stream in lockstep
            return
        meta = source.metadata()
        groups = source.groups()
        dtypes = [m.dtype for m in meta]
        shapes = [list(m.shape) for m in meta]
        plan = plan_chunks(shapes, dtypes, [len(g) for g in groups], self.init_info.buffer_bytes)
        chunk_of = {i: c for c, members in enumerate(plan.chunks) for i in members}
        update = {
            "names": [m.name for m in meta],
            "dtype_names": [str(d).removeprefix("torch.") for d in dtypes],
            "shapes": shapes,
            "group_sizes": [len(g) for g in groups],
            "chunk_sizes": [len(c) for c in plan.chunks],
            # Tied aliases: the worker loads each only if its model holds a parameter of that name.
            "optional_names": list(getattr(source, "aliases", [])),
            # An adapter sync: the worker stages the tensors for vLLM's add_lora instead of loading them.
            "adapter": getattr(source, "adapter", None),
        }
        timeout = self.init_info.timeout_s
        self.client.start_weight_update()
        pool = concurrent.futures.ThreadPoolExecutor(1)
        try:
            pending = pool.submit(self.client.update_weights, update)
            largest_chunk = max((plan.chunk_bytes(c) for c in range(len(plan.chunks))), default=0)
            buffer = torch.empty(min(self.init_info.buffer_bytes, largest_chunk), dtype=torch.uint8)
            index = 0
            with _ending(source) as batches:  # a failure below ends the pass for every rank, with its reason
                for names, tensors in batches:
                    for name, tensor in zip(names, tensors):
                        if index >= len(meta) or name != meta[index].name:
                            promised = meta[index].name if index < len(meta) else "nothing more"
                            raise TransferError(f"stream yielded {name!r} where metadata() promised {promised!r}")
                        c = chunk_of[index]
                        members = plan.chunks[c]
                        if len(members) == 1 and plan.sizes[index] > buffer.numel():
                            # Larger than the buffer: it travels alone, as its own bytes.
                            payload = tensor.contiguous().view(-1).view(torch.uint8)
                        else:
                            off, n = plan.offsets[index], plan.sizes[index]
                            buffer[off : off + n].copy_(tensor.contiguous().view(-1).view(torch.uint8))
                            payload = buffer[: plan.chunk_bytes(c)] if index == members[-1] else None
                        if payload is not None:
                            _send(self.group, payload, pending, timeout)
                        index += 1
            if index != len(meta):
                raise TransferError(f"stream yielded {index} tensors where metadata() promised {len(meta)}")
            try:
                pending.result(timeout=timeout)
            except Exception as exc:
                raise TransferError(f"the server failed the update: {exc}") from exc
        finally:
            pool.shutdown(wait=False)
        self.client.finish_weight_update(getattr(source, "weight_version", None))

    def shutdown(self) -> None:
        group, self.group = self.group, None
        if group is not None:
            group.close()
