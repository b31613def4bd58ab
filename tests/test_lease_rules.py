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

from lora_stream.engine.lease import (
    BUSY,
    COMMIT_HEADER,
    LEASE_HEADER,
    NOTHING_KEPT,
    SYNC_HEADER,
    UpdateLease,
    _committed_version,
)


class _Engine:
    """What the heal calls on vLLM's engine client, recorded."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    async def update_weights(self, request: Any) -> None:
        self.calls.append(("update_weights", request.update_info))

    async def finish_weight_update(self, version: Any) -> None:
        self.calls.append(("finish", version))

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
    return lease, engine, ran


def _call(lease: UpdateLease, path: str, sync: str | None = None, seconds: float = 2.0, **headers: str):
    """One request; returns ``(status, body)``."""
    raw = [(k.encode(), v.encode()) for k, v in headers.items()]
    if sync is not None:
        raw += [(SYNC_HEADER.encode(), sync.encode()), (LEASE_HEADER.encode(), str(seconds).encode())]
    scope = {"type": "http", "path": path, "headers": raw}
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
    # An operator's /resume or /pause (no headers), another sync's /resume or /update_weights: refused, naming the
    # holder.
    for path, sync in (("/resume", None), ("/pause", None), ("/resume", "B"), ("/update_weights", "B")):
        status, body = _call(lease, path, sync)
        assert status == 409 and body["marker"] == BUSY and body["holder"] == "A", (path, sync, body)
        assert 0 < body["expires_in"] <= 2.0
    # A read-only route with made-up headers runs, and takes nothing of the lease.
    assert _call(lease, "/v1/models", "someone-else", seconds=1)[0] == 200
    assert lease.lease.sync == "A" and lease.lease.holding and not engine.calls
    assert ran == ["/pause", "/v1/models"]
    # The holder goes on.
    assert _call(lease, "/resume", "A")[0] == 200 and not lease.lease.holding
    # Another sync starting an update supersedes a holder (a trainer restarted after dying mid-sync): healed first.
    assert _call(lease, "/pause", "A")[0] == 200 and lease.lease.holding
    assert _call(lease, "/pause", "B")[0] == 200 and lease.lease.sync == "B"
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


def test_the_workers_refusal_names_the_committed_version() -> None:
    for version in ("v2", 'v"2\\x', None):
        text = f"{NOTHING_KEPT}: this update was committed by sync s as version {json.dumps(version)}: final"
        assert _committed_version(text) == {"version": version}
    assert _committed_version("some other error") is None
