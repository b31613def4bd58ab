"""Engine side: the lease under which a trainer holds a vLLM server paused and in a weight update.

A sync pauses the server's generation, opens vLLM's weight-update session, loads, and waits for the trainer ranks'
vote. If the trainer vanishes in between -- its process died, its network broke, it was stopped -- nobody would
ever roll the update back, end the session or resume generation: the server would stay paused, or serve weights
that were never committed, and refuse every later update ("start_weight_update called while a weight update is
already active"). This ASGI middleware, in the server's API process, makes the server heal itself.

**The credential.** Every request lora_stream's sink sends during a sync carries ``X-Lora-Stream-Sync``, the
sync's *credential*: a secret of at least :data:`MIN_CREDENTIAL` characters the sink draws for this sync alone
(:func:`new_credential`), and ``X-Lora-Stream-Lease`` (seconds). The server never stores, returns, logs or echoes
the credential: it keeps only the sync's *name*, a digest of it (:func:`sync_name`), and everything it shows
(``GET /lora_stream/lease``, a ``409``'s ``holder``, ``weights_by``, its log, the workers' record of the commit) shows
the name. Presenting the name back is presenting nothing: a request acts for a sync only with the secret whose
digest is that name, compared in constant time. A credential shorter than :data:`MIN_CREDENTIAL` is no credential.

**The lease.** From the sync's ``/pause`` or ``/start_weight_update`` (:data:`START_PATHS`: only these take a free
server) until its ``/resume`` and ``/finish_weight_update``, the sync *holds* the server. Its length is the
``X-Lora-Stream-Lease`` of the request that took the server, fixed for the whole hold: a later request renews the
lease for that length, never lengthens it. The lease runs while none of the sync's requests is in flight: each
request's arrival, and each successful completion, renews it (a failed ``/update_weights`` renews nothing: the
trainer that sent it may be gone). Once a sync released the server, its credential acts on nothing: it takes no
server again, and its update routes are refused (:data:`EXPIRED`); a credential that never held this server (a
server restarted under its sync) is refused on the update routes (:data:`UPDATE_PATHS`) too. The sink sends its
``lease=`` option (:class:`~lora_stream.VLLMServerSink`, default
:data:`~lora_stream.sinks.vllm_server.DEFAULT_LEASE_S`), and its feeding rank renews the lease every ``lease / 6``
seconds while it lives, so that no legitimate silence of its own (a wait for the other trainer ranks, an HTTP call)
lets it expire.

**When it expires** (nothing in flight): the middleware rolls the update back through lora_stream's worker engine
(the trainer's ``rollback`` command: the workers put back, bit for bit, what the update replaced), ends vLLM's
update session (``finish_weight_update`` without a version: ``/weight_info`` keeps the committed version) and
resumes generation. The sync is then *expired*: any later request carrying its id -- a decision arriving late, a
request the stalled trainer had queued -- is refused with ``409`` (:data:`EXPIRED`), so a late ``commit`` can never
land on a server that rolled back. A request of *another* sync while one holds the server (a restarted trainer's
first sync) heals the server first, the same way, then goes through: the next sync's prepare step recovers a server
that a dead sink left paused or in an open update.

An adapter sync swaps the new adapter in (vLLM's ``/v1/load_lora_adapter``) before the vote; its request names what
to put back (``X-Lora-Stream-Restore``), and a heal puts it back too.

Only the holding sync's requests to the weight-sync routes (:data:`LEASED_PATHS`) take part. **Every other route
is judged by what it may do** (:mod:`lora_stream.engine.routes`, derived from the running app's own routes and matched
as the app routes the request, ``--root-path`` included): while a sync holds the server, anyone else's request to a
route not proven harmless -- one that may write the weights, change generation's state, or one lora_stream does not
know -- is refused with ``409`` (:data:`BUSY`); serving routes (generation, probes, reports) always run.
``GET /lora_stream/lease`` reports the state (:data:`STATUS_PATH`), with this API process's ``boot`` id and the
sync whose request last reached a route that may write the weights (``weights_by``: any route not proven to leave
them alone, whoever sent it): what a sink that sends only what changed checks before it trusts the server to hold
its last commit; and the app's routes lora_stream has not classified (``unclassified_routes``).

Installed automatically in the API server by lora_stream's vLLM plugin (:func:`lora_stream.engine.plugin.register`),
innermost, so that :class:`~lora_stream.engine.guard.WeightRoutesGuard` and vLLM's own key check run first: an
unauthenticated request never reaches the lease. It can also be named explicitly,
``--middleware lora_stream.engine.lease.UpdateLease`` (it is then not installed twice), but vLLM adds ``--middleware``
classes outside its own: list it before the guard. A server with several API processes (``--api-server-count``
above 1, vLLM's default under data parallelism) would keep one lease per process, each seeing part of the requests:
there the lease only reports, heals nothing, and says so in the log.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import hmac
import json
import logging
import math
import re
import secrets
import time
import uuid
from typing import Any

from .routes import RouteTable, log_unclassified

logger = logging.getLogger("lora_stream")

__all__ = [
    "BUSY",
    "COMMIT_HEADER",
    "DECIDE_PATH",
    "EXPIRED",
    "LEASED_PATHS",
    "LEASE_HEADER",
    "MIN_CREDENTIAL",
    "NOTHING_KEPT",
    "RESTORE_HEADER",
    "ROLLBACK_HEADER",
    "STATUS_PATH",
    "SYNC_HEADER",
    "UPDATE_PATHS",
    "UpdateLease",
    "committed_version",
    "new_credential",
    "sync_name",
]

#: Request headers lora_stream's sink sends on every call of a sync: the sync's credential (a secret, never shown by
#: the server) and the lease's length in seconds (read once, when the sync takes the server).
SYNC_HEADER = "x-lora-stream-sync"
LEASE_HEADER = "x-lora-stream-lease"
#: The shortest credential the lease takes (:func:`new_credential` draws 64 hexadecimal characters, 256 bits).
MIN_CREDENTIAL = 32
#: On an adapter sync's ``/v1/load_lora_adapter``: JSON ``{"lora_name", "lora_path"}`` of what a heal puts back
#: (``lora_path`` ``null``: unload the name).
RESTORE_HEADER = "x-lora-stream-restore"
#: On the ``/update_weights`` request that carries the trainer's commit: JSON ``{"version": ...}``. Once the workers
#: answered it, the update is decided: a heal finishes it with that version instead of rolling it back.
COMMIT_HEADER = "x-lora-stream-commit"
#: On the holder's ``/update_weights`` rollback command: the decision recorded at this server (:data:`DECIDE_PATH`) is
#: withdrawn as the request arrives, before the workers roll back, so a heal can never commit what they rolled back.
ROLLBACK_HEADER = "x-lora-stream-rollback"
#: ``POST`` with the holder's headers and :data:`COMMIT_HEADER`: the sync's decision to commit, recorded at this
#: server before any server of the sync commits. From then on a heal rolls the update forward (the workers commit,
#: the session ends with the decided version) instead of back; the holder's rollback command withdraws it. Answered
#: ``200`` only while the sync holds this server; otherwise ``409`` (:data:`EXPIRED`): a server that restarted, or
#: whose lease ran out and rolled back, never takes a decision it can no longer carry out.
DECIDE_PATH = "/lora_stream/decide"
#: The route that reports the lease's state (JSON); with the holder's headers it renews the lease (the heartbeat),
#: and its ``yours`` field says whether the asking sync still holds the server.
STATUS_PATH = "/lora_stream/lease"
#: The routes whose requests take part in the lease (and may heal a server held by another sync).
LEASED_PATHS = frozenset(
    {
        "/pause",
        "/resume",
        "/start_weight_update",
        "/update_weights",
        "/finish_weight_update",
        "/reset_prefix_cache",
        "/init_weight_transfer_engine",
        "/get_world_size",
        "/server_info",
        "/weight_info",
        "/v1/models",
        "/v1/load_lora_adapter",
        "/v1/unload_lora_adapter",
    }
)
#: The routes that start an update: only these take a free server for a sync; another sync's request to one of them
#: supersedes the holder (healing it first), as a trainer restarted after a death must; on every other guarded route
#: it is refused.
START_PATHS = frozenset({"/pause", "/start_weight_update", "/init_weight_transfer_engine"})
#: The routes that act inside a sync's update: only the sync that holds the server reaches them with its credential.
#: A credential that does not hold the server is refused there (:data:`EXPIRED`), never let through as nobody's: on a
#: server restarted under a sync, vLLM's "no update session" answer would otherwise read as the sync's own commit.
UPDATE_PATHS = frozenset({"/update_weights", "/finish_weight_update"})
#: The late requests of a sync whose committed update a heal finished (rolled forward), answered as done.
_FORWARDED_OK = frozenset({"/finish_weight_update", "/resume"})
#: A gap this much longer than the watcher's tick means the server's own process did not run (stopped, paused,
#: starved): the lease counts only the server's running time, so the gap is added to it.
_STALL_S = 1.0
#: The marker in a ``409`` answer to a request of a sync whose lease expired (the server rolled it back).
EXPIRED = "lora_stream_lease_expired"
#: The marker in a ``409`` answer while another sync's request is still running on the server.
BUSY = "lora_stream_lease_busy"
_WATCH_S = 0.25
_MAX_EXPIRED = 64
#: How many released syncs' names the lease remembers, to refuse their credentials (16 bytes each): the syncs of days
#: at one a minute. A credential older than that acts as a stranger's, which takes a free server as a new sync and
#: writes under its own name: never under the name the sink's last commit holds (always among the remembered).
_MAX_ENDED = 4096
_MAX_LEASE_S = 24 * 3600.0
#: What lora_stream's worker engine says when a rollback restores nothing: the update kept no copy (rollback=False),
#: or it was committed (then the lease rolls it forward instead; see :attr:`_Lease.committed`).
NOTHING_KEPT = "lora_stream_nothing_to_restore"
# What vLLM's worker answers when no update session is open (the workers already ended it).
_NO_SESSION = ("must be called before", "without a matching")


def new_credential() -> str:
    """A fresh sync credential: 256 random bits, as text (drawn by the sink for each sync)."""
    return secrets.token_hex(32)


def sync_name(credential: str) -> str:
    """The public name of the sync whose credential is ``credential``: what the server shows and the workers record.
    A digest, so that what anyone can read is never what a request must present."""
    return hashlib.sha256(credential.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def _same(a: str | None, b: str | None) -> bool:
    """Whether two sync names are the same, in constant time."""
    return a is not None and b is not None and hmac.compare_digest(a.encode(), b.encode())


def no_session(error: BaseException) -> bool:
    """Whether ``error`` is vLLM's answer that no weight-update session is open (the workers already ended it)."""
    return any(m in str(error) for m in _NO_SESSION)


class _Lease:
    """What the middleware knows of the sync that holds the server."""

    def __init__(self) -> None:
        self.sync: str | None = None
        self.lease_s = 0.0
        self.expires = 0.0
        self.inflight = 0
        self.paused = False
        self.session = False
        #: What a heal puts back of an adapter the sync swapped in: ``{"lora_name", "lora_path"}``, or ``None``.
        self.restore: dict[str, Any] | None = None
        #: The holding sync's commit, once the workers acknowledged it: ``{"version": ...}`` (``None``: undecided).
        #: From then on the update is final, and a heal rolls it forward.
        self.committed: dict[str, Any] | None = None
        #: The holding sync's decision to commit, recorded before any server commits (:data:`DECIDE_PATH`):
        #: ``{"version": ...}``, or ``None``. A heal then has the workers commit and rolls forward.
        self.decided: dict[str, Any] | None = None
        #: The holding sync's lease ran out: it is being healed (a step that failed is retried every tick).
        self.expiring = False
        self.expired: list[str] = []
        #: Names of syncs that held this server and released it: their credentials act on nothing any more.
        self.ended: collections.OrderedDict[str, None] = collections.OrderedDict()
        #: Syncs whose committed update a heal finished, with their version: their late ``/finish_weight_update``
        #: and ``/resume`` are answered as done.
        self.forwarded: dict[str, str | None] = {}
        self.heals = 0
        self.last_heal: str | None = None
        #: This API process's identity: a restarted server reports another one.
        self.boot = uuid.uuid4().hex
        #: The sync whose request last reached a route that may write the weights (``None``: one without
        #: lora_stream's headers, or none since the server started): what a partial sync must find unchanged.
        self.weights_by: str | None = None

    def end(self, name: str) -> None:
        """Sync ``name`` released this server: its credential acts on nothing from now on."""
        self.ended[name] = None
        while len(self.ended) > _MAX_ENDED:
            self.ended.popitem(last=False)

    @property
    def holding(self) -> bool:
        # A committed update not yet finished under its version still holds the server: its heal must finish it.
        return self.sync is not None and (
            self.paused or self.session or self.restore is not None or self.committed is not None
        )

    def expires_in(self) -> float | None:
        return round(self.expires - time.monotonic(), 3) if self.holding else None

    def status(
        self, disabled: str | None, asking: str | None = None, unclassified: list[str] | None = None
    ) -> dict[str, Any]:
        yours = None
        if asking is not None:
            yours = {
                "holding": self.holding and _same(self.sync, asking) and not self.expiring,
                "expired": asking in self.expired,
                "forwarded": asking in self.forwarded,
            }
        return {
            "yours": yours,
            "sync": self.sync,  # the holder's name, a digest of its credential: presenting it back acts on nothing
            "holding": self.holding,
            "paused": self.paused,
            "session": self.session,
            "decided": self.decided is not None or self.committed is not None,
            "adapter_restore": self.restore is not None,
            "inflight": self.inflight,
            "expires_in": self.expires_in(),
            "heals": self.heals,
            "last_heal": self.last_heal,
            "disabled": disabled,
            "boot": self.boot,
            "weights_by": self.weights_by,
            "unclassified_routes": unclassified or [],
        }


class UpdateLease:
    """Pure ASGI middleware: the weight-update lease of a vLLM OpenAI server (see the module docstring)."""

    lora_stream_lease = True  # how the plugin recognises an instance already installed

    def __init__(self, app: Any) -> None:
        self.app = app
        self.lease = _Lease()
        self._lock: asyncio.Lock | None = None
        self._watcher: asyncio.Task[None] | None = None
        self._state: Any = None
        self._app: Any = None
        self._routes: RouteTable | None = None
        self._last_tick = time.monotonic()
        #: Why this lease heals nothing (several API processes), or ``None``.
        self.disabled: str | None = None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        kind = scope.get("type")
        if kind not in ("http", "websocket"):
            if kind == "lifespan":
                self._bind(scope)  # at start-up: the app's routes, classified (unknown ones named in the log)
            await self.app(scope, receive, send)
            return
        self._bind(scope)
        sync, lease_s = _lease_headers(scope)
        lease = self.lease
        own = _route_path(scope) if kind == "http" else None  # lora_stream's own routes, served here
        if own == STATUS_PATH:
            if sync is not None and _same(sync, lease.sync) and self.disabled is None:  # the holder's heartbeat
                await self._renew(sync)
            await _respond(send, 200, lease.status(self.disabled, sync, self._table().unclassified()))
            return
        if own == DECIDE_PATH:
            await self._record_decision(scope, sync, send)
            return
        judged = self._table().judge(scope)
        if judged is None:  # no route takes it: the router answers 404 or 405, and nothing runs
            await self.app(scope, receive, send)
            return
        path, klass = judged  # the route's template, as the app routes the request (--root-path stripped)
        writes = klass == "writing"
        if kind == "websocket":
            # lora_stream never opens one; a websocket to a route that is not proven harmless waits like any other
            # request without the holder's headers.
            if lease.holding and klass != "serving" and self.disabled is None:
                await send({"type": "websocket.close", "code": 1013, "reason": "lora_stream: a sync holds the server"})
                return
            if writes:
                lease.weights_by = None
            await self.app(scope, receive, send)
            return
        if self.disabled is not None or (klass == "serving" and path not in LEASED_PATHS):
            if writes:
                lease.weights_by = sync  # whoever it is: a partial sync then finds the weights written by another
            await self.app(scope, receive, send)
            return
        async with self._lock_():
            self._account_stall()
            if lease.holding and lease.inflight == 0 and time.monotonic() > lease.expires:
                await self._heal(f"sync {lease.sync}'s lease of {lease.lease_s:g} s expired")
            late_commit = path == "/update_weights" and _json_header(scope, COMMIT_HEADER) is not None
            if sync is not None and sync in lease.forwarded and (path in _FORWARDED_OK or late_commit):
                # Its commit was final: the heal finished the update with its version and resumed generation.
                version = lease.forwarded[sync]
                await _respond(send, 200, {"lora_stream": f"committed; the lease finished it as {version!r}"})
                return
            if sync is not None and sync in lease.expired:
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
            if sync is not None and not _same(lease.sync, sync):
                # A credential that does not hold this server: it takes a free one only through a route that starts
                # an update, and only if it never held this server before; it never reaches an update's routes.
                ended = sync in lease.ended
                if path in UPDATE_PATHS or (ended and path in START_PATHS):
                    why = (
                        "it released this server already, and its credential acts on nothing any more"
                        if ended
                        else "the server holds no update of this sync (it restarted, or another sync took it)"
                    )
                    await _respond(
                        send, 409, {"error": f"lora_stream: sync {sync} may not {path}: {why}", "marker": EXPIRED}
                    )
                    return
                if path not in START_PATHS:
                    sync = None  # acts for no sync: judged as any request without lora_stream's headers
            if lease.holding and not _same(lease.sync, sync) and sync is not None and path in START_PATHS:
                # Another sync starts an update (a trainer restarted after dying mid-sync): the holder is healed
                # first, unless one of its requests is running.
                if lease.inflight:
                    await _respond(
                        send,
                        409,
                        {"error": f"lora_stream: another sync ({lease.sync}) is updating this server", "marker": BUSY},
                    )
                    return
                await self._heal(f"sync {lease.sync} was superseded by sync {sync}")
            if lease.holding and not _same(lease.sync, sync):
                if klass != "serving":
                    # Only the holding sync writes, or changes generation's state. Healing the holder's update on
                    # the word of a request that does not start an update would let any client end a live sync,
                    # and a resume would serve an update nobody committed; so it waits for the holder's lease,
                    # which heals the server if the holder is gone.
                    who = "a request without lora_stream's headers" if sync is None else f"sync {sync}"
                    await _respond(
                        send,
                        409,
                        {
                            "error": f"lora_stream: sync {lease.sync} holds this server in a weight update; {who} "
                            f"may not {path} until it ends or its lease expires (in {lease.expires_in()} s, if "
                            "nothing renews it)",
                            "marker": BUSY,
                            "holder": lease.sync,
                            "expires_in": lease.expires_in(),
                        },
                    )
                    return
                sync = None  # someone else's read-only request: it runs, and touches nothing of the lease
            if sync is None:
                if writes:
                    lease.weights_by = None
                passing = True
            else:
                passing = False
                if writes:
                    lease.weights_by = sync
                if path == "/update_weights" and _header(scope, ROLLBACK_HEADER) is not None:
                    lease.decided = None  # the holder rolls back: withdrawn before the workers act on it
                now = time.monotonic()
                if not _same(lease.sync, sync):
                    # A sync taking a free server starts its own lease, of the length it asks for now: fixed until it
                    # releases the server (a later request's header renews it, never lengthens it).
                    lease.sync, lease.lease_s, lease.expires = sync, lease_s, now + lease_s
                else:
                    lease.expires = max(lease.expires, now + lease.lease_s)
                lease.inflight += 1
                self._watch_()
        if passing:
            await self.app(scope, receive, send)
            return
        answer = {"status": 500, "answered": False}

        async def sending(message: Any) -> None:
            if message.get("type") == "http.response.start":
                answer["status"] = int(message.get("status", 500))
                answer["answered"] = True
            await send(message)

        assert sync is not None  # a request that takes part in the lease
        commit = _json_header(scope, COMMIT_HEADER) if path == "/update_weights" else None
        try:
            await self.app(scope, receive, sending)
        finally:
            self._completed(sync, path, int(answer["status"]), bool(answer["answered"]), _restore_header(scope), commit)

    async def _record_decision(self, scope: Any, sync: str | None, send: Any) -> None:
        """:data:`DECIDE_PATH`: record the holding sync's decision to commit, if it still holds this server; judged
        under the lock, after any heal that is due, so that a sync whose lease ran out meanwhile is told so."""
        lease = self.lease
        decision = _json_header(scope, COMMIT_HEADER)
        async with self._lock_():
            self._account_stall()
            if lease.holding and lease.inflight == 0 and time.monotonic() > lease.expires:
                await self._heal(f"sync {lease.sync}'s lease of {lease.lease_s:g} s expired")
            held = (
                self.disabled is None
                and _same(lease.sync, sync)
                and lease.holding
                and lease.session
                and not lease.expiring
            )
            if not held or decision is None:
                why = (
                    "no decision in the request"
                    if held
                    else "its lease expired and the server rolled the update back"
                    if sync in lease.expired
                    else "the server holds no update of this sync (it restarted, or another sync took it)"
                )
                error = f"lora_stream: sync {sync} cannot record its decision: {why}"
                await _respond(send, 409, {"error": error, "marker": EXPIRED})
                return
            lease.decided = {"version": decision.get("version")}
            lease.expires = max(lease.expires, time.monotonic() + lease.lease_s)
        await _respond(send, 200, {"recorded": True, "version": lease.decided["version"]})

    def _completed(
        self,
        sync: str,
        path: str,
        status: int,
        answered: bool,
        restore: dict[str, Any] | None,
        commit: dict[str, Any] | None = None,
    ) -> None:
        lease = self.lease
        lease.inflight -= 1
        if not _same(lease.sync, sync):
            return  # healed and superseded meanwhile
        held = lease.holding
        if 200 <= status < 300:
            lease.expires = max(lease.expires, time.monotonic() + lease.lease_s)
            if path == "/pause":
                lease.paused = True
            elif path == "/resume":
                lease.paused = False
            elif path == "/start_weight_update":
                lease.session, lease.committed, lease.decided = True, None, None
            elif path == "/update_weights" and commit is not None:
                lease.committed = commit  # the workers committed: every rank voted, the decision is final
            elif path == "/finish_weight_update":
                # The update is decided: committed, or rolled back after the sync put its adapter back itself.
                lease.session = False
                lease.restore = None
                lease.committed = lease.decided = None
            elif path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
                # The sync swapped its adapter in (and said what to put back), or put the previous one back itself.
                lease.restore = restore
        elif path == "/update_weights" and answered and status >= 500 and lease.decided is None:
            # The workers raised on an undecided update: vLLM's worker ends the session when an update fails, and
            # ours rolled it back. Once decided, an error answer proves nothing (the workers may have committed
            # before the answer failed): the session is kept as open, and the decided update is rolled forward.
            lease.session = False
        if not lease.holding and lease.inflight == 0:
            if held:
                lease.end(sync)  # it held the server and released it: its credential acts on nothing now
            lease.sync = None

    def _table(self) -> RouteTable:
        """The app's routes, classified; built again if the app gained a route since (a plugin adding one late)."""
        app = self._app
        routes = getattr(getattr(app, "router", None), "routes", None) or []
        if self._routes is None or len(routes) != self._routes.count:
            self._routes = RouteTable.of(app)
            log_unclassified(self._routes)
        return self._routes

    def _bind(self, scope: Any) -> None:
        if self._state is not None:
            return
        app = scope.get("app")
        if app is None:
            return
        self._app = app
        self._table()
        self._state = app.state
        args = getattr(app.state, "args", None)
        count = getattr(args, "api_server_count", None) or 1
        if count > 1:
            self.disabled = f"{count} API server processes, one lease each"
            logger.warning(
                "lora_stream: this vLLM server runs %d API processes; the weight-update lease would keep one per "
                "process and heals nothing: a server whose trainer vanishes stays paused or in its update",
                count,
            )

    def _lock_(self) -> asyncio.Lock:
        if self._lock is None:
            self._lock = asyncio.Lock()
        return self._lock

    def _watch_(self) -> None:
        if self._watcher is None or self._watcher.done():
            self._last_tick = time.monotonic()
            self._watcher = asyncio.get_running_loop().create_task(self._watch())

    def _account_stall(self) -> None:
        """Add to the lease any time this process did not run (a gap between the watcher's ticks well beyond a
        tick: the API process was stopped, paused or starved). The lease counts the server's running time only,
        so a server that stalled reads the requests that queued meanwhile -- its trainer's heartbeats -- before it
        can find the lease expired; otherwise it would heal a live sync the moment it runs again."""
        now = time.monotonic()
        gap = now - self._last_tick
        if gap > _WATCH_S + _STALL_S and self.lease.holding:
            self.lease.expires += gap - _WATCH_S
        self._last_tick = now

    async def _renew(self, sync: str) -> None:
        lease = self.lease
        async with self._lock_():
            self._account_stall()
            if not _same(lease.sync, sync) or not lease.holding:
                return
            now = time.monotonic()
            if lease.inflight == 0 and now > lease.expires:
                await self._heal(f"sync {sync}'s lease of {lease.lease_s:g} s expired")
            else:
                lease.expires = max(lease.expires, now + lease.lease_s)

    async def _watch(self) -> None:
        """Heal once the holding sync's lease ran out with nothing in flight (retrying a heal that did not finish);
        stop once nothing is held."""
        lease = self.lease
        while True:
            await asyncio.sleep(_WATCH_S)
            self._account_stall()
            if lease.sync is None:
                return
            if lease.holding and lease.inflight == 0 and time.monotonic() > lease.expires:
                async with self._lock_():
                    self._account_stall()
                    if lease.holding and lease.inflight == 0 and time.monotonic() > lease.expires:
                        await self._heal(f"sync {lease.sync}'s lease of {lease.lease_s:g} s expired")

    async def _heal(self, why: str) -> None:
        # Shielded: a heal cut off half-way (the request that triggered it was cancelled) would leave the flags
        # saying what is no longer true.
        await asyncio.shield(self._heal_steps(why))

    async def _roll_forward(self, engine: Any, steps: list[str]) -> None:
        """The workers committed (the decision was final): the heal finishes the update with its version (rolling back
        would leave the new weights under the old version: the workers keep no copy once committed), and checks that
        the engine serves under that version before it records the sync as forwarded; the sync's late commit,
        ``/finish_weight_update`` and ``/resume`` are then answered as done."""
        lease = self.lease
        version = (lease.committed or {}).get("version")
        if lease.session:
            try:
                await engine.finish_weight_update(version)
                lease.session = False
                steps.append(f"its committed update rolled forward, the session ended as version {version!r}")
            except Exception as exc:
                if no_session(exc):
                    lease.session = False
                    steps.append("its committed update already ended")
                else:
                    steps.append(f"finish failed ({type(exc).__name__}: {str(exc)[:200]})")
        if lease.session:
            return
        if version is not None and not await _labelled(engine, version, steps):
            # The session ended without the version (vLLM ends it when a worker raises, as on the refusal to roll
            # back a commit): the weights are the committed ones, the label not yet. Held, and retried.
            return
        lease.restore = None  # an adapter the committed sync swapped in stands too
        if lease.sync is not None:
            lease.forwarded[lease.sync] = version
            while len(lease.forwarded) > _MAX_EXPIRED:
                lease.forwarded.pop(next(iter(lease.forwarded)))
        lease.committed = lease.decided = None

    async def _commit_decided(self, engine: Any, steps: list[str]) -> None:
        """The sync recorded its decision to commit here, then fell silent before its workers committed: have them
        commit as the sync would have (every server of the sync learned the same decision before any committed)."""
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        lease = self.lease
        decided = lease.decided or {}
        info = {"command": "commit", "sync": lease.sync, "version": decided.get("version")}
        committed: dict[str, Any] | None = dict(decided)
        try:
            await engine.update_weights(request=WeightTransferUpdateRequest(update_info=info))
            steps.append("the workers committed the decided update")
        except Exception as exc:
            committed = committed_version(str(exc))
            if committed is not None:
                steps.append("the workers had committed it")
            elif no_session(exc):
                # After a recorded decision, only a commit ends the workers' session (a rollback withdraws the
                # decision first; a restart is another server): the commit reached them, and stands.
                committed = dict(decided)
                lease.session = False
                steps.append("the workers had committed it and ended the session")
            else:
                steps.append(f"the decided commit failed ({type(exc).__name__}: {str(exc)[:200]})")
                return
        lease.committed = committed

    async def _heal_steps(self, why: str) -> None:
        """Roll the holding sync's update back, end vLLM's session, put its adapter back, resume generation. Each
        state is cleared only once its step succeeded; what failed is retried at the next tick. The sync is expired
        from the first attempt on: none of its requests is taken any more."""
        lease = self.lease
        state = self._state
        engine = getattr(state, "engine_client", None)
        steps: list[str] = []
        if lease.sync is not None and lease.sync not in lease.expired:
            lease.expired = [*lease.expired, lease.sync][-_MAX_EXPIRED:]
        lease.expiring = True
        if engine is not None and lease.session and lease.committed is None and lease.decided is not None:
            await self._commit_decided(engine, steps)
        if engine is not None and lease.committed is not None:
            await self._roll_forward(engine, steps)
        if lease.committed is not None or (lease.decided is not None and lease.session):
            # Decided, and not yet finished under its version: never rolled back, never resumed half-way; retried
            # at the next tick.
            lease.last_heal = f"{why}: {', '.join(steps)}"
            logger.warning("lora_stream: healing the server is not done, retrying: %s", lease.last_heal)
            return
        if engine is not None and lease.session:
            from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

            rolled_back = False
            try:
                await engine.update_weights(request=WeightTransferUpdateRequest(update_info={"command": "rollback"}))
                rolled_back = True
                steps.append("rolled back")
            except Exception as exc:
                committed = committed_version(str(exc))
                if committed is not None:
                    # The workers committed, though this process did not see their answer: roll forward.
                    lease.committed = committed
                    await self._roll_forward(engine, steps)
                elif no_session(exc):
                    lease.session = False  # the workers already ended it (a failed update rolls back itself)
                    steps.append("no update open")
                elif NOTHING_KEPT in str(exc):
                    # The workers kept a copy but restored nothing: say so, never "rolled back"; end the session so
                    # that the server serves and takes the next (full) sync.
                    steps.append("NOT restored: the workers found nothing to restore, the new weights stay")
                    rolled_back = True  # nothing more a retry could restore: finish without a version
                else:
                    steps.append(f"rollback failed ({type(exc).__name__}: {str(exc)[:200]})")
            if rolled_back:  # never finish an update that was not rolled back: finishing keeps what it loaded
                try:
                    await engine.finish_weight_update(None)
                    lease.session = False
                    steps.append("session ended")
                except Exception as exc:
                    if no_session(exc):
                        lease.session = False
                    else:
                        steps.append(f"finish failed ({type(exc).__name__}: {str(exc)[:200]})")
        if lease.restore is not None and state is not None:
            if await _restore_adapter(state, lease.restore, steps):
                lease.restore = None
        if engine is not None and lease.paused:
            try:
                await engine.resume_generation()
                lease.paused = False
                steps.append("resumed")
            except Exception as exc:
                steps.append(f"resume failed ({type(exc).__name__}: {str(exc)[:200]})")
        lease.last_heal = f"{why}: {', '.join(steps) or 'nothing held'}"
        if not lease.holding:
            lease.heals += 1
            lease.sync, lease.expiring = None, False
            logger.warning("lora_stream: healed the server: %s", lease.last_heal)
        else:
            logger.warning("lora_stream: healing the server is not done, retrying: %s", lease.last_heal)


async def _labelled(engine: Any, version: str, steps: list[str]) -> bool:
    """Whether the engine serves under ``version`` (asked, not assumed); if not, label it so and ask again."""
    try:
        if await engine.get_weight_version() == version:
            return True
        await engine.update_weight_version(version)
        if await engine.get_weight_version() == version:
            steps.append(f"the version set to {version!r}")
            return True
        steps.append(f"the version is not {version!r} after setting it")
    except Exception as exc:
        steps.append(f"setting the version failed ({type(exc).__name__}: {str(exc)[:200]})")
    return False


async def _restore_adapter(state: Any, restore: dict[str, Any], steps: list[str]) -> bool:
    """Put back the adapter a sync swapped in: the previous version under its name, or no adapter of that name."""
    handler = getattr(state, "openai_serving_models", None)
    if handler is None:
        steps.append("adapter: no LoRA serving")
        return True
    try:
        from vllm.entrypoints.serve.lora.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest

        name, path = str(restore["lora_name"]), restore.get("lora_path")
        if path:
            out = await handler.load_lora_adapter(
                LoadLoRAAdapterRequest(lora_name=name, lora_path=path, load_inplace=True)
            )
        else:
            out = await handler.unload_lora_adapter(UnloadLoRAAdapterRequest(lora_name=name))
    except Exception as exc:
        steps.append(f"adapter restore failed ({type(exc).__name__}: {str(exc)[:200]})")
        return False
    if not isinstance(out, str) and getattr(out, "error", None) is not None:
        steps.append(f"adapter restore failed ({str(out.error)[:200]})")
        return False
    steps.append("adapter put back" if path else "adapter unloaded")
    return True


def _route_path(scope: Any) -> str:
    """The request's path as the app's router reads it: the app's ``root_path`` (vLLM's ``--root-path``) stripped
    when the path starts with it (Starlette's rule), so ``/api/lora_stream/lease`` is the status route too."""
    path = str(scope.get("path", ""))
    root = str(scope.get("root_path", "") or "")
    if root and path.startswith(root) and (len(path) == len(root) or path[len(root)] == "/"):
        return path[len(root) :] or "/"
    return path


def _header(scope: Any, name: str) -> str | None:
    key = name.encode()
    for k, value in scope.get("headers", ()):
        if k.lower() == key:
            return str(value.decode("latin-1"))
    return None


def _lease_headers(scope: Any) -> tuple[str | None, float]:
    """The request's sync, by its name (the credential itself is dropped here: nothing after this sees it), and the
    lease it asks for; ``(None, 0.0)`` for a request that acts for no sync."""
    credential = _header(scope, SYNC_HEADER)
    raw = _header(scope, LEASE_HEADER)
    if credential is None or raw is None or not MIN_CREDENTIAL <= len(credential) <= 512:
        return None, 0.0
    try:
        lease_s = float(raw)
    except ValueError:
        return None, 0.0
    if not math.isfinite(lease_s) or lease_s <= 0:
        return None, 0.0
    return sync_name(credential), min(max(1.0, lease_s), _MAX_LEASE_S)


def committed_version(error: str) -> dict[str, Any] | None:
    """``{"version": ...}`` from the worker's refusal to roll back a committed update, or ``None``."""
    if NOTHING_KEPT not in error:
        return None
    found = re.search(r'as version (null|"(?:[^"\\]|\\.)*")', error)
    if found is None:
        return None
    try:
        return {"version": json.loads(found.group(1))}
    except ValueError:
        return None


def _json_header(scope: Any, name: str) -> dict[str, Any] | None:
    raw = _header(scope, name)
    if raw is None:
        return None
    try:
        data = json.loads(raw)
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


def _restore_header(scope: Any) -> dict[str, Any] | None:
    data = _json_header(scope, RESTORE_HEADER)
    return data if data is not None and "lora_name" in data else None


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
