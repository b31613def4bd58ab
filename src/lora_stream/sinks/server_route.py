"""The server route of a sync (:mod:`lora_stream.sinks.route`): the servers one trainer rank feeds, for one sync of a
:class:`~lora_stream.sinks.vllm_server.VLLMServerSink`.

Per server, the feeding rank: checks it and joins its transfer group (step 1); pauses its generation, holds it under
the sync's lease (a heartbeat), sends through its data plane, and stages an adapter (step 2); probes it and resets
its prefix cache, and confirms the lease still holds (step 3); commits, or rolls it back (step 4); resumes its
generation on every path. Under ``on_replica_failure="exclude"`` a server's own failure excludes it (rolled back,
left out) instead of failing the sync; the ranks then agree on which servers were excluded.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import time
import warnings
from typing import Any

from ..changes import EngineState
from ..engine.lease_terms import NOTHING_KEPT, committed_version, new_credential, no_session
from ..errors import ReplicaError
from ..lockstep import describe_error
from ..stream import ParamStream
from ..transaction import Transaction, fault_point
from .decision import Decision
from .memory import SinkMemory
from .prefix_cache import reset_prefix_cache
from .server_checks import ServerChecks, ServerSinkView, _keeps_lease, refuse_verified_adapter
from .server_client import LeaseExpiredError, ServerError
from .server_forward import ForwardOnly
from .server_replica import (
    LeaseKeeper,
    Replica,
    ServerUpdate,
    is_replica_failure,
    lease_lost,
    load_error,
)
from .server_staging import StagedTransfer
from .server_verify import agree_on_weights, verify_replica
from .verify import Verification, model_vocab_size, probe_ids, trainer_logprobs

__all__ = ["ServerRoute"]

logger = logging.getLogger("lora_stream")


class ServerRoute(ServerChecks, ForwardOnly, StagedTransfer):
    """One sync's servers on this trainer rank (those it feeds), implementing :class:`~lora_stream.sinks.route.Route`.

    Built at the start of each sync (:meth:`start`: a new lease for each server, one excluded last time tried
    again); :meth:`end` releases them on every path. Reads the sink's options and replicas; keeps this sync's
    outcome across the fleet (:attr:`excluded`, :attr:`readmitted`, :attr:`resume_note`)."""

    def __init__(self, sink: ServerSinkView, memory: SinkMemory) -> None:
        self.sink = sink
        self.memory = memory
        self.mine = [r for r in sink._assign() if r.sender == sink.rank]
        self.keeper = LeaseKeeper(self.mine, sink.lease)
        self.decision: Decision | None = None
        #: A verified sync's probe (:meth:`preflight`); ``None``: this sync does not verify.
        self.probe_ids: list[int] | None = None
        self.digests: list[str] = []
        self.excluded: dict[str, str] = {}
        self.readmitted: tuple[str, ...] = ()
        self.resume_failures: list[str] = []
        self.resume_note: str | None = None
        #: This sync's decision timings on this rank (:meth:`commit`): ``record_s``, ``window_s``.
        self.decision_s: dict[str, float] | None = None
        #: After the decision: the servers this rank left to their lease to finish forward, and why.
        self.forward_notes: list[str] = []
        #: When this rank first asked a server to pause in this sync, and how long generation stayed paused (from
        #: that request until the last resume returned, this rank's clock; ``None``: it paused none).
        self._paused_at: float | None = None
        self.paused_s: float | None = None

    def start(self) -> None:
        """The servers this rank feeds each start this sync from scratch, under a new lease."""
        credential = new_credential()  # this sync's secret: sent to its servers only, shown nowhere
        self.decision_s = None
        self.forward_notes = []
        for r in self.mine:
            r.was_excluded, r.failure, r.state = r.failure is not None, None, ServerUpdate()
            r.client.hold(credential, self.sink.lease)
            r.client.unresponsive = False
            if r.engine is not None:  # where the previous sync's transfer stood is not this one's
                r.engine.started, r.engine.pending, r.engine.stalled = False, None, False

    def end(self) -> None:
        """On every path, last: stop the heartbeat and release each server from this sync."""
        self.keeper.stop()
        for r in self.mine:
            r.client.release()
            r.client.budget_s = None

    def _phase(self) -> None:
        """A new stretch between two agreements: every server this rank feeds gets a fresh budget of calls."""
        for r in self.mine:
            r.client.budget_s = self.sink.timeout + self.sink.prefix_cache_timeout

    # -- step 1: decide -----------------------------------------------------------------------------------------------
    def preflight(self, stream: ParamStream, verifying: bool) -> dict[str, str]:
        """This rank's servers: reachability, credentials, the pre-flight, the transfer groups. Raises (or, under
        ``"exclude"``, excludes the server) before anything is sent. A server that a vanished sink left paused or in
        an open update is healed by its lease at this sync's first request. A verified sync's probe is chosen here,
        the same on every rank: the servers' workers probe before loading, so it travels with the transfer."""
        self._phase()
        refuse_verified_adapter(stream, verifying)
        aliases: dict[str, str] = {}
        for r in self.mine:

            def check(r: Replica = r) -> None:
                aliases.update(self.check_server(stream, r))
                self._read_status(r)
                self._check_lease(r)
                self._ensure_engine(r)

            self._on(r, check)
        self.probe_ids = probe_ids(model_vocab_size(stream.model)) if verifying else None
        return aliases

    def engine_states(self) -> list[EngineState]:
        return [r.engine_state() for r in self._live()]

    # -- step 2: transfer ---------------------------------------------------------------------------------------------
    def transfer(self, tx: Transaction, decision: Decision) -> None:
        """Under a pause of generation, so that no request is computed partly with each version: from the pause on,
        the sync holds each server under its lease (kept alive by this rank's heartbeat).

        An element sync (:meth:`_stages`) pauses later: its servers receive the payload and decode and check it
        while they keep generating (vLLM's update session is open, so the lease already holds them), every rank
        agrees that they all did, and only then are they paused, to write it. A failure before that agreement never
        pauses generation, and nothing served changed before the pause."""
        self.decision = decision
        source = self._arm(decision)
        self._phase()
        self.keeper.start()
        staging = self._stages(decision)
        with tx.attempt():
            if not staging:
                for r in self._live():
                    self._on(r, lambda r=r: self._pause(r))
                    r.state.written = True  # each chunk is loaded as it arrives
            self._send(source, staging)
            if staging:
                for r in self._live():
                    r.state.session = True  # open, holding the staged payload: a failure must end it
                self._on_each(lambda r: self._staged(r, "await_staged"))
                fault_point("staged")
        if staging:
            # Every rank learns that every server holds its payload before any server pauses.
            if not tx.vote("before pausing", known=decision.source.ended_early):
                return
            self._phase()
            with tx.attempt():
                for r in self._live():
                    self._on(r, lambda r=r: self._pause(r))
                self._on_each(lambda r: self._staged(r, "load_staged"))
        with tx.attempt() as go:
            if not go:
                return
            for r in self._live():
                r.state.loaded = r.state.session = True  # the workers hold it open, waiting for the decision
            self._phase()
            adapter = source.adapter
            if adapter is not None:
                for r in self._live():
                    self._on(r, lambda r=r: self._load_adapter(r, adapter["path"]))
            fault_point("reload-check")

    def _send(self, source: Any, staging: bool) -> None:
        """One pass of ``source`` to every live server this rank feeds (every rank iterates it: its gathers are
        collectives); ``staging``: the workers receive and hold it, loading nothing."""
        try:
            from ..transfer.sender import send_to_engines

            sending = self._live()
            for r in sending:
                r.engine.stage = staging
            # send_to_engines names a failed engine by its position in the list it was given.
            on_failure = (
                (lambda i, e: self._drop_in_transfer(sending[i].index, e))
                if self.sink.on_replica_failure == "exclude"
                else None
            )
            engines = [r.engine for r in sending]
            try:
                send_to_engines(engines, source, on_failure=on_failure)
            finally:
                # This pass only: the engine's other callers send what they load. (A server excluded mid-pass has
                # left its replica, which no longer holds the engine.)
                for engine in engines:
                    engine.stage = False
        except BaseException as exc:
            # Every worker that received data must hear the outcome: one still waiting for chunks fails when
            # its data plane closes (and rolls back itself, ending vLLM's session); one that loaded everything
            # waits for the decision, and the abort sends it.
            for r in self.mine:
                if r.failure is None:
                    self._settle_transfer(r)
            error = load_error(exc)
            if error is exc:
                raise
            raise error from exc
        finally:
            self.sink._source.current = None

    def _arm(self, decision: Decision) -> Any:
        """Tell each live server's engine what this sync asks of its workers; returns what is sent."""
        # The probe before loading serves the "it changed" check only, which needs the previous sync verified.
        ids = self.probe_ids
        before = ids if ids is not None and self.memory.history.wants_before(self.memory.syncs) else None
        # A partial update, or one carrying elements: the workers must hold exactly this sink's last commit.
        partial = decision.changes is not None and decision.source.selection is not None
        for r in self._live():
            r.engine.keep_previous = self.sink.rollback  # read per sync: the option may change between syncs
            r.engine.adapter_keep = r.serving_path
            r.engine.probe_ids = before  # the workers probe what they serve before loading
            r.engine.digest_received = ids is not None  # and digest every byte they receive
            r.engine.base_sync = r.holds if partial else None  # what its workers must hold
        self.sink._source.current = decision.source
        return decision.source

    # -- step 3: check and vote ---------------------------------------------------------------------------------------
    def verify(self) -> Verification | None:
        """The trainer's probe (its forward: a collective under ZeRO-3 / FSDP, so every rank runs it), then each
        server this rank feeds checked against it. Returns this rank's worst server verification (``None`` when it
        feeds none); the weight digest of each server that passed is compared across the fleet next."""
        self._phase()
        assert self.decision is not None and self.probe_ids is not None
        ids = self.probe_ids
        model = self.decision.source.stream.model
        t = time.perf_counter()
        trainer, scale = trainer_logprobs(model, ids)
        trainer_s = time.perf_counter() - t
        history, index = self.memory.history, self.memory.syncs
        history.propose(index, trainer)
        trainer_dtype = next(model.parameters()).dtype
        results: list[tuple[Verification, str]] = []
        for r in self._live():

            def check(r: Replica = r) -> None:
                limit = self.sink.verify_tolerance
                args = (r, ids, trainer, scale, trainer_dtype)
                results.append(verify_replica(*args, rank=self.sink.rank, limit=limit, history=history, index=index))

            self._on(r, check)
        self.digests = [d for _, d in results]
        worst = max((v for v, _ in results), key=lambda v: v.max_abs_diff, default=None)
        if worst is not None:
            worst = dataclasses.replace(worst, stages={"trainer_s": trainer_s, **worst.stages})
        return worst

    def agree_on_verification(self, tx: Transaction) -> None:
        agree_on_weights(tx, len(self.sink.replicas), self.sink.rank, self.digests)

    def reset_prefix_cache(self) -> None:
        # Within the phase's budget: the transfer's, or the verification's (its call and this reset).
        for r in self._live():
            self._on(r, lambda r=r: self._reset_prefix_cache(r))

    def before_vote(self) -> None:
        """Every server this rank fed must still be held by this sync, by the server's positive answer. A rank
        stopped longer than the lease (a GC pause, a preemption), or a server stalled longer than it, finds here that
        the server healed and rolled the update back; a server restarted at its address holds nothing of this sync.
        Its vote then fails the sync on every rank. A lease that runs out later, while this rank waits in the vote,
        is caught by the decision's record (:meth:`commit`)."""
        for r in self._live():

            def confirm(r: Replica = r) -> None:
                lost = r.state.lease_lost
                if lost is None:
                    status = r.client.lease_status()  # with this sync's headers
                    lost = lease_lost(status.get("yours")) if status is not None and _keeps_lease(status) else None
                if lost is not None:
                    raise LeaseExpiredError(f"vLLM server at {r.url}: before the vote to commit, {lost}")

            self._on(r, confirm)

    # -- step 4: commit or roll back (and, on every path, resume generation) -----------------------------------
    def commit(self, tx: Transaction, decision: Decision) -> None:
        """Every server learns the decision before any server commits: each feeding rank records it at its servers
        (``POST /lora_stream/decide``, answered only while this sync holds the server), and a vote carries the
        outcome. A server that could not record (its lease ran out while its rank waited in the vote, or it
        restarted) fails the sync on every rank, which rolls every server back (the holder's rollback withdraws the
        recorded decision first), or, under ``"exclude"``, excludes it.

        Once every server recorded the decision, it is final, and **only forward** (:meth:`_forward`): no path sends
        a rollback, whatever a server answers. A commit or finish answered with an error, or not answered, is
        retried within the sync's timeout, its label read and set; a server still unfinished is left to its lease,
        which rolls the recorded decision forward. A second vote carries the trainer ranks' outcome; under
        ``"exclude"``, every rank then learns which servers were excluded."""
        self._phase()
        version = decision.source.weight_version
        began = time.monotonic()
        with tx.attempt():
            for r in self._live():
                self._on(r, lambda r=r: self._record_decision(r, version))
            fault_point("decision-recorded")
        recorded = time.monotonic()
        agreed = tx.vote("after recording the decision")
        # What remains of the window (docs/guarantees.md): from this rank's records to the vote that every server
        # recorded; a rank killed inside it leaves its servers decided while the others roll theirs back.
        self.decision_s = {"record_s": recorded - began, "window_s": time.monotonic() - began}
        if not agreed:
            return
        self._phase()  # the forward steps' own budget of calls per server
        for r in self._live():
            r.state.decided = True  # from here on, no path rolls it back (the abort finishes it forward too)
        with tx.attempt():
            for r in self._live():
                self._forward(r, version, decision.adapter)
        tx.vote("after committing")
        self.excluded, self.readmitted = self._agree_on_fleet(tx)
        self._phase()

    def abort(self, error: BaseException) -> None:
        """Every rank failed the sync: each feeding rank puts its servers back, and the data planes start over."""
        self._phase()
        committed = [r.url for r in self.mine if r.state.committed]
        if committed:
            error.add_note(f"lora_stream: {', '.join(committed)} had already committed this update before the failure")
        failures = []
        for r in self._live():
            try:
                self._abort_replica(r, error)
            except BaseException as exc:
                failures.append(f"{r.url}: {describe_error(exc)}")
        if failures:
            raise ServerError("; ".join(failures))

    def forget(self, why: str) -> None:
        for r in self.mine:
            r.forget("the server was excluded from the last sync" if r.failure is not None else why)

    def after(self, committed: bool) -> None:
        """After a merged sync, on every path: a server excluded or failed is forgotten (the next sync sends it
        every output)."""
        for r in self.mine:
            if r.failure is not None:
                r.forget("the server was excluded from the last sync")
            elif not committed or not r.state.committed:
                r.forget("the last sync failed (the server was rolled back)")

    def stages(self) -> dict[str, Any]:
        fed = [r for r in self.mine if r.engine is not None and r.state.committed]
        stages = dict(getattr(fed[0].engine, "last_stages", None) or {}) if fed else {}
        if len(fed) > 1:
            stages["replicas"] = {r.url: dict(r.engine.last_stages or {}) for r in fed}
        if self.decision_s is not None:
            stages["decision"] = dict(self.decision_s)
        if self.paused_s is not None:
            stages["paused_s"] = self.paused_s
        return stages

    # -- per server (on the rank that feeds it) ----------------------------------------------------------------------
    def _live(self) -> list[Replica]:
        return [r for r in self.mine if r.failure is None]

    def _on(self, replica: Replica, step: Any) -> None:
        """Run one server's ``step``: under ``"exclude"`` a failure of that server excludes it (rolled back, left
        out); otherwise, or for a failure that is not the server's, it fails the sync."""
        if replica.failure is not None:
            return
        try:
            step()
        except BaseException as exc:
            if self.sink.on_replica_failure != "exclude" or not is_replica_failure(load_error(exc)):
                raise
            self._drop(replica.index, exc)

    def _drop(self, index: int, error: BaseException) -> None:
        """Exclude server ``index`` from this sync: put it back as it was, as far as it still answers."""
        replica = self.sink.replicas[index]
        replica.failure = load_error(error)
        logger.warning("lora_stream: excluding the vLLM server at %s from this sync: %s", replica.url, error)
        try:
            self._abort_replica(replica, replica.failure)
        except BaseException as exc:  # it may be gone: what matters is that the others go on
            logger.warning("lora_stream: rolling back the excluded server at %s failed: %r", replica.url, exc)
        replica.serving_path = None  # restarted or not, it is sent the whole adapter at its readmission

    def _drop_in_transfer(self, index: int, error: BaseException) -> None:
        """A server failed during the transfer: settle where its update stands (its data plane torn down first, so
        that workers still waiting for chunks fail at once and roll back themselves), then exclude it."""
        self._settle_transfer(self.sink.replicas[index])
        self._drop(index, error)

    def _settle_transfer(self, replica: Replica) -> None:
        """After a transfer that did not complete for ``replica``: close its data plane, then learn whether its
        workers still hold the update open (they loaded every chunk and wait for the decision: the abort must send
        it) or ended it (an update that fails rolls back in the workers, and vLLM ends the session)."""
        engine = replica.engine
        started = bool(getattr(engine, "started", False))
        pending = getattr(engine, "pending", None)
        stalled = bool(getattr(engine, "stalled", False))
        replica.close()
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

    def _pause(self, replica: Replica) -> None:
        if self.sink.pause is not None:
            if self._paused_at is None:
                self._paused_at = time.perf_counter()
            replica.state.paused = True  # sent: a pause that timed out may still land, and must be resumed
            replica.client.pause(self.sink.pause)

    def _reset_prefix_cache(self, replica: Replica) -> None:
        reset_prefix_cache(replica.client.reset_prefix_cache, self.sink.prefix_cache_timeout, replica.url)

    def _load_adapter(self, replica: Replica, path: str) -> None:
        replica.state.adapter_loaded = True
        replica.state.adapter_path = path
        replica.client.load_lora_adapter(self.sink.lora_name, path, restore=replica.serving_path)

    def _abort_replica(self, replica: Replica, error: BaseException) -> None:
        """Put ``replica`` back as it was before this sync, whatever its workers' state: an update still open
        (mid-transfer or loaded and waiting) is rolled back and vLLM's session ended, a staged adapter swapped back,
        the prefix cache reset. A server that stopped answering is left to its lease, which does the same."""
        state = replica.state
        client = replica.client
        client.budget_s = (
            self.sink.timeout + self.sink.prefix_cache_timeout
        )  # the abort's own budget, whatever came before
        try:
            if state.decided:
                # Every server recorded the decision: never rolled back, whatever failed since; finished forward.
                if not client.unresponsive and (state.session or not state.committed):
                    try:
                        self._forward(replica, state.version, None)
                    except LeaseExpiredError as exc:
                        error.add_note(f"lora_stream: {describe_error(exc)}")
                return
            if replica.engine is not None and not state.loaded:
                self._settle_transfer(replica)  # the pass failed before this server's transfer ended
            if client.unresponsive:
                error.add_note(
                    f"lora_stream: {replica.url} stopped answering; its lease ({self.sink.lease:g} s) rolls the update "
                    "back, ends vLLM's update session and resumes generation by itself"
                )
                return
            try:
                if state.adapter_loaded:
                    if replica.serving_path is not None:
                        client.load_lora_adapter(self.sink.lora_name, replica.serving_path)
                    else:
                        client.unload_lora_adapter(self.sink.lora_name)
                if state.session:
                    try:
                        client.update_weights({"command": "rollback"})
                    except ServerError as exc:
                        named = committed_version(str(exc))
                        if named is not None:
                            # The workers committed (as the refusal names): never relabelled as the old version.
                            state.committed, state.version = True, named["version"]
                            self._forward(replica, state.version, None)
                            error.add_note(f"lora_stream: {replica.url} had committed as version {state.version!r}")
                            return
                        if NOTHING_KEPT not in str(exc):
                            raise
                        # The worker restored nothing it had kept: never reported as rolled back. The session
                        # still ends (vLLM may have ended it already) and the prefix cache is reset below.
                        error.add_note(
                            f"lora_stream: {replica.url} was NOT rolled back: its workers found nothing to restore; "
                            "layers that received their weights serve the new ones under the old version (the next "
                            "sync sends every output)"
                        )
                    try:
                        client.finish_weight_update(None)
                    except ServerError as exc:
                        if not no_session(exc):
                            raise
                    state.session = False
                if not self.sink.rollback and not state.adapter_loaded:
                    error.add_note(
                        f"lora_stream: rollback=False: layers of {replica.url} that received their weights serve the "
                        "new ones"
                    )
                if state.written:  # a staged update never loaded changed nothing its cache was computed with
                    self._reset_prefix_cache(replica)
            except LeaseExpiredError:
                state.session = state.paused = False  # its lease already rolled it back and resumed it
        finally:
            replica.close()  # the data plane may be half-used: start over with a new group next time

    def resume(self, error: BaseException | None) -> None:
        """Resume generation on every server this rank paused, on every path; what failed is kept
        (:attr:`resume_failures`) and added to ``error`` as notes. A server that stopped answering, or whose lease
        already resumed it, is skipped."""
        failures: list[str] = list(self.forward_notes)
        for r in self.mine:
            if not r.state.paused:
                continue
            if r.client.unresponsive:
                if error is None and r.failure is None and not r.state.left_forward:
                    failures.append(f"{r.url} stopped answering before generation could be resumed")
                continue
            try:
                r.client.budget_s = self.sink.timeout  # its own budget, whatever came before
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
        self.resume_failures = failures
        if self._paused_at is not None:
            self.paused_s = time.perf_counter() - self._paused_at

    def _agree_on_fleet(self, tx: Transaction) -> tuple[dict[str, str], tuple[str, ...]]:
        """Under ``"exclude"``: every rank learns which servers were excluded (and readmitted) on any rank; if none
        is left, the sync fails on every rank. One exchange of two bits per server (never more than it carries),
        after the votes, on every rank alike; the reasons stay with the rank that feeds the server."""
        if self.sink.on_replica_failure != "exclude" or not tx.ok:
            return {}, ()
        n = len(self.sink.replicas)
        bits = [self.sink.replicas[i].failure is not None for i in range(n)]
        bits += [self.sink.replicas[i].was_excluded and self.sink.replicas[i].failure is None for i in range(n)]
        mine_ids = {r.index for r in self.mine}
        for i in range(n):
            if i not in mine_ids:
                bits[i] = bits[n + i] = False
        agreed = tx.any_of(bits, "agreeing on the fleet")
        if agreed is None:
            return {}, ()
        excluded: dict[str, str] = {}
        for r in self.sink.replicas:
            if not agreed[r.index]:
                continue
            if r.index in mine_ids and r.failure is not None:
                excluded[r.url] = describe_error(r.failure)
            else:
                excluded[r.url] = f"excluded by trainer rank {r.sender}, which feeds it (its reason is in that log)"
        readmitted = tuple(r.url for r in self.sink.replicas if agreed[n + r.index])
        if len(excluded) == n:
            tx.error = ReplicaError(
                "every vLLM server failed the sync: " + "; ".join(f"{u}: {why}" for u, why in excluded.items()),
                failures=excluded,
            )
            return {}, ()
        return excluded, readmitted

    def agree_on_resume(self, tx: Transaction, version: str | None) -> None:
        """Committed: every rank learns whether resuming failed on any server (its lease resumes it by itself), so
        that every rank records it alike (:attr:`resume_note`)."""
        failed_resume = tx.any_of([bool(self.resume_failures)], "after resuming generation")
        if failed_resume is not None and not failed_resume[0]:
            return
        resume_note = (
            "; ".join(self.resume_failures)
            if self.resume_failures
            else "resuming generation failed on a server another trainer rank feeds (or that rank was lost)"
        ) + f"; the server's lease resumes it within {self.sink.lease:g} s"
        warnings.warn(f"lora_stream: sync {version!r} committed, but {resume_note}", RuntimeWarning, stacklevel=3)
        tx.error = None  # committed everywhere: what failed after is recorded, not raised
        self.resume_note = resume_note
