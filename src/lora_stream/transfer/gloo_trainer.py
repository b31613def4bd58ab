"""The trainer side of the ``gloo`` backend: a ``TrainerWeightTransferEngine`` vLLM's factory can build.

Rank 0 of the trainer sends; every rank iterates the source (a :class:`~lora_stream.ParamStream`), because its gathers
are collectives. Per sync the sender: sends the metadata once (``/update_weights``, on a helper thread, since the
server answers only once every byte arrived), packs the stream's tensors into chunks as they are produced (so at
most one chunk buffer is held beyond the stream's own group), broadcasts each chunk, and polls the HTTP call between
chunks so that a server-side failure ends the sync at once instead of at the broadcast timeout.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import secrets
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
from .gloo_engine import TIMING_KEY, TransferGroup
from .packing import plan_chunks

__all__ = ["GlooTrainerInitInfo", "GlooTrainerWeightTransferEngine", "TransferError"]


@dataclass(kw_only=True)
class GlooTrainerInitInfo(TrainerInitInfo):  # type: ignore[misc]
    backend: ClassVar[str] = "gloo"
    #: The address the store listens on, and only it: an address of the trainer's machine that the server reaches.
    master_address: str
    #: 0 (the default): an ephemeral port, bound by ``trainer_init`` and handed to the store without closing it.
    master_port: int = 0
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


def _start(group: TransferGroup, payload: torch.Tensor) -> Any:
    try:
        return group.broadcast(payload)
    except RuntimeError as exc:  # gloo: the server's worker went away ("Connection closed by peer")
        raise TransferError(f"the data plane to the vLLM server broke mid-transfer: {exc}") from exc


def _finish(work: Any, pending: concurrent.futures.Future[Any], timeout_s: float) -> None:
    """Wait for one chunk's broadcast, failing fast if the server's HTTP call already failed or the data plane
    broke. The HTTP call is only looked at while waiting, never between chunks that complete."""
    deadline = time.monotonic() + timeout_s
    try:
        while not work.is_completed():
            if pending.done() and pending.exception() is not None:
                raise TransferError(f"the server failed the update while receiving: {pending.exception()}")
            if time.monotonic() > deadline:
                raise TransferError(f"a chunk broadcast did not complete within {timeout_s} s")
            time.sleep(0.0002)
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
    #: Set by a transactional sink: ``send_weights`` leaves vLLM's update session open (the workers keep what the
    #: update replaced), and the sink ends it with :meth:`conclude` once the trainer ranks have voted.
    deferred: bool = False
    #: Whether the workers keep a copy to roll the update back (sent with the update).
    keep_previous: bool = False
    #: Seconds of the latest ``send_weights`` by stage: ``produce_s`` (waiting for the stream: gathers and merges),
    #: ``pack_s`` (copies into the packing buffers), ``send_wait_s`` (waiting for broadcasts), ``http_s`` (the
    #: weight-update calls, minus the time the update's reply overlapped the transfer), and ``worker``, the server
    #: workers' own timing (``recv_wait_s``, ``unpack_s``, ``load_s``: vLLM's ``load_weights``, ``finish_s``: vLLM's
    #: reload finalisation and lora_stream's check).
    last_stages: dict[str, Any]

    @classmethod
    def trainer_init(
        cls, init_info: GlooTrainerInitInfo, *, client: Any, source: Any = None
    ) -> GlooTrainerWeightTransferEngine:
        engine = cls(client=client, source=source, is_sender=init_info.is_sender)
        engine.init_info = init_info
        engine.last_stages = {}
        if not engine.is_sender:
            return engine
        # 128 random bits, new for every group: only a process that holds it can join the group. It travels only in
        # the body of the guarded /init_weight_transfer_engine call, and is never logged.
        secret = secrets.token_hex(16)
        # The store's socket is bound (and its port read) before the server is told the port, and handed to the
        # store as it is: never closed and re-bound, so no other process can take the port in between.
        listener = TransferGroup.listen(init_info.master_address, init_info.master_port)
        port = int(listener.getsockname()[1])
        engine.init_info = dataclasses.replace(init_info, master_port=port)
        payload = {
            "master_address": init_info.master_address,
            "master_port": port,
            "world_size": init_info.world_size,
            "rank_offset": 1,
            "buffer_bytes": init_info.buffer_bytes,
            "timeout_s": init_info.timeout_s,
            "secret": secret,
        }
        # Both sides block in the rendezvous, so the HTTP call runs on a thread while this one hosts the store.
        pool = concurrent.futures.ThreadPoolExecutor(1)
        try:
            pending = pool.submit(client.init_weight_transfer_engine, payload)
            try:
                engine.group = TransferGroup(
                    init_info.master_address,
                    port,
                    0,
                    init_info.world_size,
                    init_info.timeout_s,
                    secret=secret,
                    listener=listener,
                )
            except Exception as exc:
                if pending.done() and pending.exception() is not None:
                    raise TransferError(
                        f"the server refused to join the transfer group: {pending.exception()}"
                    ) from exc
                raise
            pending.result(timeout=init_info.timeout_s)
        finally:
            listener.close()  # a no-op once the store took it over
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
            "rollback": self.keep_previous,
        }
        timeout = self.init_info.timeout_s
        clock = time.perf_counter
        stages = {"produce_s": 0.0, "pack_s": 0.0, "send_wait_s": 0.0, "http_s": 0.0}
        t0 = clock()
        self.client.start_weight_update()
        stages["http_s"] += clock() - t0
        pool = concurrent.futures.ThreadPoolExecutor(1)
        try:
            pending = pool.submit(self.client.update_weights, update)
            largest_chunk = max((plan.chunk_bytes(c) for c in range(len(plan.chunks))), default=0)
            size = min(self.init_info.buffer_bytes, largest_chunk)
            # Two packing buffers: the next chunk is packed while the previous one is on the wire.
            buffers = [
                torch.empty(size, dtype=torch.uint8),
                torch.empty(size if len(plan.chunks) > 1 else 0, dtype=torch.uint8),
            ]
            inflight: list[tuple[Any, int, torch.Tensor]] = []  # (work, buffer index or -1, payload kept alive)
            current = 0
            index = 0

            def wait_for(which: int | None) -> None:
                # Wait for the in-flight broadcasts that use buffer ``which`` (None: all of them), oldest first.
                while inflight and (which is None or any(b == which for _, b, _ in inflight)):
                    work, _, _ = inflight.pop(0)
                    t = clock()
                    _finish(work, pending, timeout)
                    stages["send_wait_s"] += clock() - t

            with _ending(source) as batches:  # a failure below ends the pass for every rank, with its reason
                t = clock()
                for names, tensors in batches:
                    stages["produce_s"] += clock() - t
                    for name, tensor in zip(names, tensors):
                        if index >= len(meta) or name != meta[index].name:
                            promised = meta[index].name if index < len(meta) else "nothing more"
                            raise TransferError(f"stream yielded {name!r} where metadata() promised {promised!r}")
                        c = chunk_of[index]
                        members = plan.chunks[c]
                        alone = len(members) == 1 and plan.sizes[index] > size
                        if not alone and index == members[0]:
                            wait_for(current)  # the buffer's previous chunk must be off it (counted as waiting)
                        t = clock()
                        if alone:
                            # Larger than the buffer: it travels alone, as its own bytes (kept alive until sent).
                            payload = tensor.contiguous().view(-1).view(torch.uint8)
                            inflight.append((_start(self.group, payload), -1, payload))
                        else:
                            off, n = plan.offsets[index], plan.sizes[index]
                            buf = buffers[current]
                            buf[off : off + n].copy_(tensor.contiguous().view(-1).view(torch.uint8))
                            if index == members[-1]:
                                payload = buf[: plan.chunk_bytes(c)]
                                inflight.append((_start(self.group, payload), current, payload))
                                current = 1 - current if buffers[1].numel() else 0
                        stages["pack_s"] += clock() - t
                        index += 1
                    t = clock()
                wait_for(None)
            if index != len(meta):
                raise TransferError(f"stream yielded {index} tensors where metadata() promised {len(meta)}")
            t = clock()
            try:
                pending.result(timeout=timeout)
            except Exception as exc:
                raise TransferError(f"the server failed the update: {exc}") from exc
            stages["http_s"] += clock() - t
        finally:
            pool.shutdown(wait=False)
        if not self.deferred:
            t = clock()
            self.client.finish_weight_update(getattr(source, "weight_version", None))
            stages["http_s"] += clock() - t
        stages["worker"] = self._worker_timing()  # type: ignore[assignment]
        self.last_stages = stages

    def conclude(self, commit: bool, version: str | None) -> None:
        """Sender only, after ``send_weights`` with ``deferred`` set: tell the workers the trainer's decision on the
        update they loaded (``commit``, or put every module back), then finish vLLM's update session, moving the
        weight version only on commit."""
        if not self.is_sender:
            return
        self.client.update_weights({"command": "commit" if commit else "rollback"})
        self.client.finish_weight_update(version if commit else None)

    def _worker_timing(self) -> dict[str, float]:
        """The server workers' side of the latest update (what each left in the store): the slowest per stage."""
        import json

        out: dict[str, float] = {}
        store = getattr(self.group, "store", None)
        if store is None:
            return out
        for rank in range(1, self.init_info.world_size):
            key = TIMING_KEY.format(rank=rank)
            try:
                if not store.check([key]):  # get() would block until the store's timeout
                    continue
                data = json.loads(store.get(key).decode())
                store.delete_key(key)  # never read as the next update's timing
            except Exception:
                continue
            for k, v in data.items():
                out[k] = max(out.get(k, 0.0), float(v))
        return out

    def shutdown(self) -> None:
        group, self.group = self.group, None
        if group is not None:
            group.close()
