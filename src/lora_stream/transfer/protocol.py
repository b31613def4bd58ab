"""What both halves of lora_stream's weight transfer agree on: the update's wire types, the store's keys, the
transports, and the replica digest.

The trainer's half (:class:`lora_stream.transfer.sender.TrainerTransferEngine`) and the workers' half
(:class:`lora_stream.engine.receiver.WorkerTransferEngine`) import this module and nothing of each other, so that
the code that runs inside vLLM's processes never depends on the trainer's sinks, and the other way round.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.weight_transfer.base import (  # type: ignore[import-not-found,unused-ignore]
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

__all__ = [
    "STORE_PREFIX",
    "TIMING_KEY",
    "TRANSPORTS",
    "VERIFY_KEY",
    "TransferInitInfo",
    "TransferUpdateInfo",
    "replica_digest",
]

#: Every key the transfer group writes to the trainer's store is ``STORE_PREFIX/<HMAC of its name>`` (``_SealedStore``).
STORE_PREFIX = "lora_stream_weight_transfer"
#: The data plane's collectives: ``gloo`` (any host; tensors travel from host memory) or ``nccl`` (GPUs; tensors travel
#: from device memory). Everything else -- the rendezvous, its secret, the chunk plan, the reload bracket, the
#: transaction -- is the same for both.
TRANSPORTS = ("gloo", "nccl")
#: Where each server worker leaves the timing of its side of the latest update, in the trainer's store.
TIMING_KEY = "lora_stream_worker_timing_{rank}"
#: Where each server worker leaves its verification (probe log-probabilities, weight digest) of the latest update.
VERIFY_KEY = "lora_stream_worker_verify_{rank}"
#: Where each server worker says that its receive of a staged update (``TransferUpdateInfo.stage``) ended: ``ok``, or
#: ``failed`` (the reason comes with ``command="staged"``). The trainer waits here, not in a call: a call would hold
#: vLLM's engine loop, and generation with it, until the receive ended.
STAGED_KEY = "lora_stream_worker_staged_{stage_id}_{rank}"


@dataclass
class TransferInitInfo(WeightTransferInitInfo):  # type: ignore[misc]
    """What every worker needs to join the trainer's group (sent once, by ``/init_weight_transfer_engine``)."""

    master_address: str
    master_port: int
    world_size: int
    rank_offset: int = 1
    buffer_bytes: int = 256 * 1024 * 1024
    timeout_s: float = 120.0
    #: The group's secret (128 random bits, new for every group), sent only over the guarded HTTP route: it names
    #: and authenticates the rendezvous' keys in the store (:class:`TransferGroup`). Never shown by ``repr``.
    secret: str = field(default="", repr=False)
    #: The data plane's collectives (:data:`TRANSPORTS`).
    transport: str = "gloo"


@dataclass
class TransferUpdateInfo(WeightTransferUpdateInfo):  # type: ignore[misc]
    """One sync's metadata, sent once by ``/update_weights`` before any byte: names, dtypes, shapes, groups."""

    names: list[str] = field(default_factory=list)
    dtype_names: list[str] = field(default_factory=list)
    shapes: list[list[int]] = field(default_factory=list)
    group_sizes: list[int] = field(default_factory=list)
    chunk_sizes: list[int] = field(default_factory=list)
    #: Names sent only if the worker's model holds them (tied aliases, see ``ReloadBracket.load``).
    optional_names: list[str] = field(default_factory=list)
    #: An adapter sync (:class:`~lora_stream.AdapterStream`): ``{"path", "config", "keep"}``. The tensors are staged
    #: for vLLM's ``add_lora`` under ``path`` instead of loaded into the model; ``keep`` is the path of the version
    #: the server serves now, kept staged while the new one may still be refused.
    adapter: dict[str, Any] | None = None
    #: Keep a host copy of the model's weights while the update is undecided, so that it can be rolled back.
    rollback: bool = False
    #: The trainer's decision on the update this session loaded: ``"commit"`` or ``"rollback"``; or ``"verify"``:
    #: run the probe ``probe_ids`` through the loaded weights and leave the result in the trainer's store
    #: (:data:`VERIFY_KEY`); or ``"staged"``: raise what failed in the ``stage`` update's receive, which ended (see
    #: ``stage``). No tensors travel.
    command: str | None = None
    #: With tensors: run this probe through the weights served *before* loading them, for the verification's
    #: "it changed" check; with ``command="verify"``: the probe to run after.
    probe_ids: list[int] | None = None
    #: A verified sync: digest every tensor received, for comparing replicas.
    digest: bool = False
    #: A partial update (only the outputs that changed): the sync whose committed weights it was computed against.
    #: The workers refuse it, before loading a byte, unless they hold exactly those (``None``: a full update).
    base: str | None = None
    #: With ``command="commit"``: the committing sync's id, which the workers then hold.
    sync: str | None = None
    #: With ``command="commit"``: the version it commits. A later ``rollback`` in the same session is refused,
    #: naming it (the decision is final; a server's lease finishes the session with this version instead).
    version: str | None = None
    #: The merge in the engine (:mod:`lora_stream.engine.merger`): the tensors are merge inputs, and this carries
    #: one recipe per step to load (``recipes``), which keys are the frozen base (``frozen``) and, for a partial
    #: update, the fingerprint the trainer recorded for each base key the recipes read (``base_fp``).
    merge: dict[str, Any] | None = None
    #: A sink built with ``elements=True`` (:class:`~lora_stream.engine.elements.ElementShadow`): which tensors the
    #: workers keep a copy of, and which travel as changed elements (their shapes, dtypes and segments).
    elements: dict[str, Any] | None = None
    #: Receive the tensors and hold them, loading nothing: the workers receive on a thread of their own and answer
    #: at once, so that the engine keeps generating while the payload arrives and is decoded and checked (an element
    #: sync into a paused server: only the write waits for the pause). Each worker says in the trainer's store when
    #: its receive ended (:data:`STAGED_KEY`); ``command="staged"`` then answers at once with what failed in it; a
    #: later update with ``staged=True`` and the same tensors loads them.
    stage: bool = False
    #: A name the trainer draws for each staged pass (not a credential: it authorizes nothing): where the workers
    #: say their receive ended (:data:`STAGED_KEY`), and what the update that loads it must carry too.
    stage_id: str = ""
    #: Load the tensors the latest ``stage`` update of this session received, instead of receiving any: its
    #: ``stage_id``, names, dtypes, shapes and chunks must be this update's.
    staged: bool = False

    def __post_init__(self) -> None:
        n = len(self.names)
        if len(self.dtype_names) != n or len(self.shapes) != n or sum(self.group_sizes) != n:
            raise ValueError("names, dtype_names, shapes and group_sizes describe different numbers of tensors")


def replica_digest(digests: dict[str, str]) -> str:
    """One SHA-256 over a replica's per-parameter digests (sorted by key): equal iff every served tensor is."""
    return hashlib.sha256(json.dumps(sorted(digests.items())).encode()).hexdigest()
