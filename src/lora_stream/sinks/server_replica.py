"""One server of a :class:`~lora_stream.sinks.vllm_server.VLLMServerSink`'s fleet, as its feeding trainer rank sees
it: its client, its transfer engine, what it holds since the sink's last commit (:class:`Replica`), where one
sync's update stands on it (:class:`ServerUpdate`), and the heartbeat that holds it under the sync's lease
(:class:`LeaseKeeper`).
"""

from __future__ import annotations

import threading
from typing import Any

from ..changes import EngineState
from ..engine.reload import LOAD_ERROR_TAG, VLLMLoadError
from ..errors import LoraStreamError, TransferError
from .prefix_cache import PrefixCacheError
from .preflight import EngineCheckpoint
from .server_client import ServerError, VLLMServerClient
from .source import SyncSource
from .verify import VerificationError

__all__ = [
    "REPLICA_POLICIES",
    "CurrentSource",
    "LeaseKeeper",
    "Replica",
    "ServerUpdate",
    "is_replica_failure",
    "lease_lost",
    "load_error",
]


class CurrentSource:
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

    @property
    def element_info(self) -> dict[str, Any] | None:
        """An element sync's info (``None``: the sink sends no elements)."""
        return getattr(self._source(), "element_info", None)

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


#: ``on_replica_failure=`` values (see :class:`~lora_stream.sinks.vllm_server.VLLMServerSink`).
REPLICA_POLICIES = ("abort", "exclude")


class Replica:
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
        self.state = ServerUpdate()
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

    def close(self) -> None:
        """Tear down this server's data plane (its transfer group); the next sync builds a new one."""
        engine, self.engine = self.engine, None
        if engine is not None:
            engine.shutdown()

    def forget(self, why: str) -> None:
        """The server may hold anything (``why``): its next merged sync sends every output."""
        self.holds = self.written_by = self.boot = None
        self.units = None
        self.why_full = why

    def engine_state(self) -> EngineState:
        """Whether this server still holds this sink's last merged commit (what the pre-flight read)."""
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


class ServerUpdate:
    """Where one sync's update stands on one server (its feeding rank's view)."""

    def __init__(self) -> None:
        self.paused = False
        self.session = False  # vLLM's update session is open and undecided
        self.adapter_loaded = False
        self.adapter_path: str | None = None
        self.loaded = False  # every chunk reached the workers, which loaded and checked it
        #: The workers may have written weights (a transfer loads each chunk as it arrives; a staged update once
        #: loaded): undoing it resets the prefix cache. A staged update never loaded leaves the cache valid.
        self.written = False
        self.committed = False
        #: Every server of the sync recorded the decision to commit: from then on only forward, never rolled back.
        self.decided = False
        #: Its forward steps did not finish within the sync's timeout: left to its lease, which rolls it forward.
        self.left_forward = False
        self.version: str | None = None
        #: Why this sync no longer holds the server (its heartbeat's answer), or ``None``.
        self.lease_lost: str | None = None


class LeaseKeeper:
    """Renews the sync's lease on the servers this rank feeds, every ``lease / 6`` seconds, from the pause to the
    resume: the lease then expires only when this process stops (died, stopped, cut off), never while it waits for
    the other ranks."""

    def __init__(self, mine: list[Replica], lease: float) -> None:
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
                # The server healed (or restarted): this sync's update there is gone. Read before the vote to
                # commit. Judged only while this rank knows the server holds its update (paused, or loaded and
                # waiting), and not once committed: before its pause, or after its commit, holding nothing is right.
                st = r.state
                if (st.paused or st.session or st.adapter_loaded) and not st.committed:
                    st.lease_lost = st.lease_lost or lease_lost(yours)

    def stop(self) -> None:
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout=self.period + 1)


def lease_lost(yours: dict[str, Any] | None) -> str | None:
    """Why the server's answer about this sync (``yours`` in ``GET /lora_stream/lease``) says the sync does not hold
    it, or ``None`` when it does (``holding``), or when a heal rolled its committed update forward. "Not lost" is not
    "held": a server restarted at the same address answers ``{holding: false, expired: false}``, and serves its
    checkpoint. ``None`` for no answer at all (a server without lora_stream's lease, which the sink warned about)."""
    if yours is None:
        return None
    if yours.get("forwarded") or yours.get("holding"):
        return None
    if yours.get("expired"):
        return "its lease expired and the server rolled the update back"
    return "the server holds no update of this sync (it restarted, or another sync took it)"


def load_error(exc: BaseException) -> BaseException:
    """The server's worker found that vLLM did not reload every module: raise the colocated sink's error for it."""
    text = str(exc)
    if isinstance(exc, LoraStreamError) and LOAD_ERROR_TAG in text and not isinstance(exc, VLLMLoadError):
        error = VLLMLoadError(text[text.index(LOAD_ERROR_TAG) :])
        error.__cause__ = exc
        return error
    return exc
