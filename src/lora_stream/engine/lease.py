"""Engine side: the lease under which a trainer holds a vLLM server paused and in a weight update.

A sync pauses the server's generation, opens vLLM's weight-update session, loads, and waits for the trainer ranks'
vote. If the trainer vanishes in between -- its process died, its network broke, it was stopped -- nobody would
ever roll the update back, end the session or resume generation: the server would stay paused, or serve weights
that were never committed, and refuse every later update ("start_weight_update called while a weight update is
already active"). This ASGI middleware, in the server's API process, makes the server heal itself.

**The credential** (:mod:`lora_stream.engine.lease_terms`): every request of a sync carries its secret; the server
keeps and shows only its name, a digest, and a credential shorter than :data:`MIN_CREDENTIAL` is none.

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
import logging
import time
from typing import Any

from .lease_terms import (
    BUSY,
    COMMIT_HEADER,
    DECIDE_PATH,
    EXPIRED,
    LEASED_PATHS,
    NOTHING_KEPT,
    ROLLBACK_HEADER,
    START_PATHS,
    STATUS_PATH,
    UPDATE_PATHS,
    _header,
    _json_header,
    _Lease,
    _lease_headers,
    _restore_header,
    _same,
    committed_version,
    no_session,
)
from .routes import RouteTable, log_unclassified, respond, route_path

logger = logging.getLogger("lora_stream")

__all__ = ["UpdateLease"]


#: The late requests of a sync whose committed update a heal finished (rolled forward), answered as done.
_FORWARDED_OK = frozenset({"/finish_weight_update", "/resume"})

#: A gap this much longer than the watcher's tick means the server's own process did not run (stopped, paused,
#: starved): the lease counts only the server's running time, so the gap is added to it.
_STALL_S = 1.0
_WATCH_S = 0.25
_MAX_EXPIRED = 64


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
        own = route_path(scope) if kind == "http" else None  # lora_stream's own routes, served here
        if own == STATUS_PATH:
            if sync is not None and _same(sync, lease.sync) and self.disabled is None:  # the holder's heartbeat
                await self._renew(sync)
            await respond(send, 200, lease.status(self.disabled, sync, self._table().unclassified()))
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
                await respond(send, 200, {"lora_stream": f"committed; the lease finished it as {version!r}"})
                return
            if sync is not None and sync in lease.expired:
                await respond(
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
                    await respond(
                        send, 409, {"error": f"lora_stream: sync {sync} may not {path}: {why}", "marker": EXPIRED}
                    )
                    return
                if path not in START_PATHS:
                    sync = None  # acts for no sync: judged as any request without lora_stream's headers
            if lease.holding and not _same(lease.sync, sync) and sync is not None and path in START_PATHS:
                # Another sync starts an update (a trainer restarted after dying mid-sync): the holder is healed
                # first, unless one of its requests is running.
                if lease.inflight:
                    await respond(
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
                    await respond(
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
                await respond(send, 409, {"error": error, "marker": EXPIRED})
                return
            lease.decided = {"version": decision.get("version")}
            lease.expires = max(lease.expires, time.monotonic() + lease.lease_s)
        await respond(send, 200, {"recorded": True, "version": lease.decided["version"]})

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


def install(app: Any) -> bool:
    """Add :class:`UpdateLease` to ``app`` (a FastAPI app not yet serving) as its innermost middleware, unless it is
    there already; returns whether it was added."""
    from starlette.middleware import Middleware

    for m in getattr(app, "user_middleware", ()):
        if getattr(m.cls, "lora_stream_lease", False):
            return False
    app.user_middleware.append(Middleware(UpdateLease))
    return True
