"""Sinks consume a :class:`~lora_stream.ParamStream`: an inference engine, a checkpoint on disk.

Every sink implements :class:`Sink`. The vLLM sinks share their parts and differ only in transport: one pre-flight
(:func:`preflight`), one description of what is sent (:class:`SyncSource`, which also builds the
:class:`SyncRecord`), one prefix-cache reset (:mod:`~lora_stream.sinks.prefix_cache`), and one reload bracket with its
reload check (:class:`~lora_stream.engine.reload.ReloadBracket`), which runs on the engine's side: in the trainer's
process, in an engine's child process, or in a vLLM server's worker (:mod:`lora_stream.engine`).
"""

from __future__ import annotations

from ..engine.adapter_staging import AdapterLoadError
from ..engine.reload import VLLMLoadError
from .base import Sink
from .checkpoint import CheckpointError, SafetensorsSink, save_merged
from .local_engine import WORKER_EXTENSION
from .prefix_cache import PrefixCacheError
from .preflight import (
    CheckpointMismatchError,
    EngineCheckpoint,
    adapter_preflight,
    checkpoint_metadata,
    compare_with_checkpoint,
    preflight,
)
from .record import AdapterSyncRecord, SyncRecord
from .source import SyncSource
from .vllm_colocated import VLLMColocatedSink
from .vllm_lora import VLLMLoRASink
from .vllm_server import LeaseExpiredError, ServerError, VLLMServerClient, VLLMServerSink

__all__ = [
    "WORKER_EXTENSION",
    "AdapterLoadError",
    "AdapterSyncRecord",
    "CheckpointError",
    "CheckpointMismatchError",
    "EngineCheckpoint",
    "PrefixCacheError",
    "SafetensorsSink",
    "LeaseExpiredError",
    "ServerError",
    "Sink",
    "SyncRecord",
    "SyncSource",
    "VLLMColocatedSink",
    "VLLMLoadError",
    "VLLMLoRASink",
    "VLLMServerClient",
    "VLLMServerSink",
    "checkpoint_metadata",
    "adapter_preflight",
    "compare_with_checkpoint",
    "preflight",
    "save_merged",
]
