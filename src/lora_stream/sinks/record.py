"""What one sync did, returned by every sink and logged as one line."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from ..coordination import this_rank
from ..redaction import REDACTED, is_sensitive, redact_text
from ..reporting import sync_log_level

__all__ = ["ELEMENT_METRICS", "METRICS", "AdapterSyncRecord", "SyncRecord"]

#: The names :meth:`SyncRecord.metrics` returns (after its prefix, ``lora_stream/`` by default), each a float: the
#: sync's seconds, the MiB sent and skipped as unchanged, the tensors sent, the largest group gathered, ``partial``
#: (1 when unchanged outputs stayed in the engine), ``verified`` (1 when the sync was verified and passed).
METRICS = ("sync_s", "sent_mib", "skipped_mib", "tensors", "peak_gathered_mib", "partial", "verified")
#: Added to :data:`METRICS` for a sink built with ``elements=True``: ``element_fraction`` (changed elements of the
#: outputs sent as elements; 0 when none went), ``element_mib`` (what those carried) and ``baseline_mib`` (this
#: rank's element baseline in host memory).
ELEMENT_METRICS = ("element_fraction", "element_mib", "baseline_mib")

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
    #: An element sync's figures (sinks built with ``elements=True``; empty otherwise): ``tensors`` sent as
    #: elements, their ``changed`` and total ``elements``, the ``bytes`` those carried against ``whole_bytes`` as
    #: whole tensors, ``encodings`` (segments per encoding), ``baseline_bytes`` (this rank's baseline in host
    #: memory), ``refused`` (why this sync sent no elements, or ``None``) and ``whole_because`` (why the other outputs
    #: cannot go as elements: reason -> how many outputs).
    elements: dict[str, Any] = field(default_factory=dict)
    #: The floating dtypes sent differ from the dtype the engine serves (where the sink knows it: a colocated
    #: engine's model config, or ``served_dtype`` set on a server sink): what was sent, what is served, and what
    #: that costs; ``None`` when they agree or either is unknown.
    cast: str | None = None

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
        object.__setattr__(self, "elements", _redacted_stages(dict(self.elements)))

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")

    @property
    def partial(self) -> bool:
        """Whether outputs unchanged since the engine's version stayed in the engine (``skipped_tensors > 0``)."""
        return self.skipped_tensors > 0

    @property
    def element_fraction(self) -> float:
        """Changed elements over all elements of the outputs sent as elements (0 when none were)."""
        total = self.elements.get("elements", 0)
        return float(self.elements.get("changed", 0)) / total if total else 0.0

    @property
    def verified(self) -> bool:
        """Whether this sync was verified, and passed (a failed verification raises instead of returning)."""
        return bool(getattr(self.verification, "passed", False))

    def summary(self) -> str:
        """The sync as one line: version and sink, seconds, what was sent and what was skipped, full (and why) or
        partial, verified or not, the memory bound. What :meth:`log` logs, e.g.::

            lora_stream sync step-3 (vllm-colocated): 0.412 s; sent 14 tensors, 12.0 MiB in 3 groups (0.03 GB/s);
            skipped 7 unchanged, 4.0 MiB; partial: only what changed; verified: max |diff| 0.0012 <= 0.0500;
            peak group 4.0 MiB, peak gathered 4.0 MiB

        (one line: wrapped here). A server sink names its data plane's transport: ``(vllm-server over nccl)``."""
        if self.partial:
            how = "partial: only what changed"
        else:
            how = f"full: {self.full_because}" if self.full_because else "full"
        check = self.verification
        if check is None:
            verified = "not verified"
        elif self.verified:
            verified = f"verified: max |diff| {check.max_abs_diff:.4f} <= {check.tolerance:.4f}"
        else:
            verified = f"verification failed: max |diff| {check.max_abs_diff:.4f} > {check.tolerance:.4f}"
        # A server sink's name carries its data plane's transport ("vllm-server/nccl"): said in words, because the
        # TRL hook picks it from the trainer's device and a GPU user should see which one every sync used.
        sink, _, transport = self.sink.partition("/")
        where = f"{sink} over {transport}" if transport else sink
        parts = [
            f"lora_stream sync{f' {self.version}' if self.version else ''} ({where}): {self.seconds:.3f} s",
            f"sent {self.tensors} tensors, {self.bytes / 2**20:.1f} MiB in {self.groups} groups ({self.gbps:.2f} GB/s)",
            f"skipped {self.skipped_tensors} unchanged, {self.skipped_bytes / 2**20:.1f} MiB",
            how,
            verified,
            f"peak group {self.peak_group_bytes / 2**20:.1f} MiB, "
            f"peak gathered {self.peak_gathered_bytes / 2**20:.1f} MiB",
        ]
        e = self.elements
        if e:
            if e.get("tensors"):
                kinds = ", ".join(f"{k} {v}" for k, v in sorted(e.get("encodings", {}).items()))
                parts.append(
                    f"elements: {e['tensors']} tensors, {self.element_fraction:.2%} changed, "
                    f"{e['bytes'] / 2**20:.1f} MiB of {e['whole_bytes'] / 2**20:.1f} MiB whole ({kinds}), "
                    f"baseline {e.get('baseline_bytes', 0) / 2**20:.1f} MiB"
                )
            else:
                parts.append(f"no elements: {e.get('refused') or 'nothing changed'}")
        if self.cast:
            parts.append(f"cast: {self.cast}")
        if self.excluded:
            parts.append(f"{len(self.excluded)} server(s) excluded: {', '.join(self.excluded)}")
        if self.readmitted:
            parts.append(f"readmitted {', '.join(self.readmitted)}")
        if self.resume_failure:
            parts.append(f"resuming generation failed: {self.resume_failure}")
        return "; ".join(parts)

    def log(self, rank: int | None = None) -> None:
        """Log :meth:`summary` on the ``lora_stream`` logger: at ``INFO`` on rank 0, which a run shows without
        configuring logging (:mod:`lora_stream.reporting`), at ``DEBUG`` on the other ranks. ``rank``: this rank
        (``None``: ``torch.distributed``'s, or 0)."""
        level = sync_log_level(this_rank() if rank is None else rank)
        if logger.isEnabledFor(level):
            logger.log(level, "%s", self.summary())

    def metrics(self, prefix: str = "lora_stream/") -> dict[str, float]:
        """The sync's figures for a trainer's metrics (:data:`METRICS`, and :data:`ELEMENT_METRICS` for a sink built
        with ``elements=True``, each name after ``prefix``): what the TRL
        hook adds to the trainer's logged metrics, and the verl engine to its actor's."""
        figures = {
            "sync_s": self.seconds,
            "sent_mib": self.bytes / 2**20,
            "skipped_mib": self.skipped_bytes / 2**20,
            "tensors": float(self.tensors),
            "peak_gathered_mib": self.peak_gathered_bytes / 2**20,
            "partial": float(self.partial),
            "verified": float(self.verified),
            "element_fraction": self.element_fraction,
            "element_mib": self.elements.get("bytes", 0) / 2**20,
            "baseline_mib": self.elements.get("baseline_bytes", 0) / 2**20,
        }
        names = METRICS + (ELEMENT_METRICS if self.elements else ())
        return {prefix + name: float(figures[name]) for name in names}


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
