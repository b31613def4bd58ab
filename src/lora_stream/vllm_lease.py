"""Engine side: the lease under which a trainer holds a vLLM server paused and in a weight update.

A sync pauses the server's generation, opens vLLM's weight-update session, loads, and waits for the trainer ranks'
vote. If the trainer vanishes in between -- its process died, its network broke, it was stopped -- nobody would
ever roll the update back, end the session or resume generation: the server would stay paused, or serve weights
that were never committed, and refuse every later update ("start_weight_update called while a weight update is
already active"). This ASGI middleware, in the server's API process, makes the server heal itself.

**The lease.** Every request lora_stream's sink sends during a sync carries ``X-Lora-Stream-Sync`` (the sync's id)
and ``X-Lora-Stream-Lease`` (seconds). From the sync's ``/pause`` or ``/start_weight_update`` until its
``/resume`` and ``/finish_weight_update``, the sync *holds* the server. The lease runs while none of the sync's
requests is in flight: each request's arrival, and each successful completion, renews it for ``lease`` seconds (a
failed ``/update_weights`` renews nothing: the trainer that sent it may be gone). The sink sets ``lease`` longer
than any legitimate silence of its own (its longest wait for the other trainer ranks plus one HTTP call:
:meth:`~lora_stream.VLLMServerSink.lease_s`).

**When it expires** (nothing in flight): the middleware rolls the update back through lora_stream's worker engine
(the trainer's ``rollback`` command: the workers put back, bit for bit, what the update replaced), ends vLLM's
update session (``finish_weight_update`` without a version: ``/weight_info`` keeps the committed version) and
resumes generation. The sync is then *expired*: any later request carrying its id -- a decision arriving late, a
request the stalled trainer had queued -- is refused with ``409`` (:data:`EXPIRED`), so a late ``commit`` can never
land on a server that rolled back. A request of *another* sync while one holds the server (a restarted trainer's
first sync) heals the server first, the same way, then goes through: the next sync's prepare step recovers a server
that a dead sink left paused or in an open update.

``GET /lora_stream/lease`` reports the state (:data:`STATUS_PATH`).

Installed automatically in the API server by lora_stream's vLLM plugin (:func:`lora_stream.vllm_plugin.register`),
innermost, so that :class:`~lora_stream.vllm_guard.WeightRoutesGuard` and vLLM's own key check run first: an
unauthenticated request never reaches the lease. It can also be named explicitly:
``--middleware lora_stream.vllm_lease.UpdateLease`` (it is then not installed twice). One API server process per
server (vLLM's default); with ``--api-server-count`` above 1 each process would keep a lease of its own.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

logger = logging.getLogger("lora_stream")

__all__ = ["EXPIRED", "LEASE_HEADER", "STATUS_PATH", "SYNC_HEADER", "UpdateLease"]

#: Request headers lora_stream's sink sends on every call of a sync.
SYNC_HEADER = "x-lora-stream-sync"
LEASE_HEADER = "x-lora-stream-lease"
#: The route that reports the lease's state (JSON).
STATUS_PATH = "/lora_stream/lease"
#: The marker in a ``409`` answer to a request of a sync whose lease expired (the server rolled it back).
EXPIRED = "lora_stream_lease_expired"
#: The marker in a ``409`` answer while another sync's request is still running on the server.
BUSY = "lora_stream_lease_busy"
_WATCH_S = 0.25
_MAX_EXPIRED = 64


class _Lease:
    """What the middleware knows of the sync that holds the server."""

    def __init__(self) -> None:
        self.sync: str | None = None
        self.lease_s = 0.0
        self.expires = 0.0
        self.inflight = 0
        self.paused = False
        self.session = False
        self.expired: list[str] = []
        self.heals = 0
        self.last_heal: str | None = None

    @property
    def holding(self) -> bool:
        return self.sync is not None and (self.paused or self.session)

    def status(self) -> dict[str, Any]:
        return {
            "sync": self.sync,
            "holding": self.holding,
            "paused": self.paused,
            "session": self.session,
            "inflight": self.inflight,
            "expires_in": round(self.expires - time.monotonic(), 3) if self.holding else None,
            "heals": self.heals,
            "last_heal": self.last_heal,
        }


class UpdateLease:
    """Pure ASGI middleware: the weight-update lease of a vLLM OpenAI server (see the module docstring)."""

    lora_stream_lease = True  # how the plugin recognises an instance already installed

    def __init__(self, app: Any) -> None:
        self.app = app
        self.lease = _Lease()
        self._lock: asyncio.Lock | None = None
        self._watcher: asyncio.Task[None] | None = None
        self._engine: Any = None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        sync, lease_s = _lease_headers(scope)
        if scope.get("path") == STATUS_PATH:
            if sync is not None and sync == self.lease.sync:  # the holder's heartbeat: renew, unless expired
                self._start(scope)
                await self._renew(sync)
            await _respond(send, 200, self.lease.status())
            return
        if sync is None:
            await self.app(scope, receive, send)
            return
        self._start(scope)
        assert self._lock is not None
        lease = self.lease
        async with self._lock:
            now = time.monotonic()
            if lease.sync == sync and lease.holding and lease.inflight == 0 and now > lease.expires:
                await self._heal(f"sync {sync}'s lease of {lease.lease_s:g} s expired")
            if sync in lease.expired:
                await _respond(
                    send,
                    409,
                    {
                        "error": f"lora_stream: the lease of sync {sync} expired; the server rolled its update back "
                        "and resumed generation",
                        "marker": EXPIRED,
                    },
                )
                return
            if lease.sync is not None and lease.sync != sync and lease.holding:
                if lease.inflight:
                    await _respond(
                        send,
                        409,
                        {"error": f"lora_stream: another sync ({lease.sync}) is updating this server", "marker": BUSY},
                    )
                    return
                await self._heal(f"sync {lease.sync} was superseded by sync {sync}")
            lease.sync, lease.lease_s = sync, lease_s
            lease.inflight += 1
            lease.expires = max(lease.expires, now + lease_s)
        status = [500]

        async def sending(message: Any) -> None:
            if message.get("type") == "http.response.start":
                status[0] = int(message.get("status", 500))
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            self._completed(sync, scope.get("path", ""), status[0])

    async def _renew(self, sync: str) -> None:
        assert self._lock is not None
        lease = self.lease
        async with self._lock:
            if lease.sync != sync or not lease.holding:
                return
            now = time.monotonic()
            if lease.inflight == 0 and now > lease.expires:
                await self._heal(f"sync {sync}'s lease of {lease.lease_s:g} s expired")
            else:
                lease.expires = max(lease.expires, now + lease.lease_s)

    def _completed(self, sync: str, path: str, status: int) -> None:
        lease = self.lease
        lease.inflight -= 1
        if lease.sync != sync:
            return  # healed and superseded meanwhile
        ok = 200 <= status < 300
        if ok:
            lease.expires = max(lease.expires, time.monotonic() + lease.lease_s)
            if path == "/pause":
                lease.paused = True
            elif path == "/resume":
                lease.paused = False
            elif path == "/start_weight_update":
                lease.session = True
            elif path == "/finish_weight_update":
                lease.session = False
        elif path == "/update_weights":
            lease.session = False  # vLLM's worker ends the session when an update raises
        if not lease.holding and lease.inflight == 0:
            lease.sync = None

    def _start(self, scope: Any) -> None:
        if self._lock is None:
            self._lock = asyncio.Lock()
        app = scope.get("app")
        if self._engine is None and app is not None:
            self._engine = getattr(app.state, "engine_client", None)
        if self._watcher is None or self._watcher.done():
            self._watcher = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        """Heal once the holding sync's lease ran out with nothing in flight; stop once nothing is held."""
        assert self._lock is not None
        while True:
            await asyncio.sleep(_WATCH_S)
            lease = self.lease
            if lease.sync is None:
                return
            if lease.holding and lease.inflight == 0 and time.monotonic() > lease.expires:
                async with self._lock:
                    if lease.holding and lease.inflight == 0 and time.monotonic() > lease.expires:
                        await self._heal(f"sync {lease.sync}'s lease of {lease.lease_s:g} s expired")

    async def _heal(self, why: str) -> None:
        """Roll the holding sync's update back, end vLLM's session, resume generation; mark the sync expired."""
        lease = self.lease
        engine = self._engine
        steps: list[str] = []
        if engine is not None and lease.session:
            from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

            try:
                await engine.update_weights(request=WeightTransferUpdateRequest(update_info={"command": "rollback"}))
                steps.append("rolled back")
            except Exception as exc:  # the workers already ended the session (a failed update rolls back itself)
                steps.append(f"rollback: {type(exc).__name__}")
            try:
                await engine.finish_weight_update(None)
                steps.append("session ended")
            except Exception as exc:
                steps.append(f"finish: {type(exc).__name__}")
        if engine is not None and lease.paused:
            try:
                await engine.resume_generation()
                steps.append("resumed")
            except Exception as exc:
                steps.append(f"resume failed: {type(exc).__name__}: {exc}")
        if lease.sync is not None:
            lease.expired = [*lease.expired, lease.sync][-_MAX_EXPIRED:]
        lease.heals += 1
        lease.last_heal = f"{why}: {', '.join(steps) or 'nothing held'}"
        logger.warning("lora_stream: healed the server: %s", lease.last_heal)
        lease.sync, lease.paused, lease.session = None, False, False


def _lease_headers(scope: Any) -> tuple[str | None, float]:
    sync: str | None = None
    lease_s = 0.0
    for name, value in scope.get("headers", ()):
        key = name.lower()
        if key == SYNC_HEADER.encode():
            sync = value.decode("latin-1")[:128]
        elif key == LEASE_HEADER.encode():
            try:
                lease_s = max(1.0, float(value.decode("latin-1")))
            except ValueError:
                lease_s = 0.0
    if sync is None or lease_s <= 0:
        return None, 0.0
    return sync, lease_s


async def _respond(send: Any, status: int, body: dict[str, Any]) -> None:
    data = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})


def install(app: Any) -> bool:
    """Add :class:`UpdateLease` to ``app`` (a FastAPI app not yet serving) as its innermost middleware, unless it is
    there already; returns whether it was added."""
    from starlette.middleware import Middleware

    for m in getattr(app, "user_middleware", ()):
        if getattr(m.cls, "lora_stream_lease", False):
            return False
    app.user_middleware.append(Middleware(UpdateLease))
    return True
