"""The lease's rules, driven through the middleware itself with a stand-in for vLLM's app and engine (no server):
only the holding sync writes, a decided commit rolls forward, the lease counts the server's running time, and the
worker's refusal to roll back a commit names its version. The same rules on a real server, with real stops, are in
``tests/test_vllm_server.py`` and the soak (``tests/test_vllm_soak.py``)."""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace
from typing import Any

from starlette.routing import Route, Router, WebSocketRoute

from lora_stream.engine.lease import UpdateLease
from lora_stream.engine.lease_terms import (
    BUSY,
    COMMIT_HEADER,
    DECIDE_PATH,
    EXPIRED,
    LEASE_HEADER,
    NOTHING_KEPT,
    ROLLBACK_HEADER,
    SYNC_HEADER,
    committed_version,
    sync_name,
)
from lora_stream.engine.routes import CONTROL, SERVING, WRITING
from lora_stream.sinks.server_replica import lease_lost


class _Engine:
    """What the heal calls on vLLM's engine client, recorded."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.version: str | None = "v1"
        #: The workers already ended vLLM's session (vLLM ends it when a worker raises): finishing finds none.
        self.no_session = False
        #: What the workers' next command raises.
        self.fails: str | None = None

    async def update_weights(self, request: Any) -> None:
        self.calls.append(("update_weights", request.update_info))
        if self.fails is not None:
            error, self.fails = self.fails, None
            raise RuntimeError(error)

    async def finish_weight_update(self, version: Any) -> None:
        self.calls.append(("finish", version))
        if self.no_session:
            raise RuntimeError("finish_weight_update must be called before ...")
        if version is not None:
            self.version = version

    async def update_weight_version(self, version: str) -> None:
        self.calls.append(("label", version))
        self.version = version

    async def get_weight_version(self) -> str | None:
        return self.version

    async def resume_generation(self) -> None:
        self.calls.append(("resume", None))


def _server() -> tuple[UpdateLease, _Engine, list[str]]:
    ran: list[str] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        ran.append(scope["path"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    engine = _Engine()
    lease = UpdateLease(app)
    lease._state = SimpleNamespace(engine_client=engine, args=SimpleNamespace(api_server_count=1))
    lease._app = _APP
    return lease, engine, ran


async def _unused(request: Any) -> None:  # the routes below are only matched, never called
    raise AssertionError


#: A router with every route lora_stream classifies (POST and GET each), as the lease judges requests against the app.
_APP = SimpleNamespace(
    router=Router(
        [Route(p, _unused, methods=["GET", "POST"]) for p in sorted(SERVING | CONTROL | WRITING)]
        + [Route("/brand_new_route", _unused, methods=["POST"])]  # a route nobody classified
        + [WebSocketRoute("/brand_new_socket", _unused), WebSocketRoute("/v1/realtime", _unused)]
    )
)


def _cred(sync: str) -> str:
    """The credential of the test's sync ``sync`` (a label): a secret as long as a real one."""
    return f"{sync}-credential-{'0' * 40}"


def _name(sync: str) -> str:
    """What the server shows of sync ``sync``: the digest of its credential."""
    return sync_name(_cred(sync))


def _call(lease: UpdateLease, path: str, sync: str | None = None, seconds: float = 2.0, root: str = "", **headers: str):
    """One request of sync ``sync`` (a label: its credential is sent); returns ``(status, body)``."""
    raw = [(k.encode(), v.encode()) for k, v in headers.items()]
    if sync is not None:
        raw += [(SYNC_HEADER.encode(), _cred(sync).encode()), (LEASE_HEADER.encode(), str(seconds).encode())]
    scope = {"type": "http", "method": "POST", "path": path, "root_path": root, "headers": raw}
    out: dict[str, Any] = {}

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b""}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            out["status"] = message["status"]
        else:
            out["body"] = message.get("body", b"")

    async def run() -> None:
        await lease(scope, receive, send)
        if lease._watcher is not None:
            lease._watcher.cancel()

    asyncio.run(run())
    body = out.get("body") or b"{}"
    return out["status"], json.loads(body)


def test_only_the_holding_sync_writes() -> None:
    lease, engine, ran = _server()
    assert _call(lease, "/pause", "A")[0] == 200 and lease.lease.holding
    # An operator's /resume or /pause (no headers), another sync's /resume: refused, naming the holder (by its name,
    # never its credential).
    for path, sync in (("/resume", None), ("/pause", None), ("/resume", "B")):
        status, body = _call(lease, path, sync)
        assert status == 409 and body["marker"] == BUSY and body["holder"] == _name("A"), (path, sync, body)
        assert 0 < body["expires_in"] <= 2.0
        assert _cred("A") not in json.dumps(body)
    # Another sync's update route: that sync holds no update here, and never will by this request.
    for path in ("/update_weights", "/finish_weight_update"):
        status, body = _call(lease, path, "B")
        assert status == 409 and body["marker"] == EXPIRED, (path, body)
    # A read-only route with made-up headers runs, and takes nothing of the lease.
    assert _call(lease, "/v1/models", "someone-else", seconds=1)[0] == 200
    assert lease.lease.sync == _name("A") and lease.lease.holding and not engine.calls
    assert ran == ["/pause", "/v1/models"]
    # The holder goes on.
    assert _call(lease, "/resume", "A")[0] == 200 and not lease.lease.holding
    # Its credential acts on nothing now: a replay takes no server.
    assert _call(lease, "/pause", "A")[0] == 409 and not lease.lease.holding
    # Another sync starting an update supersedes a holder (a trainer restarted after dying mid-sync): healed first.
    assert _call(lease, "/pause", "C")[0] == 200 and lease.lease.holding
    assert _call(lease, "/pause", "B")[0] == 200 and lease.lease.sync == _name("B")
    assert ("resume", None) in engine.calls and "superseded" in (lease.lease.last_heal or "")


def test_a_decided_commit_rolls_forward_and_its_late_finish_is_answered_as_done() -> None:
    lease, engine, _ = _server()
    for path in ("/pause", "/start_weight_update"):
        assert _call(lease, path, "A")[0] == 200
    commit = {COMMIT_HEADER: json.dumps({"version": 'v"2'})}
    assert _call(lease, "/update_weights", "A", **commit)[0] == 200
    assert lease.lease.committed == {"version": 'v"2'}
    lease.lease.expires = time.monotonic() - 1  # the trainer stopped before its /finish_weight_update
    asyncio.run(lease._heal("test"))
    assert ("finish", 'v"2') in engine.calls and not any(c[0] == "update_weights" for c in engine.calls)
    assert "rolled forward" in (lease.lease.last_heal or "") and "rolled back" not in (lease.lease.last_heal or "")
    assert not lease.lease.holding
    assert _call(lease, "/finish_weight_update", "A")[0] == 200
    assert _call(lease, "/resume", "A")[0] == 200
    assert _call(lease, "/update_weights", "A")[0] == 409  # anything else of the expired sync


def test_an_undecided_update_is_rolled_back() -> None:
    lease, engine, _ = _server()
    for path in ("/pause", "/start_weight_update", "/update_weights"):
        assert _call(lease, path, "A")[0] == 200
    lease.lease.expires = time.monotonic() - 1
    asyncio.run(lease._heal("test"))
    assert engine.calls[0] == ("update_weights", {"command": "rollback"}) and ("finish", None) in engine.calls
    assert _call(lease, "/finish_weight_update", "A")[0] == 409


def test_the_lease_counts_the_servers_running_time() -> None:
    """A gap in the watcher's ticks (the API process stopped) is added to the lease: the requests that queued
    meanwhile are read before the lease can expire."""
    lease, _, _ = _server()
    assert _call(lease, "/pause", "A")[0] == 200
    expires = lease.lease.expires
    lease._last_tick = time.monotonic() - 6.0  # stopped for 6 s
    lease._account_stall()
    assert lease.lease.expires - expires > 5.0
    expires = lease.lease.expires
    lease._account_stall()  # no gap: nothing added
    assert abs(lease.lease.expires - expires) < 0.5


def test_the_workers_refusal_names_thecommitted_version() -> None:
    for version in ("v2", 'v"2\\x', None):
        text = f"{NOTHING_KEPT}: this update was committed by sync s as version {json.dumps(version)}: final"
        assert committed_version(text) == {"version": version}
    assert committed_version("some other error") is None


def test_while_a_sync_holds_the_server_only_serving_routes_run_for_anyone_else() -> None:
    """Allow, don't deny: a route that writes (``/weight_checker``'s reset zeroes every parameter), changes generation's
    state, or that nobody classified, is refused to anyone but the holder; generation and reports run."""
    lease, engine, ran = _server()
    assert _call(lease, "/start_weight_update", "A")[0] == 200 and lease.lease.holding
    for path in ("/weight_checker", "/brand_new_route", "/collective_rpc", "/reset_mm_cache", "/adapters/x"):
        status, body = _call(lease, path)
        assert status == 409 and body["marker"] == BUSY and body["holder"] == _name("A"), (path, body)
    for path in ("/v1/completions", "/v1/responses/r-1", "/health", "/metrics", "/weight_info"):
        assert _call(lease, path)[0] == 200, path
    assert ran == [
        "/start_weight_update",
        "/v1/completions",
        "/v1/responses/r-1",
        "/health",
        "/metrics",
        "/weight_info",
    ]
    assert lease.lease.sync == _name("A") and lease.lease.weights_by == _name("A") and not engine.calls


def test_a_root_path_prefix_is_judged_as_the_app_routes_it() -> None:
    """vLLM's ``--root-path /api``: the router serves ``/api/X`` as ``/X``, so the lease judges it as ``/X`` (a raw
    comparison let ``/api/finish_weight_update`` through a held sync), and its status answers there too."""
    lease, _, ran = _server()
    assert _call(lease, "/api/start_weight_update", "A", root="/api")[0] == 200 and lease.lease.holding
    for path in ("/api/finish_weight_update", "/finish_weight_update", "/api/weight_checker"):
        status, body = _call(lease, path, root="/api")
        assert status == 409 and body["marker"] == BUSY, (path, body)
    status, body = _call(lease, "/api/lora_stream/lease", "A", root="/api")
    assert (
        status == 200
        and body["yours"]["holding"]
        and body["unclassified_routes"] == ["/brand_new_route", "/brand_new_socket"]
    )
    assert ran == ["/api/start_weight_update"]


def test_every_route_that_may_write_moves_weights_by() -> None:
    """Between syncs, a request to any route not proven to leave the weights alone -- known to write, or not
    classified -- tells the next sync that someone else wrote (``weights_by``); serving and control routes do not."""
    lease, _, _ = _server()
    assert _call(lease, "/start_weight_update", "A")[0] == 200
    assert _call(lease, "/finish_weight_update", "A")[0] == 200 and not lease.lease.holding
    assert lease.lease.weights_by == _name("A")
    for path in ("/v1/completions", "/pause", "/resume", "/reset_prefix_cache", "/start_profile"):
        assert _call(lease, path)[0] == 200 and lease.lease.weights_by == _name("A"), path
    for path in ("/weight_checker", "/brand_new_route", "/wake_up", "/collective_rpc"):
        lease.lease.weights_by = _name("A")
        assert _call(lease, path)[0] == 200 and lease.lease.weights_by is None, path


def test_a_websocket_to_a_route_that_is_not_serving_waits_for_the_holder() -> None:
    lease, _, ran = _server()
    assert _call(lease, "/start_weight_update", "A")[0] == 200
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def receive() -> dict[str, Any]:
        return {"type": "websocket.connect"}

    for path in ("/brand_new_socket", "/v1/realtime"):
        asyncio.run(lease({"type": "websocket", "path": path, "headers": [], "root_path": ""}, receive, send))
    assert sent[0]["type"] == "websocket.close" and ran == ["/start_weight_update", "/v1/realtime"]


def _decide(lease: UpdateLease, sync: str, version: str | None) -> tuple[int, dict]:
    return _call(lease, DECIDE_PATH, sync, **{COMMIT_HEADER: json.dumps({"version": version})})


def test_a_decision_is_recorded_only_by_a_server_the_sync_holds() -> None:
    """Not lost is not held: a server that restarted (a fresh lease: ``holding`` false, ``expired`` false) and one
    whose lease ran out both refuse the decision, so the sync cannot commit elsewhere while they serve the old
    weights."""
    restarted, _, _ = _server()
    status, body = _decide(restarted, "A", "v2")
    assert status == 409 and body["marker"] == EXPIRED and "restarted" in body["error"], body
    status, body = _call(restarted, "/lora_stream/lease", "A")
    assert body["yours"] == {"holding": False, "expired": False, "forwarded": False}
    assert lease_lost(body["yours"]) is not None  # what the sink reads before the vote: lost, not "not lost"
    expired, engine, _ = _server()
    for path in ("/pause", "/start_weight_update", "/update_weights"):
        assert _call(expired, path, "A")[0] == 200
    expired.lease.expires = time.monotonic() - 1  # the feeding rank stopped inside the vote, past its lease
    status, body = _decide(expired, "A", "v2")
    assert status == 409 and "rolled the update back" in body["error"], body
    assert engine.calls[0] == ("update_weights", {"command": "rollback"}) and engine.version == "v1"


def test_a_recorded_decision_rolls_forward_whatever_stops_after_it() -> None:
    """The feeding rank stopped after recording the decision, before its commit: the heal has the workers commit
    and finishes under the decided version; the rank's late commit, finish and resume are answered as done."""
    lease, engine, _ = _server()
    for path in ("/pause", "/start_weight_update", "/update_weights"):
        assert _call(lease, path, "A")[0] == 200
    assert _decide(lease, "A", "v2") == (200, {"recorded": True, "version": "v2"})
    lease.lease.expires = time.monotonic() - 1
    asyncio.run(lease._heal("test"))
    assert engine.calls[0] == ("update_weights", {"command": "commit", "sync": _name("A"), "version": "v2"}), (
        engine.calls
    )
    assert ("finish", "v2") in engine.calls and engine.version == "v2" and not lease.lease.holding
    assert "rolled back" not in (lease.lease.last_heal or "")
    commit = {COMMIT_HEADER: json.dumps({"version": "v2"})}
    for path, headers in (("/update_weights", commit), ("/finish_weight_update", {}), ("/resume", {})):
        assert _call(lease, path, "A", **headers)[0] == 200, path


def test_the_holders_rollback_withdraws_its_decision_before_the_workers_act() -> None:
    lease, engine, _ = _server()
    for path in ("/pause", "/start_weight_update", "/update_weights"):
        assert _call(lease, path, "A")[0] == 200
    assert _decide(lease, "A", "v2")[0] == 200
    assert _call(lease, "/update_weights", "A", **{ROLLBACK_HEADER: "1"})[0] == 200  # another server did not record
    lease.lease.expires = time.monotonic() - 1  # and the rank stopped before its finish
    asyncio.run(lease._heal("test"))
    assert ("update_weights", {"command": "rollback"}) in engine.calls and engine.version == "v1"
    assert not any(c[1] and c[1].get("command") == "commit" for c in engine.calls if c[0] == "update_weights")


def test_a_decided_commit_the_workers_could_not_take_is_neither_rolled_back_nor_resumed() -> None:
    lease, engine, _ = _server()
    for path in ("/pause", "/start_weight_update", "/update_weights"):
        assert _call(lease, path, "A")[0] == 200
    assert _decide(lease, "A", "v2")[0] == 200
    lease.lease.expires = time.monotonic() - 1
    engine.fails = "a worker is busy"
    asyncio.run(lease._heal("test"))
    assert lease.lease.holding and lease.lease.paused and engine.version == "v1"
    assert [c[0] for c in engine.calls] == ["update_weights"], engine.calls
    asyncio.run(lease._heal("retry"))  # the next tick
    assert engine.version == "v2" and not lease.lease.holding and ("resume", None) in engine.calls


def test_a_roll_forward_that_finds_no_session_still_labels_the_version_it_checks() -> None:
    """vLLM ends its update session when a worker raises (as on the refusal to roll back a commit): the heal's
    ``finish_weight_update(version)`` then finds none, and the version never moved. The heal asks the engine which
    version it serves, labels it, and records the sync as forwarded only once the engine says so."""
    lease, engine, _ = _server()
    for path in ("/pause", "/start_weight_update"):
        assert _call(lease, path, "A")[0] == 200
    assert _call(lease, "/update_weights", "A", **{COMMIT_HEADER: json.dumps({"version": "v2"})})[0] == 200
    engine.no_session = True
    lease.lease.expires = time.monotonic() - 1
    asyncio.run(lease._heal("test"))
    assert ("label", "v2") in engine.calls and engine.version == "v2" and lease.lease.forwarded == {_name("A"): "v2"}


def test_a_heal_whose_workers_restored_nothing_says_so_and_still_ends_the_session() -> None:
    lease, engine, _ = _server()
    for path in ("/pause", "/start_weight_update", "/update_weights"):
        assert _call(lease, path, "A")[0] == 200
    engine.fails = f"{NOTHING_KEPT}: this worker was asked to roll back ... it was not rolled back"
    lease.lease.expires = time.monotonic() - 1
    asyncio.run(lease._heal("test"))
    heal = lease.lease.last_heal or ""
    assert "NOT restored" in heal and "rolled back" not in heal.replace("not rolled back", ""), heal
    assert ("finish", None) in engine.calls and not lease.lease.holding


# -- the credential: what anyone can read is never what a request must present --------------------------------------


def _status(lease: UpdateLease, sync: str | None = None) -> dict:
    return _call(lease, "/lora_stream/lease", sync)[1]


def test_the_status_shows_a_digest_of_the_credential_and_presenting_it_back_acts_on_nothing() -> None:
    """The forged decision: a client reads the holder's ``sync`` from the status, posts ``/lora_stream/decide`` with
    it (headers of its own choosing), and the trainer dies before its vote. The server shows only the name, a digest;
    a request presenting the name acts for nobody: its decision is refused, and the heal rolls the update back."""
    lease, engine, _ = _server()
    for path in ("/pause", "/start_weight_update", "/update_weights"):
        assert _call(lease, path, "A")[0] == 200
    shown = _status(lease)
    assert shown["sync"] == _name("A") and shown["holding"] and _cred("A") not in json.dumps(shown)
    forged = {SYNC_HEADER: shown["sync"], LEASE_HEADER: "2", COMMIT_HEADER: json.dumps({"version": "forged"})}
    for headers in (forged, {COMMIT_HEADER: json.dumps({"version": "forged"})}):
        status, body = _call(lease, DECIDE_PATH, **headers)
        assert status == 409 and body["marker"] == EXPIRED and lease.lease.decided is None, (headers, body)
    # The name on every other route the holder reaches: refused, or run as nobody's.
    assert _call(lease, "/finish_weight_update", **forged)[0] == 409
    assert _call(lease, "/update_weights", **{SYNC_HEADER: shown["sync"], LEASE_HEADER: "2"})[0] == 409
    assert _call(lease, "/resume", **forged)[1]["marker"] == BUSY
    assert lease.lease.session and lease.lease.paused and engine.calls == []
    lease.lease.expires = time.monotonic() - 1  # the trainer died before its vote
    asyncio.run(lease._heal("test"))
    assert engine.calls[0] == ("update_weights", {"command": "rollback"}) and engine.version == "v1"
    assert not any(c[0] == "update_weights" and c[1].get("command") == "commit" for c in engine.calls)


def test_a_credential_shorter_than_the_least_length_is_no_credential() -> None:
    lease, _, _ = _server()
    raw = {SYNC_HEADER: "short", LEASE_HEADER: "2"}
    assert _call(lease, "/pause", **raw)[0] == 200 and not lease.lease.holding  # run as nobody's: nothing held


def test_the_lease_length_is_fixed_when_the_hold_starts() -> None:
    """The pinned lease: one request carrying ``X-Lora-Stream-Lease: 86400`` made a dead trainer's lease a day long. A
    later request -- the holder's own, or anyone's -- renews the lease for the length fixed at the start, never more."""
    lease, engine, _ = _server()
    assert _call(lease, "/pause", "A", seconds=2.0)[0] == 200
    for sync in ("A", None):
        _call(lease, "/weight_info", sync, seconds=86400.0)
        _call(lease, "/lora_stream/lease", sync, seconds=86400.0)
        assert lease.lease.lease_s == 2.0 and lease.lease.expires_in() <= 2.0, sync
    forged = {SYNC_HEADER: _name("A"), LEASE_HEADER: "86400"}
    _call(lease, "/weight_info", **forged)
    assert lease.lease.expires_in() <= 2.0
    lease.lease.expires = time.monotonic() - 1
    asyncio.run(lease._heal("test"))
    assert not lease.lease.holding and ("resume", None) in engine.calls


def test_a_replayed_credential_of_an_earlier_sync_acts_on_nothing() -> None:
    """Sync A held the server and released it. Its credential, replayed, takes no server, reaches no update route,
    records no decision, renews nothing, and a write made with it is nobody's (``weights_by`` never says A)."""
    lease, _engine, ran = _server()
    for path in ("/pause", "/start_weight_update", "/finish_weight_update", "/resume"):
        assert _call(lease, path, "A")[0] == 200
    assert not lease.lease.holding and lease.lease.weights_by == _name("A")
    before = list(ran)
    for path in ("/pause", "/start_weight_update", "/init_weight_transfer_engine", "/update_weights"):
        status, body = _call(lease, path, "A")
        assert status == 409 and body["marker"] == EXPIRED, (path, body)
    assert _decide(lease, "A", "v9")[0] == 409
    assert ran == before and not lease.lease.holding
    assert _status(lease, "A")["yours"]["holding"] is False
    # A write with the replayed credential runs as anyone's would between syncs, and says nobody wrote.
    assert _call(lease, "/weight_checker", "A")[0] == 200 and lease.lease.weights_by is None
    # A new sync takes the server as usual.
    assert _call(lease, "/pause", "B")[0] == 200 and lease.lease.sync == _name("B")


def test_the_holder_is_compared_in_constant_time(monkeypatch: Any) -> None:
    import hmac

    import lora_stream.engine.lease_terms as module

    seen: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def compare(a: bytes, b: bytes) -> bool:
        seen.append((a, b))
        return real(a, b)

    monkeypatch.setattr(module.hmac, "compare_digest", compare)
    lease, _, _ = _server()
    assert _call(lease, "/pause", "A")[0] == 200
    seen.clear()
    assert _call(lease, "/resume", "A")[0] == 200
    assert (_name("A").encode(), _name("A").encode()) in seen


# -- after the decision, only forward --------------------------------------------------------------------------------


def test_a_decided_commit_answered_with_an_error_after_the_workers_committed_rolls_forward_under_its_label() -> None:
    """The workers committed the decided update, then the commit's answer was a 500 (a worker raised after the update
    stood, and vLLM ended the session): the lease keeps the session as unknown, never as ended-and-undone; the heal's
    commit finds no session, which after a recorded decision only the commit ends, so it finishes under the decided
    version and labels it."""
    lease, engine, _ = _server()
    failing: dict[str, Any] = {}

    async def app(scope: Any, receive: Any, send: Any) -> None:
        status = failing.pop(scope["path"], 200)
        if status != 200:
            engine.no_session = True  # the workers committed, then vLLM ended the session
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    lease.app = app
    for path in ("/pause", "/start_weight_update", "/update_weights"):
        assert _call(lease, path, "A")[0] == 200
    assert _decide(lease, "A", "v2")[0] == 200
    failing["/update_weights"] = 500
    assert _call(lease, "/update_weights", "A", **{COMMIT_HEADER: json.dumps({"version": "v2"})})[0] == 500
    assert lease.lease.session and lease.lease.decided == {"version": "v2"}  # unknown: not taken as rolled back
    lease.lease.expires = time.monotonic() - 1  # the trainer vanished
    engine.fails = "finish_weight_update must be called before update_weights"  # no session: the commit stood
    asyncio.run(lease._heal("test"))
    assert engine.version == "v2" and ("label", "v2") in engine.calls, engine.calls
    assert not any(c[0] == "update_weights" and c[1].get("command") == "rollback" for c in engine.calls)
    assert not lease.lease.holding and lease.lease.forwarded == {_name("A"): "v2"}
