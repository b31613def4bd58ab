"""The route guard on websocket requests: the same rule as HTTP (the ASGI middleware called directly, no server)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from lora_stream.engine.guard import WeightRoutesGuard

KEY = "guard-test-key"


def _call(path: str, headers: list[tuple[bytes, bytes]], scope_type: str = "websocket") -> tuple[list, list]:
    """Run the guard on one request; returns (paths the app saw, messages the guard sent itself)."""
    calls: list[str] = []
    sent: list[dict[str, Any]] = []

    async def app(scope, receive, send):  # type: ignore[no-untyped-def]
        calls.append(scope.get("path", scope["type"]))

    async def send(message):  # type: ignore[no-untyped-def]
        sent.append(message)

    async def receive():  # type: ignore[no-untyped-def]
        return {"type": "websocket.connect"}

    scope = {"type": scope_type, "path": path, "headers": headers, "app": None}
    asyncio.run(WeightRoutesGuard(app, tokens=[KEY])(scope, receive, send))
    return calls, sent


@pytest.mark.parametrize("path", ["/update_weights", "/collective_rpc", "/init_weight_transfer_engine", "/anything"])
@pytest.mark.parametrize(
    "headers", [[], [(b"authorization", b"Bearer wrong-key")], [(b"authorization", KEY.encode())]], ids=str
)
def test_a_websocket_to_a_guarded_path_without_the_key_is_refused(path: str, headers: list) -> None:
    calls, sent = _call(path, headers)
    assert calls == []  # never reached the app
    assert sent == [{"type": "websocket.close", "code": 1008, "reason": "Unauthorized"}]  # handshake refused: 403


def test_a_websocket_with_the_key_and_the_paths_left_open_pass() -> None:
    auth = [(b"authorization", f"Bearer {KEY}".encode())]
    assert _call("/update_weights", auth) == (["/update_weights"], [])
    # Public probes, and vLLM's own guarded prefixes (its --api-key middleware decides there), as for HTTP.
    assert _call("/health", []) == (["/health"], [])
    assert _call("/v1/realtime", []) == (["/v1/realtime"], [])
    assert _call("", [], scope_type="lifespan") == ([""], [])


def test_the_guard_refuses_a_websocket_when_the_server_has_no_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    calls: list[str] = []
    sent: list[dict[str, Any]] = []

    async def app(scope, receive, send):  # type: ignore[no-untyped-def]
        calls.append(scope["path"])

    async def send(message):  # type: ignore[no-untyped-def]
        sent.append(message)

    async def receive():  # type: ignore[no-untyped-def]
        return {"type": "websocket.connect"}

    scope = {"type": "websocket", "path": "/pause", "headers": [(b"authorization", b"Bearer x")], "app": None}
    asyncio.run(WeightRoutesGuard(app)(scope, receive, send))
    assert calls == [] and sent[0]["type"] == "websocket.close"
