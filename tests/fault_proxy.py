"""A fault-injecting HTTP proxy in front of a real vLLM server, for the sink's paths after the decision.

The sink talks to the proxy; the proxy forwards every request to the server, except the calls a test marks to fail:
such a call is answered ``500`` either *before* the server saw it (the work not done) or *after* the server did it
(the work done, its answer replaced), or its connection is dropped after the work (a lost connection). The server's
own lease sees the real requests and answers, as it would behind a failing load balancer or a connection cut on the
way back; the failures a lease sees inside the server are in ``tests/test_lease_rules.py``.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import requests

#: The calls a test can fail: what the sink sends after every server recorded the decision.
CALLS = ("commit", "finish", "resume")
#: ``before``: answered 500, not forwarded; ``after``: forwarded, then answered 500; ``drop``: forwarded, then the
#: connection closed without an answer.
MODES = ("before", "after", "drop")


def _call_of(method: str, path: str, body: bytes) -> str | None:
    path = path.split("?", 1)[0]
    if method != "POST":
        return None
    if path == "/update_weights":
        try:
            info = json.loads(body or b"{}").get("update_info") or {}
        except ValueError:
            return None
        return "commit" if info.get("command") == "commit" else None
    return {"/finish_weight_update": "finish", "/resume": "resume"}.get(path)


@dataclass
class Fault:
    call: str
    mode: str
    times: int = 1


class FaultProxy:
    """``FaultProxy(server_url)``: a proxy at :attr:`url`; :meth:`fail` arms a fault, :attr:`seen` counts calls."""

    def __init__(self, target: str) -> None:
        self.target = target.rstrip("/")
        self.fault: Fault | None = None
        self.injected = 0
        self.seen: dict[str, int] = {}
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:  # quiet
                pass

            def _handle(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(length) if length else b""
                call = _call_of(self.command, self.path, body)
                fault = proxy._take(call)
                if fault is not None and fault.mode == "before":
                    self._answer(500, b'{"error": "injected before the server saw it"}')
                    return
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "content-length")}
                try:
                    out = requests.request(
                        self.command, proxy.target + self.path, data=body, headers=headers, timeout=300
                    )
                except requests.RequestException as exc:
                    self._answer(502, json.dumps({"error": str(exc)}).encode())
                    return
                if fault is not None and fault.mode == "drop":
                    self.close_connection = True
                    self.connection.close()
                    return
                if fault is not None:
                    self._answer(500, b'{"error": "injected after the server did it"}')
                    return
                self._answer(out.status_code, out.content, out.headers.get("content-type"))

            def _answer(self, status: int, data: bytes, kind: str | None = "application/json") -> None:
                self.send_response(status)
                self.send_header("content-type", kind or "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_PUT = do_DELETE = _handle

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def fail(self, call: str, mode: str, times: int = 1) -> None:
        assert call in CALLS and mode in MODES, (call, mode)
        with self._lock:
            self.fault, self.injected = Fault(call, mode, times), 0

    def clear(self) -> None:
        with self._lock:
            self.fault = None

    def _take(self, call: str | None) -> Fault | None:
        with self._lock:
            if call is not None:
                self.seen[call] = self.seen.get(call, 0) + 1
            fault = self.fault
            if fault is None or call != fault.call or fault.times <= 0:
                return None
            fault.times -= 1
            self.injected += 1
            return fault

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
