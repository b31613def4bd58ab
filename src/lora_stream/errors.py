"""Exceptions raised by lora_stream.

Every error derives from :class:`LoraStreamError`, so a caller can catch the library's failures in one clause.
Messages name the parameter (by its path in the trainer's model) and, in distributed runs, the rank.
"""

from __future__ import annotations

__all__ = [
    "LoraStreamError",
    "UnsupportedAdapterError",
    "UnsupportedModelError",
    "NameCollisionError",
    "RenameError",
    "StalePlanError",
    "StreamAbortedError",
    "TransferError",
    "CheckpointError",
]


class LoraStreamError(RuntimeError):
    """Base class of every error raised by lora_stream."""


class UnsupportedAdapterError(LoraStreamError):
    """A tuner module whose merge lora_stream cannot compute out of place.

    Raised while the stream is planned, before the first tensor is yielded, so nothing has been sent anywhere.
    """


class UnsupportedModelError(LoraStreamError):
    """The model cannot be streamed as it is: parameters on the meta device, a quantized base weight, ..."""


class NameCollisionError(LoraStreamError):
    """Two parameters of the trainer's model normalize to the same Hugging Face name."""


class RenameError(LoraStreamError):
    """A user-supplied rename returned something that is not a usable name."""


class StalePlanError(LoraStreamError):
    """The model changed since the stream was planned: another active adapter, adapters disabled or merged in
    place, a new scaling, a parameter replaced (:mod:`lora_stream.witness`).

    Raised at the start of a pass, and by every sink's pre-flight, before anything is gathered or sent; ``changes``
    lists what changed. Build a new stream for the model as it is now.
    """

    def __init__(self, message: str, *, changes: list[str] | None = None) -> None:
        super().__init__(message)
        self.changes = list(changes or [])


class StreamAbortedError(LoraStreamError):
    """Another rank stopped the stream (its consumer raised, broke out of the loop, or its process died).

    Raised on every rank that was still iterating, at the next group boundary, instead of waiting in a collective
    that the stopped rank will never join.
    """

    def __init__(self, message: str, *, failed_ranks: tuple[int, ...] = (), lost: bool = False) -> None:
        super().__init__(message)
        self.failed_ranks = failed_ranks
        #: A peer could not be heard from: the exchange timed out, was given up by a peer, or its transport broke
        #: (a rank stopped, died, or is too slow). The sink's later agreements in the same sync wait briefly only.
        self.lost = lost


class TransferError(LoraStreamError):
    """The server side of a weight transfer failed or went away mid-transfer; the sync did not complete."""

    #: The server stopped taking chunks, or answering the update, within the timeout (it is left to its lease).
    stalled: bool = False


class CheckpointError(LoraStreamError):
    """The checkpoint could not be written (target exists, disk full, ...); no partial checkpoint was left behind."""


class ReplicaError(LoraStreamError):
    """Every server of a :class:`~lora_stream.VLLMServerSink` fleet failed the sync (with
    ``on_replica_failure="exclude"``); ``failures`` maps each server's address to its reason."""

    def __init__(self, message: str, *, failures: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.failures = dict(failures or {})


class ReplicaExcludedWarning(UserWarning):
    """A server of a :class:`~lora_stream.VLLMServerSink` fleet failed a sync and was left out of it
    (``on_replica_failure="exclude"``); the others committed, and the next sync tries it again."""
