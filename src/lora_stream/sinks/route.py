"""What a route into engines must provide to the sync's shared steps: the calls that differ between a vLLM server
(HTTP and a data plane), an engine in this process, and an engine in a child process (``collective_rpc``).

A sync reads as four steps, each one module, run in this order by every trainer rank inside one
:class:`~lora_stream.transaction.Transaction`:

1. **decide** (:mod:`lora_stream.sinks.decide`): what to send -- every output, only those that changed, or the
   engine-side merge's inputs -- and why; agreed by every rank before any byte reaches an engine.
2. **transfer**: the route's own (:meth:`Route.transfer`): the bytes reach the engines, which load them into a
   bracket that can still be undone.
3. **check and vote** (:mod:`lora_stream.sinks.vote`): the load check, the optional verification, the engines'
   agreement, the prefix-cache reset; then every rank votes.
4. **commit or roll back** (:mod:`lora_stream.sinks.conclude`): every engine keeps the update, or every engine is put
   back to what it served; what the sink knows of its engines (:class:`~lora_stream.sinks.memory.SinkMemory`) and
   the record follow.

The steps are shared; a route supplies the engine calls below. Every method runs on every trainer rank, in the same
order on every rank: a route whose rank feeds no engine does nothing in it, but must still return (the steps around
it hold the agreements, which are collectives).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from ..changes import EngineState
    from ..stream import ParamStream
    from ..transaction import Transaction
    from .decision import Decision
    from .verify import Verification

__all__ = ["Checks", "Route"]


class Checks(Protocol):
    """Step 3's engine calls (:func:`~lora_stream.sinks.vote.check_and_vote`)."""

    def verify(self) -> Verification | None:
        """Step 3, after every rank agreed that every engine loaded, only when step 1 decided to verify: probe what
        each engine this rank feeds loaded against the trainer's forward (a collective: every rank calls it).
        Raise :class:`~lora_stream.sinks.verify.VerificationError` to fail the sync."""
        ...

    def agree_on_verification(self, tx: Transaction) -> None:
        """Step 3, after :meth:`verify` (on every rank, whatever it raised): any agreement across the engines of
        every rank (a fleet's servers hold the same bytes); record a failure in ``tx``. The same exchanges on
        every rank."""
        ...

    def reset_prefix_cache(self) -> None:
        """Step 3, while nothing failed: drop every engine's cached KV blocks (computed with the old weights), reading
        the engine's answer. Raise to fail the sync."""
        ...

    def before_vote(self) -> None:
        """Step 3, last before this rank votes to commit: whatever must still hold (a server still held by this
        sync's lease). Raise to fail the sync."""
        ...


class Route(Checks, Protocol):
    """The engine calls of one sink, as the shared steps make them."""

    def preflight(self, stream: ParamStream, verifying: bool) -> dict[str, str]:
        """Step 1, inside the transaction's pre-flight: check ``stream`` against every engine this rank feeds
        (reachable, credentials, names, shapes and dtypes against the served checkpoint, what the engine cannot
        merge) and get ready to transfer; return the tied aliases to send (``{alias: primary}``).

        Raising refuses the sync on every rank before any byte reached an engine. Nothing may be written to an
        engine here: a refusal after a write would leave it changed."""
        ...

    def engine_states(self) -> list[EngineState]:
        """Step 1, inside the pre-flight, only for a sync that may be partial: what each engine this rank feeds
        holds, proven (a server's lease, a colocated engine's token and state digest), never assumed. An engine that
        cannot prove it holds this sink's last commit must say why: every output is then sent."""
        ...

    def transfer(self, tx: Transaction, decision: Decision) -> None:
        """Step 2: send ``decision.source`` to every engine this rank feeds, which loads it into an update that can
        still be undone (nothing is served from it before step 4). A failure is recorded in ``tx`` (its
        ``attempt()``), never raised past it, so that this rank still votes; the pass's own exchanges tell the other
        ranks."""
        ...

    def commit(self, tx: Transaction, decision: Decision) -> None:
        """Step 4, after every rank voted to commit: make the update permanent on every engine this rank feeds.
        A route whose commit can fail (a request to a server) runs it in ``tx.attempt()`` and lets every rank learn
        the outcome with one more vote; once every rank voted to commit, no rank rolls back what it committed."""
        ...

    def abort(self, error: BaseException) -> None:
        """Step 4, after a vote saw a failure: put every engine this rank feeds back to exactly what it served before
        the sync (the update's kept copy, or a recompute), and drop KV blocks computed with the new weights. Add
        what could not be put back to ``error`` as notes; raising adds its own note."""
        ...

    def forget(self, why: str) -> None:
        """After any failed sync: trust nothing the engines were known to hold (the next sync sends everything)."""
        ...

    def stages(self) -> dict[str, Any]:
        """After a committed sync: the route's timings and counts for the record (its ``stages``)."""
        ...
