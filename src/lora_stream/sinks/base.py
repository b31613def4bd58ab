"""The sink contract: what a sink receives from the trainer, what it returns, and what it guarantees on failure."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from ..stream import ParamStream
from .record import SyncRecord

__all__ = ["Sink"]


@runtime_checkable
class Sink(Protocol):
    """Consumes one full pass of a :class:`~lora_stream.ParamStream` per sync: a vLLM engine, a server, a checkpoint.

    :class:`~lora_stream.VLLMColocatedSink` and :class:`~lora_stream.VLLMServerSink` implement it; a new sink
    implements it the same way, usually on top of :class:`~lora_stream.sinks.source.SyncSource` (what to send, with
    the record of what went out), :func:`~lora_stream.sinks.preflight.preflight` and, for vLLM,
    :class:`~lora_stream.engine.reload.ReloadBracket`.
    """

    #: Short name used in records and logs ("vllm-colocated", "vllm-server/gloo").
    name: str

    def sync(self, stream: ParamStream, *, version: str | None = None) -> SyncRecord:
        """Send one full pass of ``stream``; return what was sent.

        Called by **every** rank that iterates ``stream``, with its own stream of the same model and options: the
        stream's gathers are collectives, so a rank that skips the call leaves the others waiting (until the
        stream's ``timeout``).

        Contract, relied on by training loops; every lora_stream sink keeps it by running the sync as one
        :class:`~lora_stream.transaction.Transaction` (prepare, transfer, vote, commit or abort):

        * **Same outcome on every rank.** Either every rank returns a :class:`SyncRecord` (``version`` recorded,
          and given to the engine where it keeps one), or every rank raises -- the rank that found the problem its
          own error, the others :class:`~lora_stream.StreamAbortedError` naming that rank and its reason. A sink
          that returned on one rank and raised on another would leave the training loop's next collective hanging.
        * **Nothing before the pre-flight.** Nothing reaches an engine before every rank's pre-flight passed
          (names, shapes, tied weights, the engine's limits); a refusal leaves every engine untouched.
        * **All or nothing.** After a failure at any later point (any rank, any group, the reload check, the
          verification, the prefix-cache reset, the commit vote), every engine serves exactly, bit for bit, what it
          served before, and keeps serving; its version does not move. (Where a sink is built with
          ``rollback=False``, or its transport cannot undo -- see ``docs/guarantees.md`` -- the error says so.)
        * **Versions move only at commit**, on every engine or on none.
        * The trainer's model is never written to.
        """
        ...

    def close(self) -> None:
        """Release what the sink holds between syncs (transfer groups, connections). Idempotent; the next ``sync``
        sets up again."""
        ...
