"""The trainer's HTTP client for one vLLM OpenAI server: vLLM's weight-sync routes and lora_stream's lease, with
the API key, timeouts and a budget per stretch of a sync (used by
:class:`~lora_stream.sinks.vllm_server.VLLMServerSink`).

Every failure is a :class:`ServerError` (redacted: no API key, no password of the address); a server that did not
answer within its timeout is marked ``unresponsive`` and is not called again in that sync (its lease heals it).
"""

from __future__ import annotations

import json
import math
import time
from typing import Any

from ..adapter import AdapterStream
from ..engine.adapter_staging import AdapterLoadError
from ..errors import LoraStreamError
from ..redaction import redact_text

__all__ = ["LeaseExpiredError", "ServerError", "VLLMServerClient", "validate_adapter"]


class ServerError(LoraStreamError):
    """The vLLM server is unreachable, refused the request (status and body included), or needs an API key.

    ``unresponsive`` is set when the server did not answer within the timeout, or could not be reached: the sink
    then calls it no more in that sync, and leaves it to its lease (:mod:`lora_stream.engine.lease`). ``answered``
    is set when the server handled the call and refused it: a weight-update call's workers then ended vLLM's update
    session (vLLM ends it when they raise)."""

    unresponsive: bool = False
    answered: bool = False


class LeaseExpiredError(ServerError):
    """The server refused a request of this sync because the sync's lease had expired: the server rolled the
    update back, ended vLLM's update session and resumed generation on its own (:mod:`lora_stream.engine.lease`)."""


class VLLMServerClient:
    """vLLM's weight-sync routes over HTTP, with the API key and timeouts (vLLM's ``VLLMWeightSyncClient`` protocol).

    vLLM's own ``HTTPVLLMWeightSyncClient`` sends no credentials; this one sends ``Authorization: Bearer <key>`` on
    every request and turns transport failures into :class:`ServerError`.
    """

    def __init__(self, base_url: str, *, api_key: str | None = None, timeout: float = 120.0) -> None:
        self.base_url = base_url.rstrip("/")
        #: The address as shown in errors, logs, records and ``repr`` (a password in its userinfo redacted).
        self.url = redact_text(self.base_url)
        self.timeout = timeout
        api_key = api_key.strip() if api_key else api_key  # a key read from a file keeps its newline
        self._secret = api_key or None
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        #: ``(credential, seconds)`` while a sink's sync holds this server: sent with every request, it is the sync's
        #: lease on the server (:mod:`lora_stream.engine.lease`). The credential is a secret: never in an error, a log
        #: or a record (:meth:`hold`).
        self.lease: tuple[str, float] | None = None
        #: The public name of the sync holding this server (a digest of its credential: what the server shows and its
        #: workers record), or ``None``.
        self.sync: str | None = None
        #: Seconds this server's calls may still wait until the sink's next agreement (each call's time is taken
        #: from it; local work between calls is not), or ``None``: no budget.
        self.budget_s: float | None = None
        #: The server did not answer within its timeout or budget, or could not be reached, earlier in this sync:
        #: it is not called again until the sink resets this at its next sync.
        self.unresponsive = False

    def hold(self, credential: str, seconds: float) -> None:
        """From now on every request carries this sync's ``credential`` and asks for a lease of ``seconds`` (the server
        fixes the length when the sync takes it)."""
        from ..engine.lease_terms import sync_name

        self.lease = (credential, seconds)
        self.sync = sync_name(credential)

    def release(self) -> None:
        """The sync ended: requests carry no credential any more."""
        self.lease = None
        self.sync = None

    def remaining(self, timeout: float | None = None) -> float:
        """Seconds the next call may wait: ``timeout`` (or this client's), cut to the budget."""
        wait = timeout or self.timeout
        if self.budget_s is not None:
            wait = min(wait, self.budget_s)
        return wait

    def _redact(self, what: object) -> str:
        """``what`` as text, with the API key replaced: no error, log or reason sent to the peers carries it."""
        # The sync's credential too: the server never echoes it, but a transport error may quote a request.
        return redact_text(str(what), secrets=[self._secret, self.lease[0] if self.lease is not None else None])

    def spend(self, seconds: float) -> None:
        """Take ``seconds`` spent waiting on this server from its budget."""
        if self.budget_s is not None:
            self.budget_s -= seconds

    def __repr__(self) -> str:  # never the headers: they hold the API key
        return f"VLLMServerClient({self.url!r}, timeout={self.timeout})"

    def _request(
        self,
        method: str,
        path: str,
        json: dict[str, Any] | None = None,
        timeout: float | None = None,
        *,
        budgeted: bool = True,
        headers: dict[str, str] | None = None,
        _waited: bool = False,
    ) -> Any:
        import requests

        from ..engine.lease_terms import BUSY, EXPIRED, LEASE_HEADER, SYNC_HEADER

        url = f"{self.base_url}/{path}"
        if self.unresponsive:
            error = ServerError(
                f"vLLM server at {self.url} is not called again in this sync ({method} /{path}): it stopped "
                "answering earlier in it"
            )
            error.unresponsive = True
            raise error
        wait = self.remaining(timeout) if budgeted else (timeout or self.timeout)
        if wait <= 0:
            error = ServerError(
                f"vLLM server at {self.url}: no time left for {method} /{path} before the sync's next agreement"
            )
            raise error  # the server may be fine: a later step with a budget of its own still calls it
        headers = {**self.headers, **(headers or {})}
        if self.lease is not None:
            headers[SYNC_HEADER] = self.lease[0]
            headers[LEASE_HEADER] = f"{self.lease[1]:.3f}"
        began = time.monotonic()
        try:
            response = requests.request(method, url, json=json, headers=headers, timeout=wait)
        except requests.RequestException as exc:
            error = ServerError(f"vLLM server at {self.url} unreachable on {method} /{path}: {self._redact(exc)}")
            error.unresponsive = isinstance(exc, (requests.Timeout, requests.ConnectionError))
            if error.unresponsive and self.lease is not None:
                self.unresponsive = True  # within a sync: leave it to its lease from here on
            raise error from exc
        finally:
            if budgeted:
                self.spend(time.monotonic() - began)
        if response.status_code == 409 and EXPIRED in response.text:
            raise LeaseExpiredError(
                f"vLLM server at {self.url} on {method} /{path}: {self._redact(response.text[:300])}"
            )
        if response.status_code == 409 and BUSY in response.text:
            wait_s = None if _waited else _busy_wait(response)
            room = self.remaining(timeout) if budgeted else (timeout or self.timeout)
            if wait_s is not None and wait_s < room:
                # Another sync holds the server: only it may write until its lease ends, when the server heals
                # itself if that sync is gone (a trainer restarted after dying mid-sync). Wait for it, once.
                time.sleep(wait_s)
                if budgeted:
                    self.spend(wait_s)
                return self._request(method, path, json, timeout, budgeted=budgeted, headers=headers, _waited=True)
            error = ServerError(f"vLLM server at {self.url} on {method} /{path}: {self._redact(response.text[:300])}")
            error.answered = True  # another sync holds it: nothing of this sync's is open there
            raise error
        if response.status_code == 401:
            raise ServerError(f"vLLM server at {self.url} requires an API key (401 on /{path}); pass api_key=")
        if response.status_code >= 400:
            error = ServerError(
                f"vLLM server at {self.url} answered {response.status_code} on {method} /{path}: "
                f"{self._redact(response.text[:500])}"
            )
            error.answered = True  # the server handled the call and refused it (a worker raised, say)
            raise error
        if not response.content:
            return None
        try:
            return response.json()
        except ValueError:
            return response.text  # vLLM answers some routes (/v1/load_lora_adapter) with plain text

    # -- vLLM's VLLMWeightSyncClient protocol --------------------------------------------------------------------------
    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._request("POST", "init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self) -> None:
        self._request("POST", "start_weight_update")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # An update that carries tensors answers only once every chunk arrived: it takes as long as the transfer,
        # which the data plane's own timeouts bound, so the budget between agreements does not apply to it.
        headers = None
        if update_info.get("command") == "rollback":
            from ..engine.lease_terms import ROLLBACK_HEADER

            # Withdraws a decision this sync recorded at the server (record_decision) before the workers roll back.
            headers = {ROLLBACK_HEADER: "1"}
        if update_info.get("command") == "commit":
            from ..engine.lease_terms import COMMIT_HEADER

            # The server's lease records the decision with its version: once the workers answered, a heal rolls
            # the update forward instead of back (the trainer may be stopped before its /finish_weight_update).
            headers = {COMMIT_HEADER: json.dumps({"version": update_info.get("version")})}
        self._request(
            "POST", "update_weights", {"update_info": update_info}, budgeted="command" in update_info, headers=headers
        )

    def record_decision(self, version: str | None) -> None:
        """Record this sync's decision to commit as ``version`` at the server (``POST /lora_stream/decide``), before
        any server of the sync commits: from then on its lease rolls the update forward, never back. Raises
        :class:`LeaseExpiredError` when the sync no longer holds the server (its lease ran out
        meanwhile, or the server restarted)."""
        from ..engine.lease_terms import COMMIT_HEADER, DECIDE_PATH

        self._request("POST", DECIDE_PATH.lstrip("/"), headers={COMMIT_HEADER: json.dumps({"version": version})})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._request(
            "POST", "finish_weight_update", {"weight_version": weight_version} if weight_version is not None else None
        )

    # -- the rest of what the sink needs ---------------------------------------------------------------------------
    def check_access(self) -> dict[str, Any]:
        """``GET /v1/models``: reachability and, if the server has ``--api-key``, that ours is accepted."""
        out: dict[str, Any] = self._request("GET", "v1/models")
        return out

    def world_size(self) -> int:
        return int(self._request("GET", "get_world_size")["world_size"])

    def weight_version(self) -> str | None:
        version = self._request("GET", "weight_info")["weight_version"]
        return None if version is None else str(version)

    def shutdown_weight_transfer_engine(self) -> None:
        self._request("POST", "shutdown_weight_transfer_engine")

    def update_weight_version(self, version: str) -> None:
        self._request("POST", "update_weight_version", {"new_version": version})

    def reset_prefix_cache(self) -> bool:
        """``POST /reset_prefix_cache``: whether vLLM reset it (it answers ``{"success": false}`` while blocks are
        held, e.g. by running requests)."""
        out = self._request("POST", "reset_prefix_cache")
        return not (isinstance(out, dict) and out.get("success") is False)

    def pause(self, mode: str) -> None:
        """``POST /pause?mode=...``: stop generation for a weight update (``wait``: let running requests finish;
        ``abort``: abort them)."""
        self._request("POST", f"pause?mode={mode}")

    def resume(self) -> None:
        self._request("POST", "resume")

    def heartbeat(self, timeout: float) -> dict[str, Any] | None:
        """Renew this sync's lease (``GET /lora_stream/lease`` with the lease headers); outside any budget. Returns
        the server's answer about this sync (``{"holding", "expired", "forwarded"}``), or ``None`` when it gave
        none (a server without lora_stream's lease, or one that failed to answer)."""
        import requests

        from ..engine.lease_terms import LEASE_HEADER, STATUS_PATH, SYNC_HEADER

        if self.lease is None:
            return None
        headers = {**self.headers, SYNC_HEADER: self.lease[0], LEASE_HEADER: f"{self.lease[1]:.3f}"}
        response = requests.get(f"{self.base_url}{STATUS_PATH}", headers=headers, timeout=timeout)
        if response.status_code != 200:
            return None
        try:
            yours = response.json().get("yours")
        except ValueError:
            return None
        return yours if isinstance(yours, dict) else None

    def lease_status(self) -> dict[str, Any] | None:
        """``GET /lora_stream/lease``: the server's lease state, or ``None`` when it runs without lora_stream's
        lease (an older lora_stream, or ``LORA_STREAM_LEASE=0``)."""
        try:
            out = self._request("GET", "lora_stream/lease")
        except ServerError as exc:
            if " 404 " in str(exc):
                return None
            raise
        return out if isinstance(out, dict) else None

    def server_config(self) -> dict[str, Any]:
        """The server's resolved ``VllmConfig`` as JSON (dev-mode ``GET /server_info?config_format=json``): its
        ``weight_transfer_config``, ``model_config``, ``lora_config``, ... (``{}`` if it answers none)."""
        info = self._request("GET", "server_info?config_format=json")
        config = info.get("vllm_config") if isinstance(info, dict) else None
        return config if isinstance(config, dict) else {}

    def max_lora_rank(self) -> int | None:
        """The server's ``--max-lora-rank``, or ``None`` when it runs without ``--enable-lora`` (dev-mode
        ``/server_info``)."""
        lora = self.server_config().get("lora_config")
        return int(lora["max_lora_rank"]) if isinstance(lora, dict) and "max_lora_rank" in lora else None

    def unload_lora_adapter(self, name: str) -> None:
        self._request("POST", "v1/unload_lora_adapter", {"lora_name": name})

    def load_lora_adapter(self, name: str, path: str, *, restore: str | bool | None = False) -> None:
        """``POST /v1/load_lora_adapter`` in place: vLLM builds the adapter staged under ``path``, checks it, and
        only then replaces the version it serves under ``name`` (same adapter id). Needs the server's
        ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``.

        ``restore``: what the server's lease puts back if the sync's trainer vanishes before deciding (the previous
        version's staged path, or ``None``: unload ``name``); ``False`` (a swap back to the previous version
        itself): nothing."""
        extra = None
        if restore is not False:  # tell the server's lease what to put back if this sync's trainer vanishes
            import json

            from ..engine.lease_terms import RESTORE_HEADER

            extra = {RESTORE_HEADER: json.dumps({"lora_name": name, "lora_path": restore})}
        try:
            self._request(
                "POST",
                "v1/load_lora_adapter",
                {"lora_name": name, "lora_path": path, "load_inplace": True},
                headers=extra,
            )
        except ServerError as exc:
            if " 404 " in str(exc) or "Not Found" in str(exc):
                raise ServerError(
                    f"{exc}; adapter sync needs the server started with VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 and "
                    "--enable-lora"
                ) from exc
            raise


def validate_adapter(stream: AdapterStream, max_lora_rank: int | None, where: str) -> None:
    """Refuse, before any byte moves, an adapter that vLLM would refuse: no LoRA support, or vLLM's own
    ``PEFTHelper`` validation (rank above ``max_lora_rank``, DoRA, bias, ...)."""
    from types import SimpleNamespace

    from vllm.lora.peft_helper import PEFTHelper

    if max_lora_rank is None:
        raise AdapterLoadError(
            f"{where} runs without LoRA support; start it with --enable-lora --max-lora-rank <at least the "
            "adapter's rank> (and VLLM_ALLOW_RUNTIME_LORA_UPDATING=1), or sync the merged model"
        )
    try:
        PEFTHelper.from_dict(stream.adapter_config()).validate_legal(SimpleNamespace(max_lora_rank=max_lora_rank))  # type: ignore[arg-type]
    except ValueError as exc:
        raise AdapterLoadError(f"{where} would refuse the adapter: {exc}") from exc


def _busy_wait(response: Any) -> float | None:
    """Seconds to wait for the sync that holds a server to end or lose its lease (a ``409`` busy answer), or
    ``None``: it does not say (a request of that sync is running, or an older server)."""
    try:
        expires_in = response.json().get("expires_in")
    except (ValueError, AttributeError):
        return None
    if not isinstance(expires_in, (int, float)) or not math.isfinite(expires_in):
        return None
    return max(0.0, float(expires_in)) + 1.0  # and a tick of the server's watcher, which heals it
