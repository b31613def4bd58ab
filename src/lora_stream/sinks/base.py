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
    :class:`~lora_stream.sinks.reload.ReloadBracket`.
    """

    #: Short name used in records and logs ("vllm-colocated", "vllm-server/gloo").
    name: str

    def sync(self, stream: ParamStream, *, version: str | None = None) -> SyncRecord:
        """Send one full pass of ``stream``; return what was sent.

        Called by **every** rank that iterates ``stream``, with its own stream of the same model and options: the
        stream's gathers are collectives, so a rank that skips the call leaves the others waiting (until the
        stream's ``timeout``). Each rank gets the same outcome: either every rank returns a :class:`SyncRecord`
        (``version`` recorded, and given to the engine where it keeps one), or every rank raises -- the rank that
        found the problem its own error, the others :class:`~lora_stream.StreamAbortedError` naming that rank and
        its reason.

        Guarantees, relied on by training loops:

        * Nothing reaches the engine before the sink's pre-flight passed (names, shapes, tied weights); a refused
          stream leaves the engine serving what it served.
        * A failure half-way leaves the engine serving (layers that received all their weights hold the new ones,
          the others the old ones) and never in a state where its next request fails; the next successful sync
          makes it consistent.
        * The trainer's model is never written to.
        """
        ...

    def close(self) -> None:
        """Release what the sink holds between syncs (transfer groups, connections). Idempotent; the next ``sync``
        sets up again."""
        ...
