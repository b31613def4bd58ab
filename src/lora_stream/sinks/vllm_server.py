"""Push a stream into one running vLLM OpenAI server, or a fleet of them, through vLLM's weight-transfer protocol.

Each server must run with ``VLLM_SERVER_DEV_MODE=1`` and ``--weight-transfer-config '{"backend": "gloo"}'`` (or
``"lora_stream"``: the same engine, shipped with lora_stream as a vLLM plugin). The sink builds lora_stream's
trainer-side engine per server (its data plane over gloo or nccl) with the :class:`~lora_stream.ParamStream` as its
``WeightSource``, and per sync runs vLLM's bracket: start, update (one metadata message, then the data plane),
finish with a weight version -- inside one transaction across the trainer ranks and the servers.

Every trainer rank calls :meth:`VLLMServerSink.sync` (the stream's gathers are collectives); server ``i`` is fed by
trainer rank ``i % world_size``. Failures end the sync on every rank with an error, never a hang: each HTTP call and
each broadcast has a timeout, the ranks agree on the outcome before and after the transfer, and a server-side error
stops the sending to that server between chunks.

Security: vLLM's ``--api-key`` protects ``/v1/...`` only. The dev-mode routes (``/init_weight_transfer_engine``,
``/update_weights``, ``/collective_rpc``, ...) answer anyone who reaches the port: guard them with
:class:`~lora_stream.engine.guard.WeightRoutesGuard`. The data plane's store listens on the feeding rank's
``master_address`` only and admits only holders of its group's secret; see ``docs/security.md``.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import logging
import math
import threading
import time
import uuid
import warnings
from collections.abc import Sequence
from typing import Any

from ..adapter import ADAPTER_PREFIX, AdapterStream
from ..changes import Changes, EngineState, SyncedSources, takes_selection
from ..coordination import this_rank
from ..engine.adapter_staging import AdapterLoadError, adapter_path
from ..engine.reload import LOAD_ERROR_TAG, VLLMLoadError
from ..errors import LoraStreamError, ReplicaError, ReplicaExcludedWarning, TransferError
from ..lockstep import COMPLETION_GRACE_S, describe_error
from ..redaction import redact_text
from ..stream import ParamStream
from ..transaction import LOST_WAIT_S, Transaction, fault_point
from .engine_base import EngineBaseRecord
from .prefix_cache import PrefixCacheError, reset_prefix_cache
from .preflight import EngineCheckpoint, adapter_preflight, preflight
from .record import AdapterSyncRecord, SyncRecord
from .source import SyncSource
from .verify import (
    ProbeHistory,
    Verification,
    VerificationError,
    VerifyPolicy,
    check_policy,
    compare,
    model_vocab_size,
    probe_ids,
    should_verify,
    tolerance,
    trainer_logprobs,
)

logger = logging.getLogger("lora_stream")

__all__ = [
    "DEFAULT_LEASE_S",
    "PAUSE_MODES",
    "LeaseExpiredError",
    "REPLICA_POLICIES",
    "ServerError",
    "VLLMServerClient",
    "VLLMServerSink",
    "is_replica_failure",
    "validate_adapter",
]


#: How long a server waits for a silent trainer before healing itself (``VLLMServerSink``'s ``lease``).
DEFAULT_LEASE_S = 30.0
#: Slack added to computed waits: scheduling, the agreement's own round trip.
_MARGIN_S = 10.0

#: Packing buffer size per backend when the sink is not told one (see ``VLLMServerSink``'s ``buffer_bytes``).
DEFAULT_BUFFER_BYTES = {"gloo": 1024 * 1024, "nccl": 256 * 1024 * 1024}


#: ``pause=`` values: vLLM's ``/pause`` modes that keep every response on one version (``wait``: running requests
#: finish on the old weights first; ``abort``: they are aborted), or ``None`` (no pause: only for a server that
#: generates nothing during syncs).
PAUSE_MODES = ("wait", "abort", None)


class ServerError(LoraStreamError):
    """The vLLM server is unreachable, refused the request (status and body included), or needs an API key.

    ``unresponsive`` is set when the server did not answer within the timeout, or could not be reached: the sink
    then calls it no more in that sync, and leaves it to its lease (:mod:`lora_stream.engine.lease`)."""

    unresponsive: bool = False


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
        #: ``(sync id, seconds)`` while a sink's sync holds this server: sent with every request, it is the sync's
        #: lease on the server (:mod:`lora_stream.engine.lease`).
        self.lease: tuple[str, float] | None = None
        #: Seconds this server's calls may still wait until the sink's next agreement (each call's time is taken
        #: from it; local work between calls is not), or ``None``: no budget.
        self.budget_s: float | None = None
        #: The server did not answer within its timeout or budget, or could not be reached, earlier in this sync:
        #: it is not called again until the sink resets this at its next sync.
        self.unresponsive = False

    def remaining(self, timeout: float | None = None) -> float:
        """Seconds the next call may wait: ``timeout`` (or this client's), cut to the budget."""
        wait = timeout or self.timeout
        if self.budget_s is not None:
            wait = min(wait, self.budget_s)
        return wait

    def _redact(self, what: object) -> str:
        """``what`` as text, with the API key replaced: no error, log or reason sent to the peers carries it."""
        return redact_text(str(what), secrets=[self._secret])

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

        from ..engine.lease import BUSY, EXPIRED, LEASE_HEADER, SYNC_HEADER

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
            raise ServerError(f"vLLM server at {self.url} on {method} /{path}: {self._redact(response.text[:300])}")
        if response.status_code == 401:
            raise ServerError(f"vLLM server at {self.url} requires an API key (401 on /{path}); pass api_key=")
        if response.status_code >= 400:
            raise ServerError(
                f"vLLM server at {self.url} answered {response.status_code} on {method} /{path}: "
                f"{self._redact(response.text[:500])}"
            )
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
        if update_info.get("command") == "commit":
            from ..engine.lease import COMMIT_HEADER

            # The server's lease records the decision with its version: once the workers answered, a heal rolls
            # the update forward instead of back (the trainer may be stopped before its /finish_weight_update).
            headers = {COMMIT_HEADER: json.dumps({"version": update_info.get("version")})}
        self._request(
            "POST", "update_weights", {"update_info": update_info}, budgeted="command" in update_info, headers=headers
        )

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

        from ..engine.lease import LEASE_HEADER, STATUS_PATH, SYNC_HEADER

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

    def max_lora_rank(self) -> int | None:
        """The server's ``--max-lora-rank``, or ``None`` when it runs without ``--enable-lora`` (dev-mode
        ``/server_info``)."""
        info = self._request("GET", "server_info?config_format=json")
        config = (info or {}).get("vllm_config") or {}
        lora = config.get("lora_config") if isinstance(config, dict) else None
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

            from ..engine.lease import RESTORE_HEADER

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


class _CurrentSource:
    """The ``WeightSource`` the trainer-side transfer engine is built with once: it replays whatever sync is current.

    vLLM's trainer engines take their source at ``trainer_init`` and replay it on every ``send_weights()``; the sink
    points this object at each sync's :class:`SyncSource` instead of reconfiguring the engine.
    """

    def __init__(self) -> None:
        self.current: SyncSource | None = None

    def _source(self) -> SyncSource:
        if self.current is None:
            raise RuntimeError("no sync in progress")
        return self.current

    @property
    def weight_version(self) -> str | None:
        return self._source().weight_version

    @property
    def aliases(self) -> list[str]:
        return self._source().aliases

    @property
    def adapter(self) -> dict[str, Any] | None:
        return self._source().adapter

    @property
    def merge_info(self) -> dict[str, Any] | None:
        """The engine-side merge's recipes (``None``: the merged tensors travel)."""
        return getattr(self._source(), "merge_info", None)

    def metadata(self) -> Any:
        return self._source().metadata()

    def groups(self) -> Any:
        return self._source().groups()

    def held_names(self) -> None:
        return None

    def iter_groups(self) -> Any:
        return self._source().iter_groups()

    def batches(self) -> Any:
        return self._source().batches()

    def __iter__(self) -> Any:
        return iter(self._source())


#: ``on_replica_failure=`` values (see :class:`VLLMServerSink`).
REPLICA_POLICIES = ("abort", "exclude")


class _Replica:
    """One server of the sink's fleet, as the trainer sees it: its client, the trainer rank that feeds it, its
    transfer engine (its own group), and where its last update stands."""

    def __init__(self, index: int, client: VLLMServerClient) -> None:
        self.index = index
        self.client = client
        self.url = client.url
        self.sender = 0
        self.engine: Any = None
        self.ckpt: EngineCheckpoint | None = None
        #: Where the adapter this server serves now is staged in its workers (kept while a new version may fail).
        self.serving_path: str | None = None
        self.state = _ServerUpdate()
        #: Why this server left the latest sync (``on_replica_failure="exclude"``), or ``None``.
        self.failure: BaseException | None = None
        #: It was excluded from the previous sync: the next one readmits it with the full current weights.
        self.was_excluded = False
        #: Whether the server was asked once whether it keeps lora_stream's lease.
        self.lease_checked = False
        #: What the server holds since this sink's last merged commit into it (:mod:`lora_stream.changes`): that
        #: sync's id (which its workers hold), the id of the latest sync that wrote through it (what its lease reports
        #: as ``weights_by``), its API process's ``boot`` id then, and the names its modules read together.
        self.holds: str | None = None
        self.written_by: str | None = None
        self.boot: str | None = None
        self.units: list[list[str]] | None = None
        self.why_full = "no sync committed into this server by this sink yet"
        #: This sync's view of it, from the pre-flight: its lease status (``None``: it keeps none), and the ``boot``
        #: id of the server process its transfer group was built with.
        self.status: dict[str, Any] | None = None
        self.engine_boot: str | None = None

    def forget(self, why: str) -> None:
        """The server may hold anything (``why``): its next merged sync sends every output."""
        self.holds = self.written_by = self.boot = None
        self.units = None
        self.why_full = why

    def engine_state(self) -> EngineState:
        """Whether this server still holds this sink's last merged commit (what the pre-flight read)."""
        from ..changes import EngineState

        status = self.status
        if self.holds is None:
            return EngineState(self.why_full)
        if status is None or not status.get("boot"):
            return EngineState("the server keeps no lora_stream lease to say what it holds")
        if status.get("boot") != self.boot:
            return EngineState("the server restarted since this sink's last commit")
        if status.get("weights_by") != self.written_by:
            return EngineState("another update wrote the server's weights since this sink's last commit")
        units = None if self.units is None else tuple(tuple(u) for u in self.units)
        return EngineState(None, units)


def is_replica_failure(error: BaseException) -> bool:
    """Whether ``error`` is a failure of one server (unreachable, an error answered, its data plane broken, its
    prefix cache stuck), which ``on_replica_failure="exclude"`` may exclude it for; anything else (a refusal of the
    stream, a failure of the trainer) fails the sync on every replica."""
    if isinstance(error, VLLMLoadError):
        return False  # the stream does not fit the served model: every replica would refuse it
    return isinstance(
        error, (ServerError, TransferError, PrefixCacheError, VerificationError, TimeoutError, ConnectionError)
    )


class VLLMServerSink:
    """Streams :class:`~lora_stream.ParamStream` passes into the weights of one vLLM server or a fleet of them.

    >>> sink = VLLMServerSink(  # doctest: +SKIP
    ...     url, rank=rank, backend="nccl" if on_gpu else "gloo", api_key=os.environ.get("VLLM_API_KEY"), timeout=120
    ... )
    >>> record = sink.sync(ParamStream(model, group_by="layer"), version=f"step-{step}")  # every rank

    A fleet: ``VLLMServerSink([url_a, url_b, ...], on_replica_failure="exclude")`` (``examples/recipe_fleet.py``).

    Implements :class:`~lora_stream.sinks.base.Sink`: the pre-flight, the tied aliases and the record are the
    colocated sink's (:func:`~lora_stream.sinks.preflight.preflight`, :class:`~lora_stream.sinks.source.SyncSource`);
    on the server, lora_stream's worker engine loads through the same :class:`~lora_stream.engine.reload.ReloadBracket`
    and its reload check.

    **Several servers.** Each server (with its tensor-parallel workers) gets a transfer group of its own, fed by one
    trainer rank: server ``i`` by rank ``i % world_size`` (``spread=True``, the default), or every server by rank 0
    (``spread=False``). After the stream's gathers every trainer rank holds each tensor, so spreading costs no extra
    gather: each rank sends the model once per server it feeds, and with as many trainer ranks as servers the bytes
    leave each rank once per sync, whatever the fleet's size. One sync is one transaction across every trainer rank
    and every server: all commit, or all keep serving exactly what they served (``on_replica_failure="abort"``), or
    the servers that failed are excluded and the others commit (``"exclude"``; the record's ``excluded`` and a
    :class:`~lora_stream.ReplicaExcludedWarning` name them). An excluded server is tried again at the next sync and,
    once it takes it, serves the full current weights (``record.readmitted``).

    Args:
        base_url: the server's address, or a list of them (one sink keeps them all in sync).
        rank: this trainer rank. Defaults to ``torch.distributed``'s rank, or 0.
        api_key: sent as a bearer token to every server (its ``--api-key``; with lora_stream's route guard it also
            opens the weight-update routes).
        backend: the data plane's transport: ``"gloo"`` (CPU or GPU hosts) or ``"nccl"`` (GPUs). Both run through
            lora_stream's worker engine (the server's ``--weight-transfer-config '{"backend": "gloo"}'``, or
            ``"lora_stream"``: the same engine) and the same transaction; only the collective differs.
        master_address: the address each feeding rank's store listens on (its host, reachable by the servers).
        buffer_bytes: packing buffer size; chunks follow the stream's groups and a larger tensor travels alone, as
            its own bytes, without a copy. Default: 1 MiB for ``gloo`` (small tensors are packed, every large one
            travels uncopied: 0.93 s per sync against 1.23 s with 256 MiB buffers on the server benchmark,
            ``docs/benchmarks.md``), 256 MiB for ``nccl``.
        timeout: seconds for every HTTP call, the group rendezvous and each chunk's broadcast.
        checkpoint: where to read the served model's safetensors headers for the pre-flight check; defaults to
            the path each server reports in ``/v1/models`` (when it exists on this machine). ``False`` skips it.
        lora_name: the name an :class:`~lora_stream.AdapterStream` sync serves its adapter under (what
            ``/v1/completions`` takes as ``model``); the server needs ``--enable-lora`` and
            ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``.
        rollback: the server's workers keep a host copy of what an update replaces until the trainer ranks have
            voted, so that a failed sync leaves the server serving exactly what it served (default). ``False``
            saves that memory and copy; a failed sync then leaves updated layers new.
        pause: how generation is paused for the update (:data:`PAUSE_MODES`; default ``"wait"``).
        prefix_cache_timeout: seconds to keep retrying a server's prefix-cache reset while it answers
            ``success: false``; past it the sync fails and is rolled back.
        on_replica_failure: ``"abort"`` (default): a failure of any server fails the sync everywhere and every
            server keeps its previous version. ``"exclude"``: a server that fails (:func:`is_replica_failure`:
            unreachable, an error answered, its data plane broken) is rolled back and left out, and the others
            commit; if every server fails, the sync fails.
        spread: feed server ``i`` from trainer rank ``i % world_size`` (default) instead of all from rank 0.
        lease: seconds a server waits for a silent trainer, once this sync paused it or opened an update, before it
            rolls the update back, ends vLLM's update session and resumes generation by itself
            (:mod:`lora_stream.engine.lease`). The feeding rank renews it every ``lease / 6`` seconds while it lives,
            so it expires only when that process died, stopped or was cut off. A decision arriving after it expired
            is refused (``409``).
        verify: verify each sync before it commits, with generation still paused (``True``; ``N``: every N-th
            sync, the first included; a callable of the sync's index; ``False``: never, the default), as the
            colocated sink does (:mod:`lora_stream.sinks.verify`). On every server: the probe through the workers'
            own model with the loaded weights against the trainer's forward (adapters active), within
            ``verify_tolerance`` (default: :func:`~lora_stream.sinks.verify.tolerance` of the served dtype); the
            served probe must have changed if the trainer's moved since the previous sync by more than one rounding
            of the served dtype; every worker must report, and data-parallel workers holding the same shard must
            hold the same bytes (vLLM's weight digests, and a digest of every byte each received: vLLM's cannot see
            weights a kernel repacked out of their parameters). Across a fleet, every server must hold the same
            bytes (servers of one parallel layout; the digests of different layouts differ). A
            server that fails it is rolled back with the sync (or excluded, under ``"exclude"``). Merged syncs only:
            an :class:`~lora_stream.AdapterStream` sync with ``verify`` is refused in the pre-flight.
        verify_tolerance: nats; default :func:`~lora_stream.sinks.verify.tolerance` of the dtypes involved.
        skip_unchanged: a merged sync sends only the outputs whose sources changed since the servers' version,
            as the colocated sink does (:mod:`lora_stream.changes`): each server's lease must report that
            it runs since, and that no other update wrote it since, this sink's last commit into it, and its workers
            refuse a partial update computed against other weights. A fleet gets one pass: if any server needs
            every output (a fresh, restarted or readmitted one), every server gets every output in that sync.
            On by default; ``False``: every sync sends every output.
        merge: where a merged sync's merges run (:mod:`lora_stream.engine_merge`, docs "Where the merge runs").
            ``"trainer"`` (default): the merged tensors travel. ``"engine"``: each changed output's merge travels
            with its trainable inputs only (LoRA, DoRA, LoHa/LoKr factors, ``lora_bias``, ``modules_to_save``
            copies), and the servers' workers run the same merge code on the base they keep -- bit for bit what the
            trainer-side merge serves, at an adapter sync's bytes, served at merged speed. The base travels with
            the first sync into a server (and again whenever a frozen weight changes, a server restarts, or a sync
            fails), fingerprinted per tensor; a partial update onto any other base is refused before a byte is
            loaded; a failed partial update is rolled back by recomputing, with no copy of the model. A quantized
            (QLoRA) base is refused in the pre-flight; fused MoE experts are converted to the checkpoint's layout by
            transformers' own conversion in the workers. Needs
            ``skip_unchanged=True``.

    **Timeouts and the deadline.** Every rank waits for the others at each agreement :meth:`wait_s` at most (the
    stream's ``timeout``, raised to cover what a feeding rank may spend between two agreements); each server gets
    at most ``timeout + prefix_cache_timeout`` seconds of calls between two agreements, and a server that does not
    answer within ``timeout`` is not called again in that sync: it is left to its lease. So once a sync stops
    making progress, every rank returns or raises within :meth:`deadline_s`.
    """

    def __init__(
        self,
        base_url: str | Sequence[str],
        *,
        rank: int | None = None,
        api_key: str | None = None,
        backend: str = "gloo",
        master_address: str = "127.0.0.1",
        buffer_bytes: int | None = None,
        timeout: float = 120.0,
        checkpoint: str | bool | None = None,
        lora_name: str = "lora_stream",
        rollback: bool = True,
        pause: str | None = "wait",
        prefix_cache_timeout: float = 30.0,
        on_replica_failure: str = "abort",
        spread: bool = True,
        lease: float = DEFAULT_LEASE_S,
        verify: VerifyPolicy = False,
        verify_tolerance: float | None = None,
        skip_unchanged: bool = True,
        merge: str = "trainer",
    ) -> None:
        from ..engine_merge import MERGE_LOCATIONS

        if merge not in MERGE_LOCATIONS:
            raise ValueError(f"merge must be one of {MERGE_LOCATIONS}, got {merge!r}")
        if merge == "engine" and not skip_unchanged:
            raise ValueError(
                "merge='engine' sends the base once and then only what changed; it needs skip_unchanged=True"
            )
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
        if pause not in PAUSE_MODES:
            raise ValueError(
                f"pause must be one of {PAUSE_MODES}, got {pause!r}"
                + (
                    ": vLLM's 'keep' freezes running requests and resumes them on the new weights, so one response "
                    "would be computed partly with each version"
                    if pause == "keep"
                    else ""
                )
            )
        if on_replica_failure not in REPLICA_POLICIES:
            raise ValueError(f"on_replica_failure must be one of {REPLICA_POLICIES}, got {on_replica_failure!r}")
        urls = [base_url] if isinstance(base_url, str) else list(base_url)
        if not urls:
            raise ValueError("base_url: at least one server address is needed")
        clients = [VLLMServerClient(u, api_key=api_key, timeout=timeout) for u in urls]
        # As shown: two addresses that differ only in a redacted password would be one server in every message.
        seen = [c.url for c in clients]
        if len(set(seen)) != len(seen):
            raise ValueError(f"base_url lists a server twice: {seen}")
        self.rollback = rollback
        self.pause = pause
        self.prefix_cache_timeout = prefix_cache_timeout
        self.on_replica_failure = on_replica_failure
        self.spread = spread
        if not lease > 0:
            raise ValueError(f"lease must be a positive number of seconds, got {lease!r}")
        self.lease = float(lease)
        self.rank = this_rank() if rank is None else rank
        self.replicas = [_Replica(i, c) for i, c in enumerate(clients)]
        self.backend = backend
        self.name = f"vllm-server/{backend}"
        self.master_address = master_address
        self.buffer_bytes = buffer_bytes if buffer_bytes is not None else DEFAULT_BUFFER_BYTES[backend]
        self.timeout = timeout
        self.checkpoint = checkpoint
        self._source = _CurrentSource()
        self.lora_name = lora_name
        self.verify = check_policy(verify)
        self.verify_tolerance = verify_tolerance
        self.skip_unchanged = skip_unchanged
        self.merge = merge
        #: merge="engine": which base the servers hold from this sink.
        self._base = EngineBaseRecord()
        self._last_source: SyncSource | None = None
        #: This rank's fingerprints at the last committed merged sync (``None``: none, or it failed).
        self._synced: SyncedSources | None = None
        #: Committed syncs (what ``verify=N`` counts).
        self._syncs = 0
        self._history = ProbeHistory()

    @property
    def client(self) -> VLLMServerClient:
        """The first server's client (the only one when the sink has one server)."""
        return self.replicas[0].client

    @property
    def urls(self) -> list[str]:
        return [r.url for r in self.replicas]

    @property
    def is_sender(self) -> bool:
        """Whether this trainer rank feeds at least one server."""
        return any(r.sender == self.rank for r in self._assign())

    def _assign(self) -> list[_Replica]:
        """Which trainer rank feeds which server: the same on every rank (it depends on the list and the world)."""
        import torch.distributed as dist

        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        for r in self.replicas:
            r.sender = r.index % world if self.spread else 0
        return self.replicas

    def sync(self, stream: ParamStream, *, version: str | None = None) -> SyncRecord:
        """Send one full pass of ``stream`` to every server as one transaction; on success every server (but those
        excluded, with ``on_replica_failure="exclude"``) serves it and reports ``version``, on every rank's return.
        On failure every rank raises and every server serves exactly what it served before (``/weight_info``
        unchanged).

        Each feeding rank pauses generation on its servers (``pause=``), opens vLLM's update session, sends; each
        server's workers load, check and keep what they replaced; the rank resets each prefix cache (reading vLLM's
        answer). The ranks vote; each feeding rank tells its servers' workers to commit (the version moves) or roll
        back, and resumes generation. An :class:`~lora_stream.AdapterStream` is staged in each server's workers and
        swapped in by vLLM's own ``/v1/load_lora_adapter`` as the adapter ``lora_name`` (base weights untouched);
        the record is an :class:`~lora_stream.sinks.record.AdapterSyncRecord`; a rollback swaps the previous
        version back in."""
        with Transaction.for_stream(stream, self.name, wait_s=self.wait_s(stream)) as tx:
            return self._sync(stream, version, tx)

    def wait_s(self, stream: ParamStream) -> float:
        """Seconds every trainer rank waits for the others at each agreement of a sync, the stream's exchanges
        included: the stream's ``timeout``, or more when a feeding rank's own steps between two agreements may take
        longer. Each server a rank feeds gets at most ``timeout + prefix_cache_timeout`` seconds of calls between
        two agreements, plus, after the pass, one ``timeout`` for its update's answer; so a feeding rank is back at
        the next agreement within ``servers it feeds x (2 x timeout + prefix_cache_timeout)`` plus a margin (10 s),
        and no rank gives up on one that is still within its bounds. The same on every rank."""
        world = _world_size()
        fed = -(-len(self.replicas) // world) if self.spread else len(self.replicas)
        # Per server between two agreements: its budget of calls, and (after the pass) the wait for its update's
        # answer, which the data plane's timeout bounds.
        steps = fed * (2 * self.timeout + self.prefix_cache_timeout) + _MARGIN_S
        if self.verify:  # the verification's reports are waited for outside the servers' budgets
            from ..transfer.sender import REPORT_WAIT_S

            steps += fed * REPORT_WAIT_S
        return max(stream.timeout.total_seconds(), steps)

    def deadline_s(self, stream: ParamStream) -> float:
        """The longest any rank can take, once a sync stops making progress (a rank, a server or the network
        stalled), to return or raise: one :meth:`wait_s` at the agreement that finds it, plus the wind-down -- the
        remaining agreements (:data:`~lora_stream.transaction.LOST_WAIT_S` each once a peer is lost, and at most
        :data:`~lora_stream.lockstep.COMPLETION_GRACE_S` for an exchange a peer completed just as this rank gave up)
        and, on a feeding rank, the budgets of rolling back (``timeout + prefix_cache_timeout``) and resuming
        (``timeout``) each server it feeds."""
        world = _world_size()
        fed = -(-len(self.replicas) // world) if self.spread else len(self.replicas)
        wind_down = fed * (2 * self.timeout + self.prefix_cache_timeout)  # each server's abort and resume budgets
        return self.wait_s(stream) + wind_down + 4 * LOST_WAIT_S + COMPLETION_GRACE_S + _MARGIN_S

    def _sync(self, stream: ParamStream, version: str | None, tx: Transaction) -> SyncRecord:
        """The sync as one line: prepare, transfer, verify and reset, vote and commit, conclude (commit or abort),
        resume. Each phase is one method below; every rank runs every phase's agreements alike."""
        start = time.perf_counter()
        mine = self._start_sync()
        keeper = _LeaseKeeper(mine, self.lease)
        plan: _SyncPlan | None = None
        committed = False
        try:
            plan = self._prepare_sync(tx, stream, mine)
            source = self._arm(stream, mine, plan, version)
            try:
                self._transfer(tx, mine, keeper, source)
                verification = self._check_loaded(tx, stream, mine, plan.ids, source)
                self._commit_all(tx, mine, version, source)
                excluded, readmitted = self._agree_on_fleet(tx, mine)
                self._conclude(tx, mine)
                committed = True
            finally:
                # On every path (a failure raised by _conclude on every rank alike, or one that escaped the
                # transaction itself): never leave a server paused by this sync.
                resume_failures = self._resume(mine, tx.error)
        finally:
            keeper.stop()
            if plan is not None:  # a sync refused in its pre-flight wrote nothing: the records stand
                self._remember(plan, mine, committed)
            for r in mine:
                r.client.lease = None
                r.client.budget_s = None
        resume_note = self._agree_on_resume(tx, resume_failures, version)
        return self._record(source, mine, version, start, verification, excluded, readmitted, resume_note, plan)

    # -- the phases of a sync ------------------------------------------------------------------------------------------
    def _start_sync(self) -> list[_Replica]:
        """The servers this rank feeds, each starting this sync from scratch (one excluded last time is tried
        again), under a new lease."""
        mine = [r for r in self._assign() if r.sender == self.rank]
        sync_id = uuid.uuid4().hex
        for r in mine:
            r.was_excluded, r.failure, r.state = r.failure is not None, None, _ServerUpdate()
            r.client.lease = (sync_id, self.lease)
            r.client.unresponsive = False
            if r.engine is not None:  # where the previous sync's transfer stood is not this one's
                r.engine.started, r.engine.pending, r.engine.stalled = False, None, False
        return mine

    def _phase(self, mine: list[_Replica]) -> None:
        """A new stretch between two agreements: every server this rank feeds gets a fresh budget of calls."""
        for r in mine:
            r.client.budget_s = self.timeout + self.prefix_cache_timeout

    def _prepare_sync(self, tx: Transaction, stream: ParamStream, mine: list[_Replica]) -> _SyncPlan:
        """1. prepare: each feeding rank checks its servers (reachable, key accepted, LoRA limits) and the stream
        against their checkpoints, and joins their transfer groups; every rank learns the outcome before any rank
        gathers. A server that a vanished sink left paused or in an open update is healed by its lease at this
        sync's first request."""
        self._phase(mine)
        verifying = should_verify(self.verify, self._syncs)  # the same on every rank: commits are agreed

        def prepare() -> _SyncPlan:
            aliases = self._prepare(stream, mine, verifying)
            ids = probe_ids(model_vocab_size(stream.model)) if verifying else None
            adapter = None
            if isinstance(stream, AdapterStream):
                adapter = {
                    "path": adapter_path(self.lora_name, uuid.uuid4().hex[:12]),
                    "config": stream.adapter_config(),
                }
            skipping = self.skip_unchanged and adapter is None and takes_selection(stream)
            merge_plan = self._base.plan(stream) if adapter is None and self.merge == "engine" else None
            t = time.perf_counter()
            fingerprints = stream.fingerprints() if skipping else None
            base_fps = merge_plan.base_fingerprints(stream) if merge_plan is not None else None
            return _SyncPlan(
                aliases,
                ids,
                adapter,
                fingerprints,
                fingerprint_s=time.perf_counter() - t,
                merge_plan=merge_plan,
                base_fps=base_fps,
            )

        plan = tx.prepare(prepare)
        if plan.fingerprints is None:
            return plan
        from ..changes import agree_on_changes

        engines = [r.engine_state() for r in self._live(mine)]
        force = self._base.reason(plan.base_fps, plan.fingerprints, self._synced) if plan.merge_plan else None
        changes = agree_on_changes(tx, stream, plan.fingerprints, self._synced, engines, plan.aliases, force_full=force)
        if not changes.agreed:
            assert tx.error is not None
            raise tx.error
        return dataclasses.replace(plan, changes=changes)

    def _arm(self, stream: ParamStream, mine: list[_Replica], plan: _SyncPlan, version: str | None) -> SyncSource:
        """Tell each live server's engine what this sync asks of its workers; returns what is sent."""
        # The probe before loading serves the "it changed" check only, which needs the previous sync verified.
        before = plan.ids if plan.ids is not None and self._history.wants_before(self._syncs) else None
        changes = plan.changes
        selection = changes.selection if changes is not None else None
        for r in self._live(mine):
            r.engine.keep_previous = self.rollback  # read per sync: the option may change between syncs
            r.engine.adapter_keep = r.serving_path
            r.engine.probe_ids = before  # the workers probe what they serve before loading
            r.engine.digest_received = plan.ids is not None  # and digest every byte they receive
            r.engine.base_sync = r.holds if selection is not None else None  # what its workers must hold
        full_because = changes.full_because if changes is not None else None
        if changes is None and plan.adapter is None:
            full_because = "skip_unchanged=False"
        if plan.merge_plan is not None:
            from .source import EngineMergeSource

            source: SyncSource = EngineMergeSource(
                stream,
                plan.merge_plan,
                plan.aliases,
                version,
                selection=selection,
                full_because=full_because,
                base_fp=self._base.sent,
            )
        else:
            source = SyncSource(
                stream, plan.aliases, version, plan.adapter, selection=selection, full_because=full_because
            )
        self._source.current = source
        self._last_source = source
        return source

    def _transfer(self, tx: Transaction, mine: list[_Replica], keeper: _LeaseKeeper, source: SyncSource) -> None:
        """2. transfer, under a pause of generation: no request is computed partly with each version. From the
        pause on, the sync holds each server under its lease (kept alive by this rank's heartbeat)."""
        self._phase(mine)
        keeper.start()
        with tx.attempt():
            for r in self._live(mine):
                self._on(r, lambda r=r: self._pause(r))
            try:
                from ..transfer.sender import send_to_engines

                sending = self._live(mine)
                # send_to_engines names a failed engine by its position in the list it was given.
                on_failure = (
                    (lambda i, e: self._drop_in_transfer(sending[i].index, e))
                    if self.on_replica_failure == "exclude"
                    else None
                )
                send_to_engines([r.engine for r in sending], source, on_failure=on_failure)
            except BaseException as exc:
                # Every worker that received data must hear the outcome: one still waiting for chunks fails when
                # its data plane closes (and rolls back itself, ending vLLM's session); one that loaded everything
                # waits for the decision, and the abort sends it.
                for r in mine:
                    if r.failure is None:
                        self._settle_transfer(r)
                error = _load_error(exc)
                if error is exc:
                    raise
                raise error from exc
            finally:
                self._source.current = None
            for r in self._live(mine):
                r.state.loaded = r.state.session = True  # the workers hold it open, waiting for the decision
            self._phase(mine)
            adapter = source.adapter
            if adapter is not None:
                for r in self._live(mine):
                    self._on(r, lambda r=r: self._load_adapter(r, adapter["path"]))
            fault_point("reload-check")

    def _check_loaded(
        self, tx: Transaction, stream: ParamStream, mine: list[_Replica], ids: list[int] | None, source: SyncSource
    ) -> Verification | None:
        """3. verify (opt-in), still paused: the trainer's forward is a collective, so the ranks first agree that
        every server loaded; then every rank runs it, and each feeding rank probes its servers. Then each prefix
        cache is reset (its blocks were computed with the old weights)."""
        verification: Verification | None = None
        if ids is not None and tx.vote("after loading", known=source.ended_early):
            self._phase(mine)
            digests: list[str] = []
            with tx.attempt():
                verification, digests = self._verify(stream, ids, mine)
                fault_point("verify")
            self._agree_on_weights(tx, digests)
        with tx.attempt() as go:
            if go:
                # Within the phase's budget: the transfer's, or the verification's (its call and this reset).
                for r in self._live(mine):
                    self._on(r, lambda r=r: self._reset_prefix_cache(r))
                fault_point("prefix-cache")
                fault_point("commit")
                self._confirm_leases(mine)
        return verification

    def _confirm_leases(self, mine: list[_Replica]) -> None:
        """Before the vote to commit: every server this rank fed must still be held by this sync. A rank stopped
        longer than the lease (a GC pause, a preemption), or a server stalled longer than it, finds here that the
        server healed and rolled the update back; its vote then fails the sync on every rank, instead of the others
        committing while that server stays on the old version. What remains is the window between this check and
        the commit request."""
        for r in self._live(mine):

            def confirm(r: _Replica = r) -> None:
                lost = r.state.lease_lost
                if lost is None:
                    lost = _lease_lost((r.client.lease_status() or {}).get("yours"))  # with this sync's headers
                if lost is not None:
                    raise LeaseExpiredError(f"vLLM server at {r.url}: before the vote to commit, {lost}")

            self._on(r, confirm)

    def _commit_all(self, tx: Transaction, mine: list[_Replica], version: str | None, source: SyncSource) -> None:
        """4. vote; each feeding rank commits on its servers; a second vote carries the outcome of those calls."""
        if tx.vote("before committing", known=source.ended_early):
            self._phase(mine)
            with tx.attempt():
                for r in self._live(mine):
                    self._on(r, lambda r=r: self._commit(r, version, source.adapter))
            tx.vote("after committing")

    def _conclude(self, tx: Transaction, mine: list[_Replica]) -> None:
        """5. committed on every server, or (raising on every rank alike, since the votes told every rank) rolled
        back on every server."""
        self._phase(mine)
        tx.conclude(lambda: None, lambda error: self._abort(mine, error))
        self._history.committed(self._syncs)
        self._syncs += 1

    def _remember(self, plan: _SyncPlan, mine: list[_Replica], committed: bool) -> None:
        """After a merged sync: what this rank's shards were, for the next one (or nothing, after a failure; a
        server excluded or failed is forgotten too)."""
        if plan.adapter is not None:
            return
        changes = plan.changes
        self._synced = changes.sources if committed and changes is not None else None
        source, self._last_source = self._last_source, None
        self._base.remember(committed and plan.merge_plan is not None, source, plan.base_fps)
        for r in mine:
            if r.failure is not None:
                r.forget("the server was excluded from the last sync")
            elif not committed or not r.state.committed:
                r.forget("the last sync failed (the server was rolled back)")

    def _agree_on_resume(self, tx: Transaction, resume_failures: list[str], version: str | None) -> str | None:
        """6. committed: every rank learns whether resuming failed on any server (its lease resumes it by itself),
        so that every rank records it alike. Returns what failed, or ``None``."""
        failed_resume = tx.any_of([bool(resume_failures)], "after resuming generation")
        if failed_resume is not None and not failed_resume[0]:
            return None
        resume_note = (
            "; ".join(resume_failures)
            if resume_failures
            else "resuming generation failed on a server another trainer rank feeds (or that rank was lost)"
        ) + f"; the server's lease resumes it within {self.lease:g} s"
        warnings.warn(f"lora_stream: sync {version!r} committed, but {resume_note}", RuntimeWarning, stacklevel=4)
        tx.error = None  # committed everywhere: what failed after is recorded, not raised
        return resume_note

    def _record(
        self,
        source: SyncSource,
        mine: list[_Replica],
        version: str | None,
        start: float,
        verification: Verification | None,
        excluded: dict[str, str],
        readmitted: tuple[str, ...],
        resume_note: str | None,
        plan: _SyncPlan | None = None,
    ) -> SyncRecord:
        """The committed sync's record: what was sent, the workers' stages, the fleet's outcome."""
        record = source.record(self.name, time.perf_counter() - start)
        fed = [r for r in mine if r.engine is not None and r.state.committed]
        stages = dict(getattr(fed[0].engine, "last_stages", None) or {}) if fed else {}
        if plan is not None and plan.fingerprints is not None:
            stages["fingerprint_s"] = plan.fingerprint_s
            if plan.changes is not None:
                stages.update(plan.changes.stages)
        if len(fed) > 1:
            stages["replicas"] = {r.url: dict(r.engine.last_stages or {}) for r in fed}
        record = dataclasses.replace(
            record,
            stages=stages,
            verification=verification,
            replicas=tuple(u for u in self.urls if u not in excluded),
            excluded=excluded,
            readmitted=readmitted,
            resume_failure=resume_note,
        )
        for url, reason in excluded.items():
            warnings.warn(
                f"lora_stream: the vLLM server at {url} was excluded from sync {version!r} ({reason}); the other "
                "servers committed it, and the next sync tries this one again with the full weights",
                ReplicaExcludedWarning,
                stacklevel=4,
            )
        if isinstance(source.stream, AdapterStream):
            record = AdapterSyncRecord(**record.__dict__, lora_name=self.lora_name)
        record.log()
        return record

    # -- per-server steps (on the rank that feeds the server) -------------------------------------------------------
    def _live(self, replicas: list[_Replica]) -> list[_Replica]:
        return [r for r in replicas if r.failure is None]

    def _on(self, replica: _Replica, step: Any) -> None:
        """Run one server's ``step``: under ``"exclude"`` a failure of that server excludes it (rolled back, left
        out); otherwise, or for a failure that is not the server's, it fails the sync."""
        if replica.failure is not None:
            return
        try:
            step()
        except BaseException as exc:
            if self.on_replica_failure != "exclude" or not is_replica_failure(_load_error(exc)):
                raise
            self._drop(replica.index, exc)

    def _drop(self, index: int, error: BaseException) -> None:
        """Exclude server ``index`` from this sync: put it back as it was, as far as it still answers."""
        replica = self.replicas[index]
        replica.failure = _load_error(error)
        logger.warning("lora_stream: excluding the vLLM server at %s from this sync: %s", replica.url, error)
        try:
            self._abort_replica(replica, replica.failure)
        except BaseException as exc:  # it may be gone: what matters is that the others go on
            logger.warning("lora_stream: rolling back the excluded server at %s failed: %r", replica.url, exc)
        replica.serving_path = None  # restarted or not, it is sent the whole adapter at its readmission

    def _drop_in_transfer(self, index: int, error: BaseException) -> None:
        """A server failed during the transfer: settle where its update stands (its data plane torn down first, so
        that workers still waiting for chunks fail at once and roll back themselves), then exclude it."""
        self._settle_transfer(self.replicas[index])
        self._drop(index, error)

    def _settle_transfer(self, replica: _Replica) -> None:
        """After a transfer that did not complete for ``replica``: close its data plane, then learn whether its
        workers still hold the update open (they loaded every chunk and wait for the decision: the abort must send
        it) or ended it (an update that fails rolls back in the workers, and vLLM ends the session)."""
        engine = replica.engine
        started = bool(getattr(engine, "started", False))
        pending = getattr(engine, "pending", None)
        stalled = bool(getattr(engine, "stalled", False))
        self._close(replica)
        state = replica.state
        state.session = False
        if not started:
            return
        if pending is None:  # the session opened, the update was never sent
            state.session = True
            return
        if stalled:
            replica.client.unresponsive = True  # a chunk it never took: left to its lease
            state.session = True
            return
        began = time.monotonic()
        try:
            pending.result(timeout=max(0.0, replica.client.remaining()))
            state.session = True  # loaded, and waiting for the decision
        except concurrent.futures.TimeoutError:
            replica.client.unresponsive = True
            state.session = True
        except BaseException:
            state.session = False  # the update failed: the workers rolled it back and vLLM ended the session
        finally:
            replica.client.spend(time.monotonic() - began)

    def _pause(self, replica: _Replica) -> None:
        if self.pause is not None:
            replica.state.paused = True  # sent: a pause that timed out may still land, and must be resumed
            replica.client.pause(self.pause)

    def _reset_prefix_cache(self, replica: _Replica) -> None:
        reset_prefix_cache(replica.client.reset_prefix_cache, self.prefix_cache_timeout, replica.url)

    def _load_adapter(self, replica: _Replica, path: str) -> None:
        replica.state.adapter_loaded = True
        replica.state.adapter_path = path
        replica.client.load_lora_adapter(self.lora_name, path, restore=replica.serving_path)

    # -- verification (verify=) ---------------------------------------------------------------------------------------
    def _verify(
        self, stream: ParamStream, ids: list[int], mine: list[_Replica]
    ) -> tuple[Verification | None, list[str]]:
        """The trainer's probe (its forward: a collective under ZeRO-3 / FSDP, so every rank runs it), then each
        server this rank feeds checked against it. Returns this rank's worst server verification (``None`` when it
        feeds none) and the weight digest of each server that passed."""
        t = time.perf_counter()
        trainer, scale = trainer_logprobs(stream.model, ids)
        trainer_s = time.perf_counter() - t
        self._history.propose(self._syncs, trainer)
        trainer_dtype = next(stream.model.parameters()).dtype
        results: list[tuple[Verification, str]] = []
        for r in self._live(mine):
            self._on(r, lambda r=r: results.append(self._verify_replica(r, ids, trainer, scale, trainer_dtype)))
        digests = [d for _, d in results]  # compared across every server of the fleet by _agree_on_weights
        worst = max((v for v, _ in results), key=lambda v: v.max_abs_diff, default=None)
        if worst is not None:
            worst = dataclasses.replace(worst, stages={"trainer_s": trainer_s, **worst.stages})
        return worst, digests

    def _verify_replica(
        self, replica: _Replica, ids: list[int], trainer: Any, scale: float, trainer_dtype: Any
    ) -> tuple[Verification, str]:
        """Ask ``replica``'s workers to probe the weights they loaded (``{"command": "verify"}``) and check every
        worker's report; returns the server's verification and its weight digest."""
        import torch

        t = time.perf_counter()
        replica.client.update_weights({"command": "verify", "probe_ids": ids})
        call_s = time.perf_counter() - t
        engine = replica.engine
        reports = engine.verification_reports()
        where = f" (the vLLM server at {replica.url})"
        workers = engine.init_info.world_size - 1
        silent = [k for k in range(1, workers + 1) if k not in reports]
        if silent:
            raise VerificationError(
                f"rank {self.rank}: verification failed{where}: worker(s) {silent} of {workers} reported nothing, so "
                "what they serve is unknown; the sync is rolled back",
                max_abs_diff=math.inf,
                tolerance=0.0,
            )
        failed = {k: rep["error"] for k, rep in reports.items() if "error" in rep}
        if failed:
            raise VerificationError(
                f"rank {self.rank}: verification failed{where}: the probe could not run on worker(s) "
                f"{sorted(failed)} ({next(iter(failed.values()))}); the sync is rolled back",
                max_abs_diff=math.inf,
                tolerance=0.0,
            )
        first = next(iter(reports.values()))
        engine_dtype = getattr(torch, str(first["dtype"]), torch.bfloat16)
        limit = self.verify_tolerance
        if limit is None:
            limit = tolerance(engine_dtype, trainer_dtype, int(first["layers"]), scale)
        verification: Verification | None = None
        probed = {k: rep for k, rep in reports.items() if rep.get("after") is not None}
        if not probed:
            raise VerificationError(
                f"rank {self.rank}: verification failed{where}: no worker returned the probe's logits",
                max_abs_diff=math.inf,
                tolerance=limit,
            )
        for k, rep in probed.items():
            checked = compare(torch.tensor(rep["after"]), trainer, limit, call_s, self.rank, f"{where}, worker {k}")
            if verification is None or checked.max_abs_diff > verification.max_abs_diff:
                verification = checked
        # Workers that hold the same shard (the server's data-parallel replicas) must hold the same bytes.
        layouts: dict[str, set[str]] = {}
        for rep in reports.values():
            # What the worker serves as vLLM sees it, and what it received (what kernels repacked out of their
            # parameters is only seen there).
            layouts.setdefault(str(rep["layout"]), set()).add(f"{rep['digest']}/{rep.get('received')}")
        split = sorted(layout for layout, ds in layouts.items() if len(ds) > 1)
        if split:
            raise VerificationError(
                f"rank {self.rank}: verification failed{where}: its data-parallel workers holding shard(s) {split} do "
                "not hold the same weights (vLLM's weight digests differ); the sync is rolled back",
                max_abs_diff=math.inf,
                tolerance=limit,
            )
        for k, rep in probed.items():
            key = f"{replica.url}#{k}"
            self._history.check(
                self._syncs,
                key,
                rep.get("before"),
                rep["after"],
                trainer,
                scale,
                engine_dtype,
                limit,
                self.rank,
                f"{where}, worker {k}",
            )
            self._history.propose(self._syncs, trainer, key, rep["after"])
        assert verification is not None
        worker_s = {
            key: max(float(rep["seconds"].get(key, 0.0)) for rep in reports.values()) for key in first["seconds"]
        }
        verification = dataclasses.replace(verification, stages={**worker_s, "verify_call_s": call_s})
        from ..transfer.protocol import replica_digest

        digest = replica_digest({layout: ",".join(sorted(ds)) for layout, ds in layouts.items()})
        return verification, digest

    def _agree_on_weights(self, tx: Transaction, digests: list[str]) -> None:
        """A fleet: every rank learns whether its servers, and the servers fed by the other ranks, hold the same
        weights. One exchange of 128 bits on every rank alike (64 bits of each server's digest, each as "is 1" and
        "is 0"; none from a server that failed, or from a rank that feeds none): the servers agree iff no bit is
        both."""
        if len(self.replicas) < 2:
            return
        bits = [False] * 128
        for digest in digests:
            value = int(digest[:16], 16)
            for i in range(64):
                one = bool(value >> i & 1)
                bits[i] |= one
                bits[64 + i] |= not one
        agreed = tx.any_of(bits, "comparing the servers' weights")
        if agreed is not None and any(agreed[i] and agreed[64 + i] for i in range(64)):
            tx._record(
                VerificationError(
                    f"rank {self.rank}: the vLLM servers of the fleet do not hold the same weights after this sync "
                    "(their weight digests differ, whichever trainer ranks feed them; servers of different "
                    "parallel layouts cannot be compared); the sync is rolled back on every server",
                    max_abs_diff=math.inf,
                    tolerance=0.0,
                )
            )

    def _commit(self, replica: _Replica, version: str | None, adapter: dict[str, Any] | None) -> None:
        replica.state.version = version
        sync = replica.client.lease[0] if replica.client.lease is not None else None
        replica.client.update_weights({"command": "commit", "sync": sync, "version": version})
        replica.state.committed = True
        replica.client.finish_weight_update(version)
        replica.state.session = False
        if adapter is not None:
            replica.serving_path = adapter["path"]
            replica.written_by = sync  # the base weights are untouched: the workers hold what they held
        else:
            status = replica.status or {}
            replica.holds = replica.written_by = sync
            replica.boot = status.get("boot")
            replica.units = replica.engine.last_units if replica.engine is not None else None

    def _abort(self, mine: list[_Replica], error: BaseException) -> None:
        """Every rank failed the sync: each feeding rank puts its servers back, and the data planes start over."""
        committed = [r.url for r in mine if r.state.committed]
        if committed:
            error.add_note(f"lora_stream: {', '.join(committed)} had already committed this update before the failure")
        failures = []
        for r in self._live(mine):
            try:
                self._abort_replica(r, error)
            except BaseException as exc:
                failures.append(f"{r.url}: {describe_error(exc)}")
        if failures:
            raise ServerError("; ".join(failures))

    def _abort_replica(self, replica: _Replica, error: BaseException) -> None:
        """Put ``replica`` back as it was before this sync, whatever its workers' state: an update still open
        (mid-transfer or loaded and waiting) is rolled back and vLLM's session ended, a staged adapter swapped back,
        the prefix cache reset. A server that stopped answering is left to its lease, which does the same."""
        state = replica.state
        client = replica.client
        client.budget_s = self.timeout + self.prefix_cache_timeout  # the abort's own budget, whatever came before
        try:
            if state.committed:
                if state.session and not client.unresponsive:  # committed, but finishing failed: end the session
                    client.finish_weight_update(state.version)
                    state.session = False
                return
            if replica.engine is not None and not state.loaded:
                self._settle_transfer(replica)  # the pass failed before this server's transfer ended
            if client.unresponsive:
                error.add_note(
                    f"lora_stream: {replica.url} stopped answering; its lease ({self.lease:g} s) rolls the update "
                    "back, ends vLLM's update session and resumes generation by itself"
                )
                return
            try:
                if state.adapter_loaded:
                    if replica.serving_path is not None:
                        client.load_lora_adapter(self.lora_name, replica.serving_path)
                    else:
                        client.unload_lora_adapter(self.lora_name)
                if state.session:
                    client.update_weights({"command": "rollback"})
                    client.finish_weight_update(None)
                    state.session = False
                if not self.rollback and not state.adapter_loaded:
                    error.add_note(
                        f"lora_stream: rollback=False: layers of {replica.url} that received their weights serve the "
                        "new ones"
                    )
                self._reset_prefix_cache(replica)
            except LeaseExpiredError:
                state.session = state.paused = False  # its lease already rolled it back and resumed it
        finally:
            self._close(replica)  # the data plane may be half-used: start over with a new group next time

    def _resume(self, mine: list[_Replica], error: BaseException | None) -> list[str]:
        """Resume generation on every server this rank paused, on every path; returns what failed (also added to
        ``error`` as notes). A server that stopped answering, or whose lease already resumed it, is skipped."""
        failures: list[str] = []
        for r in mine:
            if not r.state.paused:
                continue
            if r.client.unresponsive:
                if error is None and r.failure is None:
                    failures.append(f"{r.url} stopped answering before generation could be resumed")
                continue
            try:
                r.client.budget_s = self.timeout  # its own budget, whatever came before
                r.client.resume()
                r.state.paused = False
            except LeaseExpiredError:
                r.state.paused = False
            except BaseException as exc:
                if r.failure is not None:
                    continue  # excluded: it may be gone, and the others are served
                failures.append(f"resuming {r.url}'s generation failed: {describe_error(exc)}")
        if error is not None:
            for f in failures:
                error.add_note(f"lora_stream: {f}")
        return failures

    def _agree_on_fleet(self, tx: Transaction, mine: list[_Replica]) -> tuple[dict[str, str], tuple[str, ...]]:
        """Under ``"exclude"``: every rank learns which servers were excluded (and readmitted) on any rank; if none
        is left, the sync fails on every rank. One exchange of two bits per server (never more than it carries),
        after the votes, on every rank alike; the reasons stay with the rank that feeds the server."""
        if self.on_replica_failure != "exclude" or not tx.ok:
            return {}, ()
        n = len(self.replicas)
        bits = [self.replicas[i].failure is not None for i in range(n)]
        bits += [self.replicas[i].was_excluded and self.replicas[i].failure is None for i in range(n)]
        mine_ids = {r.index for r in mine}
        for i in range(n):
            if i not in mine_ids:
                bits[i] = bits[n + i] = False
        agreed = tx.any_of(bits, "agreeing on the fleet")
        if agreed is None:
            return {}, ()
        excluded: dict[str, str] = {}
        for r in self.replicas:
            if not agreed[r.index]:
                continue
            if r.index in mine_ids and r.failure is not None:
                excluded[r.url] = describe_error(r.failure)
            else:
                excluded[r.url] = f"excluded by trainer rank {r.sender}, which feeds it (its reason is in that log)"
        readmitted = tuple(r.url for r in self.replicas if agreed[n + r.index])
        if len(excluded) == n:
            tx.error = ReplicaError(
                "every vLLM server failed the sync: " + "; ".join(f"{u}: {why}" for u, why in excluded.items()),
                failures=excluded,
            )
            return {}, ()
        return excluded, readmitted

    def _close(self, replica: _Replica) -> None:
        engine, replica.engine = replica.engine, None
        if engine is not None:
            engine.shutdown()

    def forget(self) -> None:
        """Trust nothing about what the servers hold: the next merged sync sends every output (after writing a
        server's weights some other way its lease cannot see, say), the engine-side merge's base with them."""
        self._synced = None
        self._base.forget()
        for r in self.replicas:
            r.forget("forget() was called")

    def close(self) -> None:
        """Tear down every server's data plane (the next sync builds new groups)."""
        for r in self.replicas:
            self._close(r)

    # -- steps of sync -----------------------------------------------------------------------------------------------
    def preflight(self, stream: ParamStream) -> None:
        """The checks the next sync's prepare phase makes on the servers this rank feeds (reachable, key accepted,
        an adapter's LoRA limits, the stream against each served checkpoint), without joining any transfer group.
        This rank's view only: :meth:`sync` agrees the outcome across the ranks."""
        for r in self._assign():
            if r.sender == self.rank:
                self._preflight(stream, r)

    def _prepare(self, stream: ParamStream, mine: list[_Replica], verifying: bool = False) -> dict[str, str]:
        """This rank's servers: reachability, credentials, the pre-flight, the transfer groups. Raises (or, under
        ``"exclude"``, excludes the server) before anything is sent."""
        if verifying and isinstance(stream, AdapterStream):
            raise LoraStreamError(
                "verify= on a server checks merged syncs only: the probe runs through the served model without "
                "vLLM's LoRA layers, so an adapter sync cannot be verified there; sync with verify=False, or sync "
                "the merged model (ParamStream)"
            )
        aliases: dict[str, str] = {}
        for r in mine:

            def check(r: _Replica = r) -> None:
                aliases.update(self._preflight(stream, r))
                self._read_status(r)
                self._check_lease(r)
                self._ensure_engine(r)

            self._on(r, check)
        return aliases

    def _preflight(self, stream: ParamStream, replica: _Replica) -> dict[str, str]:
        models = replica.client.check_access()
        if isinstance(stream, AdapterStream):
            validate_adapter(stream, replica.client.max_lora_rank(), f"the server at {replica.url}")
            if self.checkpoint is not False:
                adapter_preflight(stream.metadata(), self._checkpoint(replica, models), ADAPTER_PREFIX)
            return {}
        if self.merge == "engine":
            self._base.plan(stream)  # what the engine cannot merge exactly is refused here, before any byte
        if self.checkpoint is False:
            return stream.tied_aliases()  # offered; the worker loads each only if its model holds it
        return preflight(stream.metadata(), stream.tied_aliases(), self._checkpoint(replica, models))

    def _read_status(self, replica: _Replica) -> None:
        """The server's lease status, read before this sync writes anything: what it holds (for a partial sync),
        and whether it restarted, whose workers then lost this rank's transfer group (built again below)."""
        try:
            replica.status = replica.client.lease_status()
        except ServerError:
            replica.status = None
        status = replica.status or {}
        boot = status.get("boot")
        if replica.engine is not None and boot and replica.engine_boot and boot != replica.engine_boot:
            self._close(replica)
        elif (
            replica.engine is not None
            and replica.written_by is not None
            and status.get("weights_by") != replica.written_by
        ):
            # Another trainer wrote through this server since, and may have built its workers' group anew (there
            # is one per server): build this rank's again rather than find it closed mid-transfer.
            self._close(replica)
        if replica.engine is None:
            replica.engine_boot = boot

    def _check_lease(self, replica: _Replica) -> None:
        """Once per server, at its first sync: warn if it keeps no weight-update lease. Best effort: a server that
        cannot say is asked again at the next sync; the sync itself goes on."""
        if replica.lease_checked:
            return
        try:
            status = replica.client.lease_status()
        except ServerError:
            return
        replica.lease_checked = True
        if status is None or status.get("disabled"):
            why = "it runs without it" if status is None else str(status["disabled"])
            warnings.warn(
                f"lora_stream: the vLLM server at {replica.url} keeps no weight-update lease ({why}): if this "
                "trainer vanishes mid-sync, that server stays paused or in its update until someone resumes it "
                "(install lora_stream in the server's environment; see docs/guarantees.md)",
                RuntimeWarning,
                stacklevel=5,
            )

    def _checkpoint(self, replica: _Replica, models: dict[str, Any]) -> EngineCheckpoint:
        if replica.ckpt is None:
            path = self.checkpoint
            if path is None or path is True:
                data = models.get("data") or [{}]
                path = data[0].get("root")
            try:
                replica.ckpt = EngineCheckpoint.read(str(path))
            except (FileNotFoundError, OSError) as exc:
                raise ServerError(
                    f"cannot read the checkpoint {path!r} served at {replica.url} for the pre-flight check ({exc}); "
                    "pass checkpoint= (a copy of the model directory), or checkpoint=False to skip the check"
                ) from exc
        return replica.ckpt

    def _ensure_engine(self, replica: _Replica) -> None:
        if replica.engine is not None:
            return
        from ..transfer.sender import TrainerTransferEngine, TrainerTransferInitInfo

        # The feeding rank hosts the rendezvous (on a socket it binds and hands to the store: no close-and-reuse
        # race) and is rank 0 of the server's group; the server's workers follow.
        info = TrainerTransferInitInfo(
            master_address=self.master_address,
            world_size=1 + replica.client.world_size(),
            buffer_bytes=self.buffer_bytes,
            timeout_s=self.timeout,
            transport=self.backend,
            rank=0,
        )
        engine = TrainerTransferEngine.trainer_init(info, client=replica.client, source=self._source)
        engine.deferred = True  # the sink concludes vLLM's update session after the ranks voted
        engine.keep_previous = self.rollback
        replica.engine = engine


@dataclasses.dataclass(frozen=True)
class _SyncPlan:
    """What a sync's prepare phase agreed on every rank: the tied aliases to offer, the verification's probe (``None``:
    not verified), and an adapter sync's staging (``{"path", "config"}``; ``None``: a merged sync)."""

    aliases: dict[str, str]
    ids: list[int] | None
    adapter: dict[str, Any] | None
    #: This rank's fingerprints (``None``: every output is sent, no agreement on changes runs).
    fingerprints: list[int | None] | None = None
    #: The agreed outcome of what changed (set after the pre-flight).
    changes: Changes | None = None
    fingerprint_s: float = 0.0
    #: merge="engine": the stream's recipes, and this rank's fingerprints of the adapted steps' bases.
    merge_plan: Any = None
    base_fps: dict[str, int] | None = None


class _ServerUpdate:
    """Where one sync's update stands on one server (its feeding rank's view)."""

    def __init__(self) -> None:
        self.paused = False
        self.session = False  # vLLM's update session is open and undecided
        self.adapter_loaded = False
        self.adapter_path: str | None = None
        self.loaded = False  # every chunk reached the workers, which loaded and checked it
        self.committed = False
        self.version: str | None = None
        #: Why this sync no longer holds the server (its heartbeat's answer), or ``None``.
        self.lease_lost: str | None = None


class _LeaseKeeper:
    """Renews the sync's lease on the servers this rank feeds, every ``lease / 6`` seconds, from the pause to the
    resume: the lease then expires only when this process stops (died, stopped, cut off), never while it waits for
    the other ranks."""

    def __init__(self, mine: list[_Replica], lease: float) -> None:
        self.mine = mine
        self.period = lease / 6
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None and self.mine:
            self._thread = threading.Thread(target=self._run, name="lora_stream-lease", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            for r in self.mine:
                if r.client.unresponsive or r.failure is not None:
                    continue  # left to its lease, or excluded: it must heal, not be held
                try:
                    yours = r.client.heartbeat(timeout=self.period)
                except Exception:  # the sync's own calls find out what is wrong with the server
                    continue
                # The server healed: this sync's update there is gone. Read before the vote to commit.
                r.state.lease_lost = r.state.lease_lost or _lease_lost(yours)

    def stop(self) -> None:
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout=self.period + 1)


def _lease_lost(yours: dict[str, Any] | None) -> str | None:
    """Why the server's answer about this sync (``yours`` in ``GET /lora_stream/lease``) says the sync lost it, or
    ``None``: a heal rolled its update back (one that rolled a committed update forward is not a loss)."""
    if yours and yours.get("expired") and not yours.get("forwarded"):
        return "its lease expired and the server rolled the update back"
    return None


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


def _world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _load_error(exc: BaseException) -> BaseException:
    """The server's worker found that vLLM did not reload every module: raise the colocated sink's error for it."""
    text = str(exc)
    if isinstance(exc, LoraStreamError) and LOAD_ERROR_TAG in text and not isinstance(exc, VLLMLoadError):
        error = VLLMLoadError(text[text.index(LOAD_ERROR_TAG) :])
        error.__cause__ = exc
        return error
    return exc
