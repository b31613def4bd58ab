"""After the decision, only forward (:meth:`ServerRoute.commit <lora_stream.sinks.server_route.ServerRoute.commit>`):
once every server recorded the trainer ranks' decision to commit, each server's update is finished forward -- its
workers commit, vLLM's session ends under the version, ``/weight_info`` names it -- and nothing rolls it back. An error
answer, a timeout and a lost connection are retried within the sync's timeout; a server still unfinished is left to
its lease, which rolls the recorded decision forward (:mod:`lora_stream.engine.lease`).

Who calls it: :class:`~lora_stream.sinks.server_route.ServerRoute` (of which :class:`ForwardOnly` is a part), in step
4 after the vote. What breaks if it is bypassed: an error answer after the decision would split a fleet between two
versions, or leave new weights under the old label.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from ..engine.lease_terms import committed_version, no_session
from ..lockstep import describe_error
from .server_checks import ServerSinkView, _keeps_lease
from .server_client import LeaseExpiredError, ServerError
from .server_replica import (
    Replica,
)

__all__ = ["ForwardOnly"]

logger = logging.getLogger("lora_stream")


class ForwardOnly:
    """The forward-only steps of :class:`~lora_stream.sinks.server_route.ServerRoute` after the decision (a part of
    it: it reads the route's sink and keeps its :attr:`forward_notes`)."""

    sink: ServerSinkView
    forward_notes: list[str]

    def _record_decision(self, replica: Replica, version: str | None) -> None:
        if not _keeps_lease(replica.status):
            return  # a server without lora_stream's lease (warned at its first sync): nothing to record at
        try:
            replica.client.record_decision(version)
        except LeaseExpiredError as exc:
            replica.state.lease_lost = str(exc)
            raise LeaseExpiredError(f"vLLM server at {replica.url}: after the vote to commit, {exc}") from exc

    def _forward(self, replica: Replica, version: str | None, adapter: dict[str, Any] | None) -> None:
        """Finish ``replica``'s decided update forward: its workers commit, vLLM's session ends under ``version``, and
        ``/weight_info`` names it. Every server recorded the decision, so nothing here rolls back: an error answer
        (with or without the work done), a timeout and a lost connection are all retried within the sync's timeout
        (each step is safe to repeat: a second commit is a no-op, a finish that finds no session is done, the label
        is read before it is set). A server still unfinished then is left to its lease, which rolls the recorded
        decision forward (:mod:`lora_stream.engine.lease`): noted (:attr:`forward_notes`), forgotten (its next sync
        is full), and under ``"exclude"`` excluded, never rolled back. Raises only for a server that lost the update
        (it restarted after recording, and serves its checkpoint): that one cannot be finished by anyone."""
        state, client = replica.state, replica.client
        state.version = version
        deadline = time.monotonic() + self.sink.timeout
        pause = 0.05
        while True:
            try:
                self._forward_once(replica)
                break
            except LeaseExpiredError as exc:
                if self._forwarded_by_lease(replica):
                    state.committed, state.session = True, False
                    break
                error = LeaseExpiredError(
                    f"vLLM server at {replica.url} lost this sync's decided update ({exc}): it does not serve version "
                    f"{version!r}, and nothing can finish it forward"
                )
                if self.sink.on_replica_failure == "exclude":
                    replica.failure = error  # excluded; it serves what it names (a restarted server's checkpoint)
                    logger.warning(
                        "lora_stream: excluding the vLLM server at %s from this sync: %s", replica.url, error
                    )
                    return
                raise error from exc
            except ServerError as exc:
                if client.unresponsive or time.monotonic() + pause >= min(
                    deadline, time.monotonic() + client.remaining()
                ):
                    self._leave_forward(replica, exc)
                    return
                time.sleep(pause)  # an error answered: the server is there; try the step again
                pause = min(1.0, pause * 2)
        if adapter is not None:
            replica.serving_path = adapter["path"]
            replica.written_by = client.sync  # the base weights are untouched: the workers hold what they held
        else:
            status = replica.status or {}
            replica.holds = replica.written_by = client.sync
            replica.boot = status.get("boot")
            replica.units = replica.engine.last_units if replica.engine is not None else None

    def _forward_once(self, replica: Replica) -> None:
        """One try of each forward step not yet done on ``replica`` (raises :class:`ServerError` to be retried)."""
        state, client = replica.state, replica.client
        if not state.committed:
            try:
                client.update_weights({"command": "commit", "sync": client.sync, "version": state.version})
            except LeaseExpiredError:
                raise
            except ServerError as exc:
                named = committed_version(str(exc))
                if named is not None:
                    state.version = named["version"]  # the workers committed, and say as what: that is what they serve
                elif not no_session(exc):
                    raise
                # No session after a recorded decision: only the commit ends it (the workers committed, and vLLM
                # ended the session when a worker raised after the update stood).
                state.session = False
            state.committed = True
        if state.session:
            try:
                client.finish_weight_update(state.version)
            except ServerError as exc:
                if not no_session(exc) or isinstance(exc, LeaseExpiredError):
                    raise
            state.session = False
        if state.version is not None and client.weight_version() != state.version:
            # The session ended without the label (vLLM ends it when a worker raises, or a finish answered an error
            # after ending it): the bytes are the committed ones, so the label must say so.
            client.update_weight_version(state.version)
            if client.weight_version() != state.version:
                raise ServerError(
                    f"vLLM server at {replica.url}: its version is not {state.version!r} after setting it"
                )

    def _forwarded_by_lease(self, replica: Replica) -> bool:
        """Whether ``replica``'s lease finished this sync's decided update forward (its status says ``forwarded``)."""
        try:
            status = replica.client.lease_status()
        except ServerError:
            return False
        yours = (status or {}).get("yours") or {}
        return bool(yours.get("forwarded"))

    def _leave_forward(self, replica: Replica, error: BaseException) -> None:
        """``replica``'s forward steps did not finish within the sync's timeout: its lease finishes them (this rank
        stops renewing it when the sync ends). Never rolled back; forgotten; excluded under ``"exclude"``."""
        note = (
            f"{replica.url} recorded the decision but did not finish it within {self.sink.timeout:g} s "
            f"({describe_error(error)}); its lease ({self.sink.lease:g} s) rolls it forward to version "
            f"{replica.state.version!r} and resumes generation"
        )
        replica.state.left_forward = True
        replica.client.unresponsive = True  # not called again in this sync: no resume, no heartbeat; its lease heals
        if self.sink.on_replica_failure == "exclude":
            replica.failure = ServerError(note)  # excluded as the fleet agrees; its lease still rolls it forward
            logger.warning("lora_stream: excluding the vLLM server at %s from this sync: %s", replica.url, note)
        else:
            self.forward_notes.append(note)  # committed, with this note on every rank (agree_on_resume)
