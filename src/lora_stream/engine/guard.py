"""An ASGI middleware for vLLM's OpenAI server: the server's API key on every route that reaches engine state.

vLLM's ``--api-key`` guards the OpenAI routes (``/v1``, ...) only. With ``VLLM_SERVER_DEV_MODE=1`` -- which the
weight-transfer protocol needs -- the server also answers ``/init_weight_transfer_engine``, ``/update_weights``,
``/collective_rpc`` (any method on every worker), ``/pause``, ``/reset_prefix_cache``, ... to anyone who reaches
its port: anyone can replace the served weights. Start the server with this guard and every route except vLLM's own
guarded ones and the public probes requires ``Authorization: Bearer <key>``, with the key the server already has::

    VLLM_SERVER_DEV_MODE=1 python -m vllm.entrypoints.openai.api_server --model DIR \\
        --weight-transfer-config '{"backend": "lora_stream"}' \\
        --api-key "$KEY" --middleware lora_stream.engine.guard.WeightRoutesGuard

Not for a server TRL generates from: TRL's ``VLLMClient`` sends no key, so such a server refuses TRL's requests
(docs/security.md, "With TRL: network isolation").

The key is the server's ``--api-key`` (every one given), else ``VLLM_API_KEY``. A guarded server without a key
answers 401 on those routes, naming the missing setting, rather than running open. Websocket requests follow the
same rule: without the key on a guarded path the handshake is refused (closed before it is accepted: HTTP 403).
``/v1`` behaves exactly as vLLM makes it behave.
"""

from __future__ import annotations

import hashlib
import os
import secrets
from typing import Any

__all__ = ["PUBLIC_PATHS", "WeightRoutesGuard"]

#: Routes left open: liveness and version probes, which read no engine state a caller could abuse.
PUBLIC_PATHS = frozenset({"/health", "/ping", "/version"})
#: Prefixes vLLM's own ``--api-key`` middleware guards; left to it so that their behaviour does not change.
_VLLM_GUARDED = ("/v1", "/v2", "/inference", "/cohere")


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8")).digest()


class WeightRoutesGuard:
    """Pure ASGI middleware: a bearer key on every route that is neither public nor already guarded by vLLM.

    Loaded by vLLM as ``--middleware lora_stream.engine.guard.WeightRoutesGuard`` (``app.add_middleware``). Keys are
    compared as SHA-256 digests with :func:`secrets.compare_digest`, in constant time.
    """

    def __init__(self, app: Any, tokens: list[str] | None = None) -> None:
        self.app = app
        self._tokens = [_digest(t) for t in tokens] if tokens else None

    def _keys(self, scope: Any) -> list[bytes]:
        if self._tokens is None:
            args = getattr(getattr(scope.get("app"), "state", None), "args", None)
            keys = [k for k in (getattr(args, "api_key", None) or [os.environ.get("VLLM_API_KEY")]) if k]
            self._tokens = [_digest(k) for k in keys]
        return self._tokens

    @staticmethod
    def _presented(scope: Any) -> bytes | None:
        for name, value in scope.get("headers", ()):
            if name.lower() == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                return _digest(token.strip()) if scheme.lower() == "bearer" else None
        return None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        # Requests come as "http" and "websocket" scopes, and both follow the rule below; "lifespan" (startup,
        # shutdown) passes, and so do CORS preflights (OPTIONS, sent without credentials), as before.
        if scope["type"] not in ("http", "websocket") or (scope["type"] == "http" and scope.get("method") == "OPTIONS"):
            await self.app(scope, receive, send)
            return
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        if path in PUBLIC_PATHS or path.startswith(_VLLM_GUARDED):
            await self.app(scope, receive, send)
            return
        keys = self._keys(scope)
        presented = self._presented(scope)
        ok = False
        for key in keys:
            ok |= presented is not None and secrets.compare_digest(presented, key)
        if ok:
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            # Closing before accepting refuses the handshake: the server answers it with HTTP 403.
            await send({"type": "websocket.close", "code": 1008, "reason": "Unauthorized"})
            return
        from starlette.responses import JSONResponse

        message = (
            "Unauthorized: this route changes or reads engine state and needs the server's API key as a bearer token"
            if keys
            else "Unauthorized: lora_stream's route guard is installed but the server has no API key; start it with "
            "--api-key or VLLM_API_KEY"
        )
        response = JSONResponse({"error": message}, status_code=401, headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)
