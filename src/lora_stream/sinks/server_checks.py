"""Step 1 of a sync on a server (:mod:`lora_stream.sinks.route`), before anything is sent: what the route reads of
its sink (:class:`ServerSinkView`), and the checks of each server this rank feeds -- reachable, the key accepted, its
lease and status read, the stream against the checkpoint it serves, lora_stream's engine there
(:class:`ServerChecks`, a part of :class:`~lora_stream.sinks.server_route.ServerRoute`).

Who calls it: the route's pre-flight at every sync, and :meth:`VLLMServerSink.preflight
<lora_stream.VLLMServerSink.preflight>` (the TRL hook, at install). What breaks if it is bypassed: a refusal would come
after a server was paused, or a partial sync would trust a server restarted under it.
"""

from __future__ import annotations

import warnings
from typing import Any, Protocol

from ..adapter import ADAPTER_PREFIX, AdapterStream
from ..errors import LoraStreamError
from ..stream import ParamStream
from .memory import SinkMemory
from .preflight import EngineCheckpoint, adapter_preflight, preflight
from .server_client import ServerError, validate_adapter
from .server_replica import (
    CurrentSource,
    Replica,
)

__all__ = ["ServerChecks", "ServerSinkView", "refuse_verified_adapter"]


def refuse_verified_adapter(stream: ParamStream, verifying: bool) -> None:
    """An adapter sync that would be verified on a server is refused: the workers' probe runs through the served
    model without vLLM's LoRA layers. Called by each sync's pre-flight, and by :meth:`VLLMServerSink.preflight
    <lora_stream.VLLMServerSink.preflight>` (``verifying``: any ``verify`` policy, a callable included, even one
    that would never verify: it is not called ahead of its syncs), so that a hook installing the sink refuses at
    install rather than at the first sync."""
    if verifying and isinstance(stream, AdapterStream):
        raise LoraStreamError(
            "verify= on a server checks merged syncs only: the probe runs through the served model without "
            "vLLM's LoRA layers, so an adapter sync cannot be verified there; sync with verify=False, or sync "
            "the merged model (ParamStream)"
        )


class ServerSinkView(Protocol):
    """What the route reads of its sink (:class:`~lora_stream.sinks.vllm_server.VLLMServerSink`): the options it was
    built with, its servers, and the source its data planes send from. Named here, not imported, so the route
    depends on the sink's options and not the sink on its route and back."""

    rank: int
    replicas: list[Replica]
    backend: str
    master_address: str
    buffer_bytes: int
    timeout: float
    lease: float
    pause: str | None
    prefix_cache_timeout: float
    rollback: bool
    on_replica_failure: str
    checkpoint: str | bool | None
    lora_name: str
    merge: str
    verify_tolerance: float | None
    _source: CurrentSource

    def _assign(self) -> list[Replica]: ...


def _keeps_lease(status: dict[str, Any] | None) -> bool:
    """Whether a server's lease status (``GET /lora_stream/lease``) comes from a lease that holds syncs: ``None`` is a
    server without lora_stream's lease, ``disabled`` one with several API processes, where it only reports (the
    sink warned about both at the server's first sync)."""
    return status is not None and not status.get("disabled")


class ServerChecks:
    """The checks of :class:`~lora_stream.sinks.server_route.ServerRoute` on each server it feeds (a part of it: it
    reads the route's sink and memory)."""

    sink: ServerSinkView
    memory: SinkMemory

    def check_server(self, stream: ParamStream, replica: Replica) -> dict[str, str]:
        models = replica.client.check_access()
        if isinstance(stream, AdapterStream):
            validate_adapter(stream, replica.client.max_lora_rank(), f"the server at {replica.url}")
            if self.sink.checkpoint is not False:
                adapter_preflight(stream.metadata(), self._checkpoint(replica, models), ADAPTER_PREFIX)
            return {}
        if self.sink.merge == "engine":
            self.memory.base.plan(stream)  # what the engine cannot merge exactly is refused here, before any byte
        if self.sink.checkpoint is False:
            return stream.tied_aliases()  # offered; the worker loads each only if its model holds it
        return preflight(stream.metadata(), stream.tied_aliases(), self._checkpoint(replica, models))

    def _read_status(self, replica: Replica) -> None:
        """The server's lease status, read before this sync writes anything: what it holds (for a partial sync),
        and whether it restarted, whose workers then lost this rank's transfer group (built again below)."""
        try:
            replica.status = replica.client.lease_status()
        except ServerError:
            replica.status = None
        status = replica.status or {}
        boot = status.get("boot")
        if replica.engine is not None and boot and replica.engine_boot and boot != replica.engine_boot:
            replica.close()
        elif (
            replica.engine is not None
            and replica.written_by is not None
            and status.get("weights_by") != replica.written_by
        ):
            # Another trainer wrote through this server since, and may have built its workers' group anew (there
            # is one per server): build this rank's again rather than find it closed mid-transfer.
            replica.close()
        if replica.engine is None:
            replica.engine_boot = boot

    def _check_lease(self, replica: Replica) -> None:
        """Once per server, at its first sync: warn if it keeps no weight-update lease. Best effort: a server that
        cannot say is asked again at the next sync; the sync itself goes on."""
        if replica.lease_checked:
            return
        try:
            status = replica.client.lease_status()
        except ServerError:
            return
        replica.lease_checked = True
        if status is None or status.get("disabled"):
            why = "it runs without it" if status is None else str(status["disabled"])
            warnings.warn(
                f"lora_stream: the vLLM server at {replica.url} keeps no weight-update lease ({why}): if this "
                "trainer vanishes mid-sync, that server stays paused or in its update until someone resumes it "
                "(install lora_stream in the server's environment; see docs/guarantees.md)",
                RuntimeWarning,
                stacklevel=5,
            )

    def _checkpoint(self, replica: Replica, models: dict[str, Any]) -> EngineCheckpoint:
        if replica.ckpt is None:
            path = self.sink.checkpoint
            if path is None or path is True:
                data = models.get("data") or [{}]
                path = data[0].get("root")
            try:
                replica.ckpt = EngineCheckpoint.read(str(path))
            except (FileNotFoundError, OSError) as exc:
                raise ServerError(
                    f"cannot read the checkpoint {path!r} served at {replica.url} for the pre-flight check ({exc}); "
                    "pass checkpoint= (a copy of the model directory), or checkpoint=False to skip the check"
                ) from exc
        return replica.ckpt

    def _ensure_engine(self, replica: Replica) -> None:
        if replica.engine is not None:
            return
        from ..transfer.sender import TrainerTransferEngine, TrainerTransferInitInfo

        # The feeding rank hosts the rendezvous (on a socket it binds and hands to the store: no close-and-reuse
        # race) and is rank 0 of the server's group; the server's workers follow.
        port = getattr(self.sink, "master_port", 0)
        info = TrainerTransferInitInfo(
            master_address=self.sink.master_address,
            master_port=port + replica.index if port else 0,  # 0: an ephemeral port
            world_size=1 + replica.client.world_size(),
            buffer_bytes=self.sink.buffer_bytes,
            timeout_s=self.sink.timeout,
            transport=self.sink.backend,
            rank=0,
        )
        engine = TrainerTransferEngine.trainer_init(info, client=replica.client, source=self.sink._source)
        engine.deferred = True  # the sink concludes vLLM's update session after the ranks voted
        engine.keep_previous = self.sink.rollback
        replica.engine = engine
