"""What one sync did, returned by every sink and logged as one line."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from ..redaction import REDACTED, is_sensitive, redact_text

__all__ = ["AdapterSyncRecord", "SyncRecord"]

logger = logging.getLogger("lora_stream")


@dataclass(frozen=True)
class SyncRecord:
    """One weight sync: what was sent and how long it took.

    ``peak_gathered_bytes`` is the largest group the trainer held whole for it (the memory bound in action);
    ``peak_group_bytes`` the largest group of output tensors handed to the engine at once. A record exists only
    for a sync that committed on every rank.

    A record holds no credential: the servers' addresses, the reasons and the stages are stored redacted
    (:func:`~lora_stream.redaction.redact_text`: URL userinfo, bearer keys, ``api_key=...``), so that its ``repr``,
    :func:`dataclasses.asdict` and its log line can be shown anywhere.
    """

    sink: str
    tensors: int
    bytes: int
    groups: int
    seconds: float
    peak_group_bytes: int
    peak_gathered_bytes: int
    version: str | None = None
    #: Seconds by stage where the sink measures them (the server sink over gloo: the trainer's engine's
    #: ``last_stages``, with the server worker's own timing under ``"worker"``).
    stages: dict[str, Any] = field(default_factory=dict)
    #: The verification of this sync (:class:`~lora_stream.sinks.verify.Verification`: the largest probe
    #: log-probability difference between the engine and the trainer's forward, and the tolerance), when it ran.
    verification: Any = None
    #: The servers that serve this version (a :class:`~lora_stream.VLLMServerSink`; empty for other sinks).
    replicas: tuple[str, ...] = ()
    #: Servers left out of this sync (``on_replica_failure="exclude"``): address -> reason. They keep serving what
    #: they served, or nothing; the next sync tries them again.
    excluded: dict[str, str] = field(default_factory=dict)
    #: Servers excluded from the previous sync that took this one: they serve the full current weights again.
    readmitted: tuple[str, ...] = ()
    #: Outputs (and their bytes) this sync did not gather or send because every source was unchanged since the
    #: engines' version and the engines hold it (:mod:`lora_stream.changes`), tied aliases counted as in
    #: ``tensors``; 0 for a full sync. ``tensors + skipped_tensors`` is what a full sync sends.
    skipped_tensors: int = 0
    skipped_bytes: int = 0
    #: Whole bytes this rank gathered (made whole, group after group) for the sync.
    gathered_bytes: int = 0
    #: Why every output was sent (a first sync, a restarted engine, a failed previous sync, ``skip_unchanged``
    #: off, ...); ``None`` for a partial sync, which sent only what changed.
    full_because: str | None = None
    #: The sync committed, but resuming generation failed on a server (every rank records it alike; the server's
    #: lease resumes it, :mod:`lora_stream.engine.lease`): what failed, or ``None``.
    resume_failure: str | None = None

    def __post_init__(self) -> None:
        # Addresses may carry userinfo (http://user:password@host), reasons an error's text: redacted once, here.
        object.__setattr__(self, "replicas", tuple(redact_text(u) for u in self.replicas))
        object.__setattr__(self, "readmitted", tuple(redact_text(u) for u in self.readmitted))
        object.__setattr__(self, "excluded", {redact_text(u): redact_text(why) for u, why in self.excluded.items()})
        if self.resume_failure is not None:
            object.__setattr__(self, "resume_failure", redact_text(self.resume_failure))
        if self.full_because is not None:
            object.__setattr__(self, "full_because", redact_text(self.full_because))
        object.__setattr__(self, "stages", _redacted_stages(self.stages))

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")

    def log(self) -> None:
        logger.info(
            "lora_stream %s sync%s: %d tensors, %.1f MiB in %d groups (%d tensors, %.1f MiB unchanged and skipped), "
            "%.3f s (%.2f GB/s), peak group %.1f MiB, peak gathered %.1f MiB",
            self.sink,
            f" (version {self.version})" if self.version else "",
            self.tensors,
            self.bytes / 2**20,
            self.groups,
            self.skipped_tensors,
            self.skipped_bytes / 2**20,
            self.seconds,
            self.gbps,
            self.peak_group_bytes / 2**20,
            self.peak_gathered_bytes / 2**20,
        )


def _redacted_stages(value: Any) -> Any:
    """``stages`` as plain data (JSON-able as before) with keys and values redacted: ``stages["replicas"]`` is
    keyed by server address; a credential-like key's value becomes the text ``"<redacted>"``."""
    if isinstance(value, str):
        return redact_text(value)
    if isinstance(value, dict):
        return {
            (redact_text(k) if isinstance(k, str) else k): (
                REDACTED if is_sensitive(k) and v is not None and v != "" else _redacted_stages(v)
            )
            for k, v in value.items()
        }
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(_redacted_stages(v) for v in value)
    return value


@dataclass(frozen=True)
class AdapterSyncRecord(SyncRecord):
    """An adapter sync: besides what was sent, how generation selects the adapter just synced (vLLM serves the
    base model to requests without it): the ``LoRARequest`` to pass to ``LLM.generate``
    (:class:`~lora_stream.VLLMLoRASink`), or the name to pass as ``model`` to a server's ``/v1/completions``
    (:class:`~lora_stream.VLLMServerSink`, where ``lora_request`` is ``None``)."""

    lora_request: Any = None
    lora_name: str | None = None
