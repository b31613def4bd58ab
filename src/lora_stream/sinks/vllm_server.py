"""Push a stream into a running vLLM OpenAI server through vLLM's own weight-transfer protocol.

The server must run with ``VLLM_SERVER_DEV_MODE=1`` and ``--weight-transfer-config '{"backend": "gloo"}'`` (CPU; the
backend ships with lora_stream as a vLLM plugin) or ``'{"backend": "nccl"}'`` (GPUs). The sink builds vLLM's
trainer-side engine for that backend through ``WeightTransferTrainerFactory`` with the :class:`~lora_stream.ParamStream`
as its ``WeightSource``, and per sync runs vLLM's bracket: start, update (one metadata message, then the data plane),
finish with a weight version.

Every trainer rank calls :meth:`VLLMServerSink.sync` (the stream's gathers are collectives); rank 0 talks to the
server and sends. Failures end the sync on every rank with an error, never a hang: each HTTP call and each
broadcast has a timeout, the ranks agree on the outcome before and after the transfer, and a server-side error
stops the sender between chunks.

Security: vLLM's ``--api-key`` protects ``/v1/...`` only. The dev-mode routes (``/init_weight_transfer_engine``,
``/update_weights``, ``/collective_rpc``, ...) answer anyone who reaches the port, and the gloo data plane listens on
the trainer's address. Keep both on a private network or loopback; see ``docs/vllm_server.md``.
"""

from __future__ import annotations

import dataclasses
import socket
import time
import uuid
from typing import Any

from ..adapter import ADAPTER_PREFIX, AdapterStream
from ..coordination import this_rank
from ..errors import LoraStreamError
from ..stream import ParamStream
from ..transaction import Transaction, fault_point
from .adapter_loader import AdapterLoadError, adapter_path
from .preflight import EngineCheckpoint, adapter_preflight, preflight
from .record import AdapterSyncRecord, SyncRecord
from .reload import LOAD_ERROR_TAG, VLLMLoadError
from .source import SyncSource
from .vllm_colocated import reset_prefix_cache

__all__ = ["PAUSE_MODES", "ServerError", "VLLMServerClient", "VLLMServerSink", "validate_adapter"]


#: Packing buffer size per backend when the sink is not told one (see ``VLLMServerSink``'s ``buffer_bytes``).
DEFAULT_BUFFER_BYTES = {"gloo": 1024 * 1024, "nccl": 256 * 1024 * 1024}


#: ``pause=`` values: vLLM's ``/pause`` modes that keep every response on one version (``wait``: running requests
#: finish on the old weights first; ``abort``: they are aborted), or ``None`` (no pause: only for a server that
#: generates nothing during syncs).
PAUSE_MODES = ("wait", "abort", None)


class ServerError(LoraStreamError):
    """The vLLM server is unreachable, refused the request (status and body included), or needs an API key."""


class VLLMServerClient:
    """vLLM's weight-sync routes over HTTP, with the API key and timeouts (vLLM's ``VLLMWeightSyncClient`` protocol).

    vLLM's own ``HTTPVLLMWeightSyncClient`` sends no credentials; this one sends ``Authorization: Bearer <key>`` on
    every request and turns transport failures into :class:`ServerError`.
    """

    def __init__(self, base_url: str, *, api_key: str | None = None, timeout: float = 120.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def _request(self, method: str, path: str, json: dict[str, Any] | None = None, timeout: float | None = None) -> Any:
        import requests

        url = f"{self.base_url}/{path}"
        try:
            response = requests.request(method, url, json=json, headers=self.headers, timeout=timeout or self.timeout)
        except requests.RequestException as exc:
            raise ServerError(f"vLLM server at {self.base_url} unreachable on {method} /{path}: {exc}") from exc
        if response.status_code == 401:
            raise ServerError(f"vLLM server at {self.base_url} requires an API key (401 on /{path}); pass api_key=")
        if response.status_code >= 400:
            raise ServerError(f"vLLM server answered {response.status_code} on {method} /{path}: {response.text[:500]}")
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
        self._request("POST", "update_weights", {"update_info": update_info})

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

    def max_lora_rank(self) -> int | None:
        """The server's ``--max-lora-rank``, or ``None`` when it runs without ``--enable-lora`` (dev-mode
        ``/server_info``)."""
        info = self._request("GET", "server_info?config_format=json")
        config = (info or {}).get("vllm_config") or {}
        lora = config.get("lora_config") if isinstance(config, dict) else None
        return int(lora["max_lora_rank"]) if isinstance(lora, dict) and "max_lora_rank" in lora else None

    def unload_lora_adapter(self, name: str) -> None:
        self._request("POST", "v1/unload_lora_adapter", {"lora_name": name})

    def load_lora_adapter(self, name: str, path: str) -> None:
        """``POST /v1/load_lora_adapter`` in place: vLLM builds the adapter staged under ``path``, checks it, and
        only then replaces the version it serves under ``name`` (same adapter id). Needs the server's
        ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``."""
        try:
            self._request("POST", "v1/load_lora_adapter", {"lora_name": name, "lora_path": path, "load_inplace": True})
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


def _free_port(address: str) -> int:
    """A port that was free on ``address`` a moment ago, for vLLM's ``nccl`` backend only: its trainer engine takes a
    port number and binds it itself, so another process may take the port in between. The ``gloo`` backend has no
    such race: its engine binds the store's socket (port 0: ephemeral) and hands that very socket to the store."""
    family = socket.getaddrinfo(address, 0, type=socket.SOCK_STREAM)[0][0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((address, 0))
        return int(s.getsockname()[1])


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


class VLLMServerSink:
    """Streams :class:`~lora_stream.ParamStream` passes into a vLLM server's weights.

    >>> sink = VLLMServerSink(  # doctest: +SKIP
    ...     url, rank=rank, backend="nccl" if on_gpu else "gloo", api_key=os.environ.get("VLLM_API_KEY"), timeout=120
    ... )
    >>> record = sink.sync(ParamStream(model, group_by="layer"), version=f"step-{step}")  # every trainer rank

    Implements :class:`~lora_stream.sinks.base.Sink`: the pre-flight, the tied aliases and the record are the
    colocated sink's (:func:`~lora_stream.sinks.preflight.preflight`, :class:`~lora_stream.sinks.source.SyncSource`);
    on the server, lora_stream's ``gloo`` worker engine loads through the same
    :class:`~lora_stream.sinks.reload.ReloadBracket` and its reload check.

    Args:
        base_url: the server's address.
        rank: this trainer rank (rank 0 sends). Defaults to ``torch.distributed``'s rank, or 0.
        api_key: sent as a bearer token (the server's ``--api-key``; with lora_stream's route guard it also opens
            the weight-update routes).
        backend: ``"gloo"`` (CPU, shipped by lora_stream) or ``"nccl"`` (vLLM's, GPUs).
        master_address: the address the data plane's store listens on (rank 0's host, reachable by the server).
        buffer_bytes: packing buffer size; chunks follow the stream's groups and a larger tensor travels alone, as
            its own bytes, without a copy. Default: 1 MiB for ``gloo`` (small tensors are packed, every large one
            travels uncopied: 0.93 s per sync against 1.23 s with 256 MiB buffers on the server benchmark,
            ``docs/benchmarks.md``), 256 MiB for ``nccl`` (vLLM's packed buffer).
        timeout: seconds for every HTTP call, the group rendezvous and each chunk's broadcast.
        checkpoint: where to read the served model's safetensors headers for the pre-flight check; defaults to
            the path the server reports in ``/v1/models`` (when it exists on this machine). ``False`` skips it.
        lora_name: the name an :class:`~lora_stream.AdapterStream` sync serves its adapter under (what
            ``/v1/completions`` takes as ``model``); the server needs ``--enable-lora`` and
            ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``. Adapter sync runs over the ``gloo`` backend only.
        rollback: the server's workers keep a host copy of what an update replaces until the trainer ranks have
            voted, so that a failed sync leaves the server serving exactly what it served (default). ``False``
            saves that memory and copy; a failed sync then leaves updated layers new. The ``nccl`` backend (vLLM's
            own worker engine) cannot roll back.
        pause: how generation is paused for the update (:data:`PAUSE_MODES`; default ``"wait"``).
        prefix_cache_timeout: seconds to keep retrying the server's prefix-cache reset while it answers
            ``success: false``; past it the sync fails and is rolled back.
    """

    def __init__(
        self,
        base_url: str,
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
    ) -> None:
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
        self.rollback = rollback
        self.pause = pause
        self.prefix_cache_timeout = prefix_cache_timeout
        self.rank = this_rank() if rank is None else rank
        self.client = VLLMServerClient(base_url, api_key=api_key, timeout=timeout)
        self.backend = backend
        self.name = f"vllm-server/{backend}"
        self.master_address = master_address
        self.buffer_bytes = buffer_bytes if buffer_bytes is not None else DEFAULT_BUFFER_BYTES[backend]
        self.timeout = timeout
        self.checkpoint = checkpoint
        self._engine: Any = None
        self._source = _CurrentSource()
        self._ckpt: EngineCheckpoint | None = None
        self.lora_name = lora_name
        #: Where the adapter the server serves now is staged in its worker (kept while a new version may fail).
        self._serving_path: str | None = None

    @property
    def is_sender(self) -> bool:
        return self.rank == 0

    def sync(self, stream: ParamStream, *, version: str | None = None) -> SyncRecord:
        """Send one full pass of ``stream`` as one transaction; on success the server serves it and reports
        ``version``, on every rank's return. On failure every rank raises and the server serves exactly what it
        served before (``/weight_info`` unchanged).

        Rank 0 pauses generation (``pause=``), opens vLLM's update session, sends; the server's worker loads,
        checks and keeps what it replaced; rank 0 resets the prefix cache (reading vLLM's answer). The ranks vote;
        rank 0 tells the workers to commit (the version moves) or roll back, and resumes generation. An
        :class:`~lora_stream.AdapterStream` is staged in the server's worker and swapped in by vLLM's own
        ``/v1/load_lora_adapter`` as the adapter ``lora_name`` (base weights untouched); the record is an
        :class:`~lora_stream.sinks.record.AdapterSyncRecord`; a rollback swaps the previous version back in."""
        start = time.perf_counter()
        is_adapter = isinstance(stream, AdapterStream)
        if is_adapter and self.backend != "gloo":
            raise LoraStreamError(
                "adapter sync into a vLLM server runs over lora_stream's gloo backend only; vLLM's nccl worker "
                "engine loads every tensor into the model"
            )
        tx = Transaction.for_stream(stream, self.name)
        # 1. prepare: rank 0 checks the server (reachable, key accepted, LoRA limits) and the stream against its
        #    checkpoint, and joins the transfer group; every rank learns the outcome before any rank gathers.
        aliases = tx.prepare(lambda: self._prepare(stream) if self.is_sender else {})
        self._ensure_engine()
        if self.backend == "gloo":
            self._engine.keep_previous = self.rollback  # read per sync: the option may change between syncs
        adapter: dict[str, Any] | None = None
        if isinstance(stream, AdapterStream):
            path = adapter_path(self.lora_name, uuid.uuid4().hex[:12])
            adapter = {"path": path, "config": stream.adapter_config(), "keep": self._serving_path}
        source = self._source.current = SyncSource(stream, aliases, version, adapter)
        state = _ServerUpdate()
        # 2. transfer, under a pause of generation: no request is computed partly with each version.
        with tx.attempt():
            if self.is_sender and self.pause is not None:
                self.client.pause(self.pause)
                state.paused = True
            try:
                state.session = self.is_sender
                self._engine.send_weights()
            except BaseException as exc:
                # Closing the data plane makes a worker still waiting for chunks fail at once; a worker that fails
                # its update rolls it back itself, and vLLM ends the update session.
                state.session = False
                self.close()
                error = _load_error(exc)
                if error is exc:
                    raise
                raise error from exc
            finally:
                self._source.current = None
            if adapter is not None and self.is_sender:
                self.client.load_lora_adapter(self.lora_name, adapter["path"])
                state.adapter_loaded = True
            fault_point("reload-check")
            if self.is_sender:
                reset_prefix_cache(self.client.reset_prefix_cache, self.prefix_cache_timeout, "the server")
            fault_point("prefix-cache")
            fault_point("commit")
        # 3. vote; rank 0 commits on the server; a second vote carries the outcome of that call to every rank.
        if tx.vote("before committing", known=source.ended_early):
            with tx.attempt():
                if self.is_sender:
                    self._commit(state, version, adapter)
            tx.vote("after committing")
        try:
            tx.conclude(lambda: None, lambda error: self._abort(state, error))
        finally:
            if state.paused:
                self._resume(tx.error)
        record = source.record(self.name, time.perf_counter() - start)
        stages = dict(getattr(self._engine, "last_stages", None) or {}) if self.is_sender else {}
        if stages:
            record = dataclasses.replace(record, stages=stages)
        if is_adapter:
            record = AdapterSyncRecord(**record.__dict__, lora_name=self.lora_name)
        record.log()
        return record

    # -- commit and abort (sender only) -----------------------------------------------------------------------------
    def _commit(self, state: _ServerUpdate, version: str | None, adapter: dict[str, Any] | None) -> None:
        if self.backend == "gloo":
            self._engine.conclude(True, version)
        elif version is not None:
            self.client.update_weight_version(version)  # vLLM's nccl trainer engine finishes without a version
        state.session = False
        state.committed = True
        if adapter is not None:
            self._serving_path = adapter["path"]

    def _abort(self, state: _ServerUpdate, error: BaseException) -> None:
        """Every rank failed the sync: rank 0 puts the server back, and the data plane starts over next time."""
        if not self.is_sender:
            self.close()
            return
        try:
            if state.committed:
                error.add_note("lora_stream: the server had already committed this update before the failure")
            elif state.adapter_loaded:
                if self._serving_path is not None:
                    self.client.load_lora_adapter(self.lora_name, self._serving_path)
                else:
                    self.client.unload_lora_adapter(self.lora_name)
            if state.session and self.backend == "gloo":
                self._engine.conclude(False, None)
            if self.backend != "gloo" and not state.committed:
                error.add_note(
                    "lora_stream: the nccl backend cannot roll an update back (vLLM's own worker engine keeps "
                    "nothing): layers that received their weights serve the new ones until the next sync"
                )
            elif not self.rollback and not state.committed and not state.adapter_loaded:
                error.add_note("lora_stream: rollback=False: layers that received their weights serve the new ones")
            reset_prefix_cache(self.client.reset_prefix_cache, self.prefix_cache_timeout, "the server")
        finally:
            self.close()  # the data plane may be half-used: start over with a new group next time

    def _resume(self, error: BaseException | None) -> None:
        try:
            self.client.resume()
        except BaseException as exc:
            if error is None:
                raise
            error.add_note(f"lora_stream: resuming the server's generation also failed: {exc!r}")

    def close(self) -> None:
        engine, self._engine = self._engine, None
        if engine is not None:
            engine.shutdown()

    # -- steps of sync -----------------------------------------------------------------------------------------------
    def _prepare(self, stream: ParamStream) -> dict[str, str]:
        """Sender only: reachability, credentials, the pre-flight, the transfer group. Raises before anything is
        sent."""
        aliases = self._preflight(stream)
        self._ensure_engine()
        return aliases

    def _preflight(self, stream: ParamStream) -> dict[str, str]:
        models = self.client.check_access()
        if isinstance(stream, AdapterStream):
            validate_adapter(stream, self.client.max_lora_rank(), f"the server at {self.client.base_url}")
            if self.checkpoint is not False:
                adapter_preflight(stream.metadata(), self._checkpoint(models), ADAPTER_PREFIX)
            return {}
        if self.checkpoint is False:
            return stream.tied_aliases()  # offered; the worker loads each only if its model holds it
        return preflight(stream.metadata(), stream.tied_aliases(), self._checkpoint(models))

    def _checkpoint(self, models: dict[str, Any]) -> EngineCheckpoint:
        if self._ckpt is None:
            path = self.checkpoint
            if path is None or path is True:
                data = models.get("data") or [{}]
                path = data[0].get("root")
            try:
                self._ckpt = EngineCheckpoint.read(str(path))
            except (FileNotFoundError, OSError) as exc:
                raise ServerError(
                    f"cannot read the served checkpoint {path!r} for the pre-flight check ({exc}); pass "
                    "checkpoint= (a copy of the model directory), or checkpoint=False to skip the check"
                ) from exc
        return self._ckpt

    def _ensure_engine(self) -> None:
        if self._engine is not None:
            return
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        from ..vllm_plugin import register

        register()
        # Only the sender hosts the rendezvous and asks the server its size; the other ranks just iterate.
        # gloo: port 0, the engine binds the store's socket itself (no close-and-reuse race); nccl: vLLM binds a number.
        port = _free_port(self.master_address) if self.is_sender and self.backend == "nccl" else 0
        world = 1 + self.client.world_size() if self.is_sender else 0
        if self.backend == "gloo":
            from ..transfer.gloo_trainer import GlooTrainerInitInfo

            info: Any = GlooTrainerInitInfo(
                master_address=self.master_address,
                master_port=port,
                world_size=world,
                buffer_bytes=self.buffer_bytes,
                timeout_s=self.timeout,
                rank=self.rank,
            )
        else:
            from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

            info = NCCLTrainerInitInfo(
                master_address=self.master_address,
                master_port=port,
                world_size=world,
                packed_buffer_size_bytes=self.buffer_bytes,
                rank=self.rank,
            )
        engine: Any = WeightTransferTrainerFactory.trainer_init(
            info,
            client=self.client,  # type: ignore[arg-type]
            source=self._source,  # type: ignore[arg-type]  # a WeightSource structurally
        )
        if self.backend == "gloo":
            engine.deferred = True  # the sink concludes vLLM's update session after the ranks voted
            engine.keep_previous = self.rollback
        self._engine = engine


class _ServerUpdate:
    """Where one sync's update stands on the server (sender's view)."""

    def __init__(self) -> None:
        self.paused = False
        self.session = False  # vLLM's update session is open and undecided
        self.adapter_loaded = False
        self.committed = False


def _load_error(exc: BaseException) -> BaseException:
    """The server's worker found that vLLM did not reload every module: raise the colocated sink's error for it."""
    text = str(exc)
    if isinstance(exc, LoraStreamError) and LOAD_ERROR_TAG in text:
        error = VLLMLoadError(text[text.index(LOAD_ERROR_TAG) :])
        error.__cause__ = exc
        return error
    return exc
