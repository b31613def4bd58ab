"""The terms a trainer's sink and a server's lease (:mod:`lora_stream.engine.lease`) speak: the headers and paths,
the answers a server gives a request it refuses (:data:`BUSY`, :data:`EXPIRED`), the sync's credential and its name
(:func:`new_credential`, :func:`sync_name`: the server keeps and shows only the name), what a refusal says was
committed (:func:`committed_version`), and the record of one hold (:class:`_Lease`).

Who uses it: the lease middleware in the server's API process, and the sink's client on the trainer's side
(:mod:`lora_stream.sinks.server_client`), which must send and read exactly these. What breaks if the two sides
spelled them apart: a sync's requests would not be its own, or a refusal would not be read as one.

**The credential.** Every request lora_stream's sink sends during a sync carries ``X-Lora-Stream-Sync``, the
sync's *credential*: a secret of at least :data:`MIN_CREDENTIAL` characters the sink draws for this sync alone
(:func:`new_credential`), and ``X-Lora-Stream-Lease`` (seconds). The server never stores, returns, logs or echoes
the credential: it keeps only the sync's *name*, a digest of it (:func:`sync_name`), and everything it shows
(``GET /lora_stream/lease``, a ``409``'s ``holder``, ``weights_by``, its log, the workers' record of the commit) shows
the name. Presenting the name back is presenting nothing: a request acts for a sync only with the secret whose
digest is that name, compared in constant time. A credential shorter than :data:`MIN_CREDENTIAL` is no credential.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import json
import math
import re
import secrets
import time
import uuid
from typing import Any

__all__ = [
    "BUSY",
    "COMMIT_HEADER",
    "DECIDE_PATH",
    "EXPIRED",
    "LEASED_PATHS",
    "LEASE_HEADER",
    "MIN_CREDENTIAL",
    "NOTHING_KEPT",
    "RESTORE_HEADER",
    "ROLLBACK_HEADER",
    "STATUS_PATH",
    "SYNC_HEADER",
    "UPDATE_PATHS",
    "committed_version",
    "new_credential",
    "sync_name",
]


#: Request headers lora_stream's sink sends on every call of a sync: the sync's credential (a secret, never shown by
#: the server) and the lease's length in seconds (read once, when the sync takes the server).
SYNC_HEADER = "x-lora-stream-sync"


LEASE_HEADER = "x-lora-stream-lease"


#: The shortest credential the lease takes (:func:`new_credential` draws 64 hexadecimal characters, 256 bits).
MIN_CREDENTIAL = 32


#: On an adapter sync's ``/v1/load_lora_adapter``: JSON ``{"lora_name", "lora_path"}`` of what a heal puts back
#: (``lora_path`` ``null``: unload the name).
RESTORE_HEADER = "x-lora-stream-restore"


#: On the ``/update_weights`` request that carries the trainer's commit: JSON ``{"version": ...}``. Once the workers
#: answered it, the update is decided: a heal finishes it with that version instead of rolling it back.
COMMIT_HEADER = "x-lora-stream-commit"


#: On the holder's ``/update_weights`` rollback command: the decision recorded at this server (:data:`DECIDE_PATH`) is
#: withdrawn as the request arrives, before the workers roll back, so a heal can never commit what they rolled back.
ROLLBACK_HEADER = "x-lora-stream-rollback"


#: ``POST`` with the holder's headers and :data:`COMMIT_HEADER`: the sync's decision to commit, recorded at this
#: server before any server of the sync commits. From then on a heal rolls the update forward (the workers commit,
#: the session ends with the decided version) instead of back; the holder's rollback command withdraws it. Answered
#: ``200`` only while the sync holds this server; otherwise ``409`` (:data:`EXPIRED`): a server that restarted, or
#: whose lease ran out and rolled back, never takes a decision it can no longer carry out.
DECIDE_PATH = "/lora_stream/decide"


#: The route that reports the lease's state (JSON); with the holder's headers it renews the lease (the heartbeat),
#: and its ``yours`` field says whether the asking sync still holds the server.
STATUS_PATH = "/lora_stream/lease"


#: The routes whose requests take part in the lease (and may heal a server held by another sync).
LEASED_PATHS = frozenset(
    {
        "/pause",
        "/resume",
        "/start_weight_update",
        "/update_weights",
        "/finish_weight_update",
        "/reset_prefix_cache",
        "/init_weight_transfer_engine",
        "/get_world_size",
        "/server_info",
        "/weight_info",
        "/v1/models",
        "/v1/load_lora_adapter",
        "/v1/unload_lora_adapter",
    }
)


#: The routes that start an update: only these take a free server for a sync; another sync's request to one of them
#: supersedes the holder (healing it first), as a trainer restarted after a death must; on every other guarded route
#: it is refused.
START_PATHS = frozenset({"/pause", "/start_weight_update", "/init_weight_transfer_engine"})


#: The routes that act inside a sync's update: only the sync that holds the server reaches them with its credential.
#: A credential that does not hold the server is refused there (:data:`EXPIRED`), never let through as nobody's: on a
#: server restarted under a sync, vLLM's "no update session" answer would otherwise read as the sync's own commit.
UPDATE_PATHS = frozenset({"/update_weights", "/finish_weight_update"})


#: The marker in a ``409`` answer to a request of a sync whose lease expired (the server rolled it back).
EXPIRED = "lora_stream_lease_expired"


#: The marker in a ``409`` answer while another sync's request is still running on the server.
BUSY = "lora_stream_lease_busy"


#: How many released syncs' names the lease remembers, to refuse their credentials (16 bytes each): the syncs of days
#: at one a minute. A credential older than that acts as a stranger's, which takes a free server as a new sync and
#: writes under its own name: never under the name the sink's last commit holds (always among the remembered).
_MAX_ENDED = 4096


_MAX_LEASE_S = 24 * 3600.0


#: What lora_stream's worker engine says when a rollback restores nothing: the update kept no copy (rollback=False),
#: or it was committed (then the lease rolls it forward instead; see :attr:`_Lease.committed`).
NOTHING_KEPT = "lora_stream_nothing_to_restore"


# What vLLM's worker answers when no update session is open (the workers already ended it).
_NO_SESSION = ("must be called before", "without a matching")


def new_credential() -> str:
    """A fresh sync credential: 256 random bits, as text (drawn by the sink for each sync)."""
    return secrets.token_hex(32)


def sync_name(credential: str) -> str:
    """The public name of the sync whose credential is ``credential``: what the server shows and the workers record.
    A digest, so that what anyone can read is never what a request must present."""
    return hashlib.sha256(credential.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def _same(a: str | None, b: str | None) -> bool:
    """Whether two sync names are the same, in constant time."""
    return a is not None and b is not None and hmac.compare_digest(a.encode(), b.encode())


def no_session(error: BaseException) -> bool:
    """Whether ``error`` is vLLM's answer that no weight-update session is open (the workers already ended it)."""
    return any(m in str(error) for m in _NO_SESSION)


class _Lease:
    """What the middleware knows of the sync that holds the server."""

    def __init__(self) -> None:
        self.sync: str | None = None
        self.lease_s = 0.0
        self.expires = 0.0
        self.inflight = 0
        self.paused = False
        self.session = False
        #: What a heal puts back of an adapter the sync swapped in: ``{"lora_name", "lora_path"}``, or ``None``.
        self.restore: dict[str, Any] | None = None
        #: The holding sync's commit, once the workers acknowledged it: ``{"version": ...}`` (``None``: undecided).
        #: From then on the update is final, and a heal rolls it forward.
        self.committed: dict[str, Any] | None = None
        #: The holding sync's decision to commit, recorded before any server commits (:data:`DECIDE_PATH`):
        #: ``{"version": ...}``, or ``None``. A heal then has the workers commit and rolls forward.
        self.decided: dict[str, Any] | None = None
        #: The holding sync's lease ran out: it is being healed (a step that failed is retried every tick).
        self.expiring = False
        self.expired: list[str] = []
        #: Names of syncs that held this server and released it: their credentials act on nothing any more.
        self.ended: collections.OrderedDict[str, None] = collections.OrderedDict()
        #: Syncs whose committed update a heal finished, with their version: their late ``/finish_weight_update``
        #: and ``/resume`` are answered as done.
        self.forwarded: dict[str, str | None] = {}
        self.heals = 0
        self.last_heal: str | None = None
        #: This API process's identity: a restarted server reports another one.
        self.boot = uuid.uuid4().hex
        #: The sync whose request last reached a route that may write the weights (``None``: one without
        #: lora_stream's headers, or none since the server started): what a partial sync must find unchanged.
        self.weights_by: str | None = None

    def end(self, name: str) -> None:
        """Sync ``name`` released this server: its credential acts on nothing from now on."""
        self.ended[name] = None
        while len(self.ended) > _MAX_ENDED:
            self.ended.popitem(last=False)

    @property
    def holding(self) -> bool:
        # A committed update not yet finished under its version still holds the server: its heal must finish it.
        return self.sync is not None and (
            self.paused or self.session or self.restore is not None or self.committed is not None
        )

    def expires_in(self) -> float | None:
        return round(self.expires - time.monotonic(), 3) if self.holding else None

    def status(
        self, disabled: str | None, asking: str | None = None, unclassified: list[str] | None = None
    ) -> dict[str, Any]:
        yours = None
        if asking is not None:
            yours = {
                "holding": self.holding and _same(self.sync, asking) and not self.expiring,
                "expired": asking in self.expired,
                "forwarded": asking in self.forwarded,
            }
        return {
            "yours": yours,
            "sync": self.sync,  # the holder's name, a digest of its credential: presenting it back acts on nothing
            "holding": self.holding,
            "paused": self.paused,
            "session": self.session,
            "decided": self.decided is not None or self.committed is not None,
            "adapter_restore": self.restore is not None,
            "inflight": self.inflight,
            "expires_in": self.expires_in(),
            "heals": self.heals,
            "last_heal": self.last_heal,
            "disabled": disabled,
            "boot": self.boot,
            "weights_by": self.weights_by,
            "unclassified_routes": unclassified or [],
        }


def _header(scope: Any, name: str) -> str | None:
    key = name.encode()
    for k, value in scope.get("headers", ()):
        if k.lower() == key:
            return str(value.decode("latin-1"))
    return None


def _lease_headers(scope: Any) -> tuple[str | None, float]:
    """The request's sync, by its name (the credential itself is dropped here: nothing after this sees it), and the
    lease it asks for; ``(None, 0.0)`` for a request that acts for no sync."""
    credential = _header(scope, SYNC_HEADER)
    raw = _header(scope, LEASE_HEADER)
    if credential is None or raw is None or not MIN_CREDENTIAL <= len(credential) <= 512:
        return None, 0.0
    try:
        lease_s = float(raw)
    except ValueError:
        return None, 0.0
    if not math.isfinite(lease_s) or lease_s <= 0:
        return None, 0.0
    return sync_name(credential), min(max(1.0, lease_s), _MAX_LEASE_S)


def committed_version(error: str) -> dict[str, Any] | None:
    """``{"version": ...}`` from the worker's refusal to roll back a committed update, or ``None``."""
    if NOTHING_KEPT not in error:
        return None
    found = re.search(r'as version (null|"(?:[^"\\]|\\.)*")', error)
    if found is None:
        return None
    try:
        return {"version": json.loads(found.group(1))}
    except ValueError:
        return None


def _json_header(scope: Any, name: str) -> dict[str, Any] | None:
    raw = _header(scope, name)
    if raw is None:
        return None
    try:
        data = json.loads(raw)
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


def _restore_header(scope: Any) -> dict[str, Any] | None:
    data = _json_header(scope, RESTORE_HEADER)
    return data if data is not None and "lora_name" in data else None
