"""lora_stream: stream a trainer's weights, LoRA merged out of place, into an inference engine one group at a time.

>>> from lora_stream import stream_merged_params
>>> with stream_merged_params(model) as weights:  # doctest: +SKIP
...     for name, tensor in weights:
...         ...
"""

from __future__ import annotations

from .adapter import AdapterStream
from .changes import Changes, EngineState, SyncedSources, agree_on_changes
from .checkpoint_format import CheckpointFormatError, Layout
from .coordination import Coordinator
from .errors import (
    LoraStreamError,
    NameCollisionError,
    RenameError,
    ReplicaError,
    ReplicaExcludedWarning,
    StalePlanError,
    StreamAbortedError,
    TransferError,
    UnsupportedAdapterError,
    UnsupportedModelError,
)
from .fingerprint import fingerprint
from .gatherers import Fsdp1Gatherer, Fsdp2Gatherer, Gatherer, PlainGatherer, ZeroThreeGatherer, auto_gatherer
from .grouping import DEFAULT_BUDGET_BYTES, GroupBy
from .merge import DEFAULT_MERGE_BLOCK_BYTES
from .names import Renames, register_wrapper
from .sinks import (
    AdapterLoadError,
    AdapterSyncRecord,
    CheckpointError,
    CheckpointMismatchError,
    LeaseExpiredError,
    PrefixCacheError,
    SafetensorsSink,
    ServerError,
    Sink,
    SyncRecord,
    VLLMColocatedSink,
    VLLMLoadError,
    VLLMLoRASink,
    VLLMServerSink,
    save_merged,
)
from .sinks.verify import Verification, VerificationError, VerifyPolicy
from .stream import ParamMeta, ParamStream, PassState, Selection, StreamPass, StreamStats, stream_merged_params
from .transaction import FAULT_POINTS, Transaction, set_fault_hook

__version__ = "0.1.0"

__all__ = [
    "AdapterStream",
    "AdapterSyncRecord",
    "AdapterLoadError",
    "VLLMLoRASink",
    "CheckpointError",
    "CheckpointFormatError",
    "CheckpointMismatchError",
    "Layout",
    "SafetensorsSink",
    "LeaseExpiredError",
    "ServerError",
    "Sink",
    "SyncRecord",
    "VLLMColocatedSink",
    "VLLMLoadError",
    "VLLMServerSink",
    "DEFAULT_BUDGET_BYTES",
    "DEFAULT_MERGE_BLOCK_BYTES",
    "Coordinator",
    "Fsdp1Gatherer",
    "Fsdp2Gatherer",
    "Gatherer",
    "GroupBy",
    "LoraStreamError",
    "NameCollisionError",
    "ParamMeta",
    "ParamStream",
    "PassState",
    "PlainGatherer",
    "PrefixCacheError",
    "RenameError",
    "Renames",
    "ReplicaError",
    "ReplicaExcludedWarning",
    "StalePlanError",
    "StreamAbortedError",
    "StreamPass",
    "StreamStats",
    "Selection",
    "Changes",
    "EngineState",
    "SyncedSources",
    "agree_on_changes",
    "fingerprint",
    "FAULT_POINTS",
    "Transaction",
    "TransferError",
    "UnsupportedAdapterError",
    "UnsupportedModelError",
    "Verification",
    "VerificationError",
    "VerifyPolicy",
    "ZeroThreeGatherer",
    "auto_gatherer",
    "register_wrapper",
    "save_merged",
    "set_fault_hook",
    "stream_merged_params",
]
