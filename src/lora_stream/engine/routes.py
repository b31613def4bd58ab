"""Engine side: what each route of a vLLM OpenAI server may do to the served weights, judged as the app routes it.

Who uses it: :class:`~lora_stream.engine.lease.UpdateLease`, on every request. While a sync holds the server, only the
holding sync may reach a route that is not :data:`SERVING`; and any request that reaches a route that may write the
weights moves the lease's ``weights_by``, which a sync that sends only what changed checks before it trusts the
server to hold its last commit.

**Allow, don't deny.** vLLM adds routes with every release (``/weight_checker``'s ``reset`` zeroes every parameter;
it appeared in 0.32). A list of the routes that write would fall behind, and a route nobody listed would write
through a held sync unseen. So the classes below say what is *proven* harmless, and everything else counts as a
route that writes: refused to anyone but the holder while a sync holds the server, and moving ``weights_by`` when it
runs. A route the table does not know is therefore safe, but may refuse a user's request during a sync that it need
not refuse; the test suite reads every route of each supported vLLM release (its running app, and the sources of the
releases that cannot run here) and fails on one that is not classified, so that someone decides.

**The route a request reaches** is found as the app's router finds it (:meth:`RouteTable.judge`): each route's own
``matches`` on the request's scope, which strips the app's ``root_path`` (vLLM's ``--root-path``: ``/api/X`` and
``/X`` both reach route ``/X``), fills path parameters and checks the method. Comparing the raw path instead would let
``/api/finish_weight_update`` through a guard that refuses ``/finish_weight_update``.

What breaks if a route is misclassified: a route put in :data:`SERVING` that writes would write through a held sync
(the sync then commits over a change it never saw, or a partial sync trusts weights someone else wrote); a route put
in :data:`CONTROL` that writes would leave ``weights_by`` unmoved. Classify a route as serving only after reading its
handler in every supported release.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any, Literal

logger = logging.getLogger("lora_stream")

__all__ = ["CONTROL", "SERVING", "WRITING", "RouteClass", "RouteTable", "route_class"]

RouteClass = Literal["serving", "control", "writing", "unclassified"]

#: Routes that read the weights or report, and never write them, pause or resume generation, or touch an update:
#: allowed to anyone at any time, even while a sync holds the server. Generation waits while the sync pauses it.
#: Each was read in vLLM 0.31 to 0.34. (Generation may load a LoRA adapter through a resolver plugin: adapters are
#: not the base weights, and an adapter sync swaps only the name it owns.)
SERVING = frozenset(
    {
        # liveness, readiness, versions, metrics, the API's own documentation
        "/health",
        "/ready",
        "/readyz",
        "/tokenizer_info",
        "/fault_tolerance/status",
        "/v1/fault_tolerance/status",
        "/checkpoint/status",
        "/ping",
        "/version",
        "/load",
        "/metrics",
        "/kv_event_sources",
        "/openapi.json",
        "/docs",
        "/docs/oauth2-redirect",
        "/redoc",
        # the bundled Swagger UI's files (--enable-offline-docs mounts them: GET and HEAD, never the engine)
        "/static",
        # state reports
        "/server_info",
        "/weight_info",
        "/get_world_size",
        "/is_paused",
        "/is_sleeping",
        "/is_scaling_elastic_ep",
        "/v1/models",
        # tokenization and rendering (no model call)
        "/tokenize",
        "/detokenize",
        "/v1/chat/completions/render",
        "/v1/chat/completions/derender",
        "/v1/completions/render",
        "/v1/completions/derender",
        "/v1/messages/render",
        "/v1/responses/render",
        "/v1/messages/count_tokens",
        # generation and pooling: they read the weights (the abort routes cancel the requests they name, anyone's:
        # generation's own state, never the weights or the pause)
        "/v1/chat/completions",
        "/v1/chat/completions/batch",
        "/v1/completions",
        "/v1/responses",
        "/v1/responses/{response_id}",
        "/v1/responses/{response_id}/cancel",
        "/v1/messages",
        "/v1/systemone",
        "/v1/decisions",
        "/cohere/v2/chat",
        "/cohere/v2/chat/render",
        "/v2/embed",
        "/generative_scoring",
        "/invocations",
        "/inference/v1/generate",
        "/inference/v1/abort_requests",
        "/abort_requests",
        "/v1/audio/transcriptions",
        "/v1/audio/translations",
        "/v1/realtime",
        "/v1/embeddings",
        "/pooling",
        "/classify",
        "/score",
        "/v1/score",
        "/rerank",
        "/v1/rerank",
        "/v2/rerank",
        "/generate",
    }
)
#: Routes that change the server's state but never its weights: generation's pause, caches, LoRA adapters (not the
#: base weights), the version label. Only the holding sync may reach them while it holds the server; they do not
#: move ``weights_by``.
CONTROL = frozenset(
    {
        "/pause",
        "/resume",
        "/reset_prefix_cache",
        "/reset_mm_cache",
        "/reset_encoder_cache",
        "/release_kv_cache_memory",
        "/update_weight_version",
        "/start_profile",
        "/stop_profile",
        "/v1/load_lora_adapter",
        "/v1/unload_lora_adapter",
        "/adapters",
        "/adapters/{adapter_name}",
    }
)
#: Routes known to write the weights, or to reach code that can (any method on every worker): refused to all but the
#: holder while a sync holds the server, and they move ``weights_by``. Listed so that a new route is told apart from
#: a known one: at run time, an unclassified route is treated exactly like these.
WRITING = frozenset(
    {
        "/init_weight_transfer_engine",
        "/shutdown_weight_transfer_engine",
        "/start_weight_update",
        "/start_draft_weight_update",
        "/update_weights",
        "/finish_weight_update",
        "/weight_checker",  # {"action": "reset"} zeroes every parameter
        "/collective_rpc",  # any method on every worker
        "/reload_weights",
        "/load_weights",
        "/sleep",  # level 2 discards the weights
        "/wake_up",
        "/scale_elastic_ep",
        "/fault_tolerance/apply",  # recovery re-initialises the engine's ranks
        "/v1/fault_tolerance/apply",
        "/checkpoint/prepare",
        "/checkpoint/restore",  # puts back the engine's state, weights included
    }
)


def route_class(path: str) -> RouteClass:
    """The class of the route whose template is ``path`` (``"/v1/responses/{response_id}"``, not a request's path)."""
    if path in SERVING:
        return "serving"
    if path in CONTROL:
        return "control"
    if path in WRITING:
        return "writing"
    return "unclassified"


@dataclass
class RouteTable:
    """The routes of one running app, each with its class; built from the app itself (:meth:`of`)."""

    routes: list[tuple[Any, str, RouteClass]] = field(default_factory=list)
    #: How many routes the app's router had when this table was built (a route added later rebuilds it).
    count: int = 0

    @classmethod
    def of(cls, app: Any) -> RouteTable:
        """Every route of ``app`` (a Starlette or FastAPI app), in the router's order, with its class."""
        found = list(getattr(getattr(app, "router", None), "routes", None) or getattr(app, "routes", None) or [])
        paths = [str(getattr(r, "path", "")) for r in found]
        return cls([(r, p, route_class(p)) for r, p in zip(found, paths)], len(found))

    def unclassified(self) -> list[str]:
        """The templates of this app's routes that no class names (sorted, once each)."""
        return sorted({p for _, p, c in self.routes if c == "unclassified"})

    def judge(self, scope: Any) -> tuple[str, RouteClass] | None:
        """The route ``scope`` reaches, as the router picks it (the first full match), with its class; ``None`` when
        no route takes it (the router answers 404 or 405, and nothing runs)."""
        from starlette.routing import Match

        for route, path, klass in self.routes:
            try:
                match, _ = route.matches(scope)
            except Exception:  # a route that cannot judge this scope does not take it
                continue
            if match == Match.FULL:
                return path, ("writing" if klass == "unclassified" else klass)
        return None


def log_unclassified(table: RouteTable) -> None:
    """Say once, at start-up, which routes this server has that lora_stream does not know (treated as writing)."""
    unknown = table.unclassified()
    if unknown:
        logger.warning(
            "lora_stream: this vLLM server has %d route(s) lora_stream has not classified; while a sync holds the "
            "server only that sync may reach them, and each counts as writing the weights: %s",
            len(unknown),
            ", ".join(unknown),
        )


def route_path(scope: Any) -> str:
    """The request's path as the app's router reads it: the app's ``root_path`` (vLLM's ``--root-path``) stripped
    when the path starts with it (Starlette's rule), so ``/api/lora_stream/lease`` is the status route too."""
    path = str(scope.get("path", ""))
    root = str(scope.get("root_path", "") or "")
    if root and path.startswith(root) and (len(path) == len(root) or path[len(root)] == "/"):
        return path[len(root) :] or "/"
    return path


async def respond(send: Any, status: int, body: dict[str, Any]) -> None:
    """Answer an ASGI request with ``body`` as JSON (what the lease answers for a route it refuses or reports)."""
    data = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})
