"""The trainer side of lora_stream's weight-transfer backend: a ``TrainerWeightTransferEngine`` vLLM's factory can
build, and :func:`send_to_engines`, one pass of a stream into several servers' groups.

Each engine is the sending end of one server's group (its workers, gloo or nccl). Every trainer rank iterates the
source (a :class:`~lora_stream.ParamStream`), because its gathers are collectives; a rank that feeds servers: sends
each server the metadata once (``/update_weights``, on a helper thread, since the server answers only once every
byte arrived), packs the stream's tensors into chunks as they are produced (so at most two chunk buffers are held
beyond the stream's own group, whatever the number of servers), broadcasts each chunk to each of its groups, and
looks at each server's HTTP call between chunks so that a server-side failure ends that server's update at once
instead of at the broadcast timeout.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import errno
import secrets
import socket
import time
import warnings
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, closing, nullcontext
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from vllm.distributed.weight_transfer.base import (  # type: ignore[import-not-found,unused-ignore]
    TrainerInitInfo,
    TrainerWeightTransferEngine,
)

from ..errors import TransferError
from ..units import merge_units
from .group import TransferGroup
from .packing import ChunkPlan, plan_chunks
from .protocol import STAGED_KEY, TIMING_KEY, VERIFY_KEY

#: Seconds to wait for the workers' reports (timing, verification) to reach the store once the server answered.
REPORT_WAIT_S = 5.0

__all__ = ["TrainerTransferInitInfo", "TrainerTransferEngine", "TransferError", "send_to_engines"]


@dataclass(kw_only=True)
class TrainerTransferInitInfo(TrainerInitInfo):  # type: ignore[misc]
    backend: ClassVar[str] = "gloo"
    #: The address the store listens on, and only it: an address of the trainer's machine that the server reaches.
    master_address: str
    #: 0 (the default): an ephemeral port, bound by ``trainer_init`` and handed to the store without closing it.
    master_port: int = 0
    world_size: int
    buffer_bytes: int = 256 * 1024 * 1024
    timeout_s: float = 120.0
    #: The data plane's collective: ``"gloo"`` or ``"nccl"`` (:data:`~lora_stream.transfer.protocol.TRANSPORTS`).
    transport: str = "gloo"


def _listen(address: str, port: int) -> socket.socket:
    """The store's listening socket on ``(address, port)``; a given port that is taken (another job, or this rank's
    previous group whose store is not closed yet) gives way to an ephemeral one, with a warning: the rendezvous
    still forms wherever the server reaches this address on any port."""
    try:
        return TransferGroup.listen(address, port)
    except OSError as exc:
        if not port or exc.errno != errno.EADDRINUSE:
            raise
        warnings.warn(
            f"lora_stream: port {port} on {address} is taken, so the weight-transfer store listens on an ephemeral "
            f"port instead ({exc.strerror}); if a firewall admits only port {port}, free it or choose another "
            "master_port",
            RuntimeWarning,
            stacklevel=4,
        )
        return TransferGroup.listen(address, 0)


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
                error = TransferError(f"a chunk broadcast did not complete within {timeout_s} s")
                error.stalled = True
                raise error
            time.sleep(0.0002)
        work.wait()
    except RuntimeError as exc:  # gloo: the server's worker went away ("Connection closed by peer")
        raise TransferError(f"the data plane to the vLLM server broke mid-transfer: {exc}") from exc


class TrainerTransferEngine(TrainerWeightTransferEngine[TrainerTransferInitInfo]):  # type: ignore[misc]
    """Sends a ``WeightSource`` to vLLM's workers over the transfer group (gloo or nccl); the workers'
    :class:`~lora_stream.engine.receiver.WorkerTransferEngine` receives it.

    The weight version the server reports after a sync is the source's ``weight_version`` attribute, if it has one
    (:class:`~lora_stream.sinks.source.SyncSource` does), so the engine is never reconfigured between syncs.
    """

    group: Any = None
    init_info: TrainerTransferInitInfo
    #: Set by a transactional sink: ``send_weights`` leaves vLLM's update session open (the workers keep what the
    #: update replaced), and the sink ends it with :meth:`conclude` once the trainer ranks have voted.
    deferred: bool = False
    #: Whether the workers keep a copy to roll the update back (sent with the update).
    keep_previous: bool = False
    #: An adapter sync: where the version this engine's server serves now is staged (kept while the new one may
    #: still be refused), set by the sink per server.
    adapter_keep: str | None = None
    #: Where the latest pass's update stands, for a sink settling a failed transfer: vLLM's session was opened
    #: (``started``); the pending ``/update_weights`` call (``pending``: it answers once the workers loaded and
    #: checked every chunk, or failed); the server stopped taking chunks within the timeout (``stalled``).
    started: bool = False
    pending: Any = None
    stalled: bool = False
    #: The verification probe the workers run through the weights they serve before loading this sync's update
    #: (``None``: this sync is not verified), set by the sink per sync.
    probe_ids: list[int] | None = None
    #: A verified sync: the workers digest every tensor they receive (set by the sink per sync).
    digest_received: bool = False
    #: A partial sync: the sync whose committed weights this server's workers must hold (set by the sink per sync).
    base_sync: str | None = None
    #: The pass only stages the update (``TransferUpdateInfo.stage``): the workers receive it on a thread and load
    #: nothing; the sink loads it later with :meth:`load_staged` (set by the sink per sync).
    stage: bool = False
    #: The update message of the latest pass (what :meth:`load_staged` sends again, to load what it staged).
    last_update: dict[str, Any] | None = None
    #: What the workers reported after the latest update: the checkpoint names their modules read together
    #: (``LoadReport.units``, merged over the workers; ``None``: unknown).
    last_units: list[list[str]] | None = None
    #: Seconds of the latest ``send_weights`` by stage: ``produce_s`` (waiting for the stream: gathers and merges),
    #: ``pack_s`` (copies into the packing buffers), ``send_wait_s`` (waiting for broadcasts), ``sent_bytes`` (what
    #: this rank broadcast, over every server it fed in the pass), ``http_s`` (the
    #: weight-update calls, minus the time the update's reply overlapped the transfer), and ``worker``, the server
    #: workers' own timing (``recv_wait_s``, ``unpack_s``, ``load_s``: vLLM's ``load_weights``, ``finish_s``: vLLM's
    #: reload finalisation and lora_stream's check) and ``kept_bytes`` (what every worker together keeps to undo the
    #: update until the decision: its copies and the old packed kernels).
    last_stages: dict[str, Any]

    @classmethod
    def trainer_init(
        cls, init_info: TrainerTransferInitInfo, *, client: Any, source: Any = None
    ) -> TrainerTransferEngine:
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
        listener = _listen(init_info.master_address, init_info.master_port)
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
            "transport": init_info.transport,
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
                    transport=init_info.transport,
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
        """vLLM's ``send_weights``: one pass of the source to this engine's workers (every trainer rank calls it;
        only the sender sends)."""
        send_to_engines([self] if self.is_sender else [], self.source)

    def update_info(self, meta: Sequence[Any], groups: Sequence[Sequence[str]], plan: ChunkPlan) -> dict[str, Any]:
        """The update's metadata message (``TransferUpdateInfo``'s fields), sent once before any byte."""
        source: Any = self.source
        adapter = getattr(source, "adapter", None)
        return {
            "names": [m.name for m in meta],
            "dtype_names": [str(m.dtype).removeprefix("torch.") for m in meta],
            "shapes": [list(m.shape) for m in meta],
            "group_sizes": [len(g) for g in groups],
            "chunk_sizes": [len(c) for c in plan.chunks],
            # Tied aliases: the worker loads each only if its model holds a parameter of that name.
            "optional_names": list(getattr(source, "aliases", [])),
            # An adapter sync: the worker stages the tensors for vLLM's add_lora instead of loading them.
            "adapter": None if adapter is None else {**adapter, "keep": self.adapter_keep},
            "rollback": self.keep_previous,
            "probe_ids": self.probe_ids,
            "digest": self.digest_received,
            "base": self.base_sync,
            "merge": getattr(source, "merge_info", None),
            "elements": getattr(source, "element_info", None),
            "stage": self.stage,
            # Where the workers say their receive ended, and what the update that loads it must name: new per pass.
            "stage_id": secrets.token_hex(8) if self.stage else "",
        }

    def await_staged(self, wait_s: float) -> None:
        """Sender only, after a pass with :attr:`stage` set: wait, at most ``wait_s`` seconds, until every worker
        said in this group's store that its receive ended (the whole update received, its element payloads decoded
        and checked), then ask what failed there (``command="staged"``, which answers at once). Generation goes on
        meanwhile: nothing is loaded, and no call holds vLLM's engine loop while the workers receive.

        Raises :class:`TimeoutError` if a worker did not say so in time (its server's update session stays open,
        for the sink's abort to end), or the server's error answer (the workers ended the session)."""
        import datetime

        if not self.is_sender:
            return
        update = self._staged_update()
        store = self.group.store
        names = [
            STAGED_KEY.format(stage_id=update["stage_id"], rank=rank) for rank in range(1, self.init_info.world_size)
        ]
        try:
            store.wait(names, datetime.timedelta(seconds=max(wait_s, 0.001)))
        except Exception as exc:
            raise TimeoutError(f"the server's workers did not receive the staged update within {wait_s:.3g} s") from exc
        for name in names:
            try:
                store.delete_key(name)
            except Exception:  # a key left behind is never read again: the next pass draws another id
                pass
        self.client.update_weights({"command": "staged"})

    def load_staged(self) -> None:
        """Sender only, after :meth:`await_staged`: load what the workers staged, as the pass's update would have
        (the same message, ``staged=True``: no byte travels again); answers once loaded and checked."""
        if not self.is_sender:
            return
        update, self.last_update = self._staged_update(), None  # loaded once
        self.client.update_weights({**update, "stage": False, "staged": True})
        self.last_stages = {**self.last_stages, "worker": self._worker_timing()}

    def _staged_update(self) -> dict[str, Any]:
        """The latest pass's update, which must have been staged: anything else would load nothing and let the
        sink commit a server that holds the old weights under the new version."""
        update = self.last_update
        if update is None or not update.get("stage"):
            raise RuntimeError("lora_stream: no staged update to wait for or load on this engine (a sink bug)")
        return update

    def conclude(self, commit: bool, version: str | None, sync: str | None = None) -> None:
        """Sender only, after ``send_weights`` with ``deferred`` set: tell the workers the trainer's decision on the
        update they loaded (``commit``, under the sync id ``sync`` they then hold, or put every module back), then
        finish vLLM's update session, moving the weight version only on commit."""
        if not self.is_sender:
            return
        self.client.update_weights({"command": "commit", "sync": sync} if commit else {"command": "rollback"})
        self.client.finish_weight_update(version if commit else None)

    def worker_reports(self, key: str, wait_s: float = REPORT_WAIT_S) -> dict[int, dict[str, Any]]:
        """What each server worker left in this group's store under ``key`` (a format with ``{rank}``), by worker
        rank, each read once (deleted, so never read as the next update's). A worker that left nothing within
        ``wait_s`` is absent.

        Read after the server answered the call that made the workers write: a store ``set`` is not acknowledged,
        so the worker's write may still be on its way to the store when the answer arrives; hence the wait."""
        import datetime
        import json

        out: dict[int, dict[str, Any]] = {}
        store = getattr(self.group, "store", None)
        if store is None:
            return out
        names = [key.format(rank=rank) for rank in range(1, self.init_info.world_size)]
        try:
            store.wait(names, datetime.timedelta(seconds=wait_s))
        except Exception:  # one never came: the others are read as they are
            pass
        for rank, name in enumerate(names, start=1):
            try:
                if not store.check([name]):  # get() would block until the store's timeout
                    continue
                out[rank] = json.loads(store.get(name).decode())
                store.delete_key(name)
            except Exception:
                continue
        return out

    def verification_reports(self) -> dict[int, dict[str, Any]]:
        """Each worker's verification of the update it holds (``{"command": "verify"}``), by worker rank."""
        return self.worker_reports(VERIFY_KEY)

    def _worker_timing(self) -> dict[str, float]:
        """The server workers' side of the latest update (what each left in the store): the slowest per stage, and
        the sum of every worker's bytes (``kept_bytes``: what the server keeps to undo the update)."""
        out: dict[str, float] = {}
        reports = list(self.worker_reports(TIMING_KEY).values())
        units: list[list[str]] | None = None
        for i, data in enumerate(reports):
            found = data.pop("units", None)
            units = found if i == 0 else merge_units(units, found)
            for k, v in data.items():
                out[k] = out.get(k, 0.0) + float(v) if k.endswith("_bytes") else max(out.get(k, 0.0), float(v))
        # Every worker must have reported (all of them hold a shard the next partial sync must leave whole).
        complete = len(reports) == self.init_info.world_size - 1
        self.last_units = units if complete else None
        return out

    def shutdown(self) -> None:
        group, self.group = self.group, None
        if group is not None:
            group.close()


class _Target:
    """One engine's update in a pass: its pending ``/update_weights`` call and its in-flight broadcasts."""

    def __init__(self, index: int, engine: TrainerTransferEngine, pending: Any) -> None:
        self.index = index
        self.engine = engine
        self.pending: concurrent.futures.Future[Any] = pending


def send_to_engines(
    engines: Sequence[TrainerTransferEngine],
    source: Any,
    *,
    on_failure: Callable[[int, BaseException], None] | None = None,
) -> None:
    """One pass over ``source``, sent to every engine in ``engines`` (each its own group of server workers): each
    tensor is produced once, packed once, and its chunk broadcast once per group while the next one is packed.

    Every trainer rank iterates the source (its gathers are collectives); a rank with no engines only iterates. A
    failure of the source, or of an engine when ``on_failure`` is ``None``, ends the pass for every trainer rank
    with its reason (``SyncSource.batches``). With ``on_failure``, an engine that fails (its server refused the
    update, or its data plane broke) is dropped from the pass, ``on_failure(index, error)`` is called, and the pass
    goes on for the others; the caller then owns that engine's cleanup. Engines are concluded by the caller when
    they are ``deferred``; otherwise their update session is finished here.
    """
    if not engines:
        with _ending(source) as batches:
            for _ in batches:
                pass  # the gathers are collectives: every trainer rank produces the stream in lockstep
        return
    first = engines[0]
    meta = source.metadata()
    groups = source.groups()
    plan = plan_chunks(
        [list(m.shape) for m in meta], [m.dtype for m in meta], [len(g) for g in groups], first.init_info.buffer_bytes
    )
    for engine in engines[1:]:
        if engine.init_info.buffer_bytes != first.init_info.buffer_bytes:
            raise ValueError("engines fed by one pass must share buffer_bytes (one packing plan)")
    chunk_of = {i: c for c, members in enumerate(plan.chunks) for i in members}
    timeout = first.init_info.timeout_s
    clock = time.perf_counter
    stages = {"produce_s": 0.0, "pack_s": 0.0, "send_wait_s": 0.0, "http_s": 0.0, "sent_bytes": 0}
    pool = concurrent.futures.ThreadPoolExecutor(len(engines))
    targets: list[_Target] = []

    def failed(target: _Target, exc: BaseException) -> None:
        if isinstance(exc, TransferError) and exc.stalled:
            target.engine.stalled = True
        if on_failure is None:
            raise exc
        targets.remove(target)
        on_failure(target.index, exc)

    try:
        t0 = clock()
        for engine in engines:
            engine.started, engine.pending, engine.stalled = False, None, False
        for i, engine in enumerate(engines):
            try:
                engine.client.start_weight_update()
                engine.started = True
                update = engine.last_update = engine.update_info(meta, groups, plan)
                engine.pending = pool.submit(engine.client.update_weights, update)
                targets.append(_Target(i, engine, engine.pending))
            except Exception as exc:
                if on_failure is None:
                    raise
                on_failure(i, exc)
        stages["http_s"] += clock() - t0
        largest_chunk = max((plan.chunk_bytes(c) for c in range(len(plan.chunks))), default=0)
        size = min(first.init_info.buffer_bytes, largest_chunk)
        # Two packing buffers: the next chunk is packed while the previous one is on the wire (to every group).
        device = first.group.device
        buffers = [
            torch.empty(size, dtype=torch.uint8, device=device),
            torch.empty(size if len(plan.chunks) > 1 else 0, dtype=torch.uint8, device=device),
        ]
        # In flight, oldest first: (buffer index or -1, payload kept alive, {target: work}).
        inflight: list[tuple[int, torch.Tensor, dict[_Target, Any]]] = []
        current = 0
        index = 0

        def start(payload: torch.Tensor, which: int) -> None:
            works: dict[_Target, Any] = {}
            for target in list(targets):
                try:
                    works[target] = _start(target.engine.group, payload)
                    stages["sent_bytes"] += payload.numel()
                except TransferError as exc:
                    failed(target, exc)
            inflight.append((which, payload, works))

        def wait_for(which: int | None) -> None:
            # Wait for the in-flight broadcasts that use buffer ``which`` (None: all of them), oldest first.
            while inflight and (which is None or any(b == which for b, _, _ in inflight)):
                _, _, works = inflight.pop(0)
                t = clock()
                for target, work in works.items():
                    if target not in targets:
                        continue  # dropped meanwhile
                    try:
                        if target.pending.done() and target.pending.exception() is not None:
                            # The server already failed the update: stop sending to it now, not at the end.
                            raise TransferError(
                                f"the server failed the update while receiving: {target.pending.exception()}"
                            )
                        _finish(work, target.pending, timeout)
                    except TransferError as exc:
                        failed(target, exc)
                stages["send_wait_s"] += clock() - t

        with _ending(source) as batches:  # a failure below ends the pass for every rank, with its reason
            t = clock()
            for names, tensors in batches:
                stages["produce_s"] += clock() - t
                for name, tensor in zip(names, tensors):
                    if index >= len(meta) or name != meta[index].name:
                        promised = meta[index].name if index < len(meta) else "nothing more"
                        raise TransferError(f"stream yielded {name!r} where metadata() promised {promised!r}")
                    if not targets:
                        index += 1  # every engine was dropped: the pass goes on for the other trainer ranks
                        continue
                    c = chunk_of[index]
                    members = plan.chunks[c]
                    alone = len(members) == 1 and plan.sizes[index] > size
                    if not alone and index == members[0]:
                        wait_for(current)  # the buffer's previous chunk must be off it (counted as waiting)
                    t = clock()
                    if alone:
                        # Larger than the buffer: it travels alone, as its own bytes (kept alive until sent).
                        start(tensor.to(device).contiguous().view(-1).view(torch.uint8), -1)
                    else:
                        off, n = plan.offsets[index], plan.sizes[index]
                        buf = buffers[current]
                        buf[off : off + n].copy_(tensor.contiguous().view(-1).view(torch.uint8))
                        if index == members[-1]:
                            start(buf[: plan.chunk_bytes(c)], current)
                            current = 1 - current if buffers[1].numel() else 0
                    stages["pack_s"] += clock() - t
                    index += 1
                t = clock()
            wait_for(None)
        if index != len(meta):
            raise TransferError(f"stream yielded {index} tensors where metadata() promised {len(meta)}")
        t = clock()
        for target in list(targets):
            try:
                target.pending.result(timeout=timeout)
            except concurrent.futures.TimeoutError:
                error = TransferError(f"the server did not answer the update within {timeout} s of its last chunk")
                error.stalled = True
                failed(target, error)
            except Exception as exc:
                failed(target, TransferError(f"the server failed the update: {exc}"))
        stages["http_s"] += clock() - t
    finally:
        pool.shutdown(wait=False)
    for target in list(targets):
        engine = target.engine
        if not engine.deferred:
            t = clock()
            try:
                engine.client.finish_weight_update(getattr(source, "weight_version", None))
            except Exception as exc:
                failed(target, exc)
                continue
            stages["http_s"] += clock() - t
        # A staged pass loaded nothing: the workers report once they load it (load_staged).
        engine.last_stages = {**stages, "worker": {} if engine.stage else engine._worker_timing()}
