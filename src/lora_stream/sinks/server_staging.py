"""Step 2 of an element sync into servers it pauses (:meth:`ServerRoute.transfer
<lora_stream.sinks.server_route.ServerRoute.transfer>`): the payload reaches each server's workers while the server
keeps generating, and the pause waits only for the write. The workers receive it on a thread of their own, decode and
check it there, and say in the trainer's store when they are done; the trainer waits there, not in a call (a call
would hold vLLM's engine loop, and generation with it). Every rank then agrees that every server holds its payload,
and only then pauses the servers and loads it, every server at once.

Who calls it: :class:`~lora_stream.sinks.server_route.ServerRoute` (of which :class:`StagedTransfer` is a part). What
breaks if it is bypassed: generation waits for the whole transfer, or (a server loading what another sync staged, or
a session left open on a wait that ran out) a server holds what no sync decides.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..errors import TransferError
from ..lockstep import describe_error
from .decision import Decision
from .server_checks import ServerSinkView
from .server_client import LeaseExpiredError, ServerError
from .server_replica import Replica, load_error

__all__ = ["StagedTransfer"]


class StagedTransfer:
    """The staged steps of :class:`~lora_stream.sinks.server_route.ServerRoute` (a part of it: it reads the route's
    sink and its live servers)."""

    sink: ServerSinkView

    if TYPE_CHECKING:

        def _live(self) -> list[Replica]: ...

        def _on(self, replica: Replica, step: Any) -> None: ...

    def _stages(self, decision: Decision) -> bool:
        """Whether this sync's servers receive its payload before they are paused: a sync that carries changed
        elements (a payload of the changed values, not of the model) into servers it pauses. The same on every rank
        (the decision and the sink's options are)."""
        changes = decision.changes
        staged = changes is not None and bool(changes.elements) and self.sink.pause is not None
        # Over gloo only: the workers receive on a thread beside the model's forward passes, and NCCL collectives
        # issued from a second thread beside the model's own may deadlock. Over NCCL the pause covers the transfer.
        return staged and self.sink.backend == "gloo"

    def _staged(self, replica: Replica, step: str) -> None:
        """One server's step of a staged update (``await_staged``, within this server's budget, or
        ``load_staged``), noted as the update's answer for :meth:`_settle_transfer`: an error the server answered
        ended vLLM's session in its workers (which roll back what they loaded); one it never answered (the wait ran
        out, the call was never made) leaves the session open, for the abort to end."""
        engine = replica.engine
        answer: concurrent.futures.Future[Any] = concurrent.futures.Future()
        engine.pending = answer
        client = replica.client
        try:
            if step == "await_staged":
                began = time.monotonic()
                try:
                    engine.await_staged(client.remaining())
                finally:
                    client.spend(time.monotonic() - began)
            else:
                replica.state.written = True  # from here on, the workers may write: a rollback resets the cache
                engine.load_staged()
        except BaseException as exc:
            # Its lease healed it (nothing of this sync is held there), or its workers raised: vLLM ended the session.
            ended = isinstance(exc, LeaseExpiredError) or (isinstance(exc, ServerError) and exc.answered)
            if ended:
                answer.set_exception(exc)
            else:
                answer.set_result(None)
            if not isinstance(exc, Exception) or isinstance(exc, LeaseExpiredError):
                raise
            error = load_error(TransferError(f"the server failed the staged update ({step}): {exc}"))
            raise error from exc
        answer.set_result(None)

    def _on_each(self, step: Callable[[Replica], None]) -> None:
        """``step`` on every live server this rank feeds at once, each through :meth:`_on` (each call is bounded by
        its server's budget); once all ended, the first failure that excluded no server is raised. One at a time,
        the first server would stay paused through every other's write."""
        live = self._live()
        if len(live) < 2:
            for r in live:
                self._on(r, lambda r=r: step(r))
            return
        with concurrent.futures.ThreadPoolExecutor(len(live), thread_name_prefix="lora_stream-server") as pool:
            futures = [pool.submit(self._on, r, lambda r=r: step(r)) for r in live]
        failures = [e for e in (f.exception() for f in futures) if e is not None]
        for other in failures[1:]:
            failures[0].add_note(f"lora_stream: another server failed too: {describe_error(other)}")
        if failures:
            raise failures[0]
