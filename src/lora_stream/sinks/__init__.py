"""Sinks consume a :class:`~lora_stream.ParamStream`: an inference engine, a checkpoint on disk.

Every sink implements :class:`Sink`. The vLLM sinks share their parts and differ only in transport: one pre-flight
(:func:`preflight`), one description of what is sent (:class:`SyncSource`, which also builds the
:class:`SyncRecord`), and one reload bracket with its reload check (:class:`ReloadBracket`), run in the
trainer's process, in an engine's child process, or in a vLLM server's worker.
"""

from __future__ import annotations

from .adapter_loader import AdapterLoadError
from .base import Sink
from .checkpoint import CheckpointError, SafetensorsSink, save_merged
from .preflight import (
    CheckpointMismatchError,
    EngineCheckpoint,
    adapter_preflight,
    checkpoint_metadata,
    compare_with_checkpoint,
    preflight,
)
from .record import AdapterSyncRecord, SyncRecord
from .reload import LoadReport, ReloadBracket, VLLMLoadError
from .source import SyncSource
from .vllm_colocated import WORKER_EXTENSION, VLLMColocatedSink
from .vllm_lora import VLLMLoRASink
from .vllm_server import LeaseExpiredError, ServerError, VLLMServerClient, VLLMServerSink

__all__ = [
    "WORKER_EXTENSION",
    "AdapterLoadError",
    "AdapterSyncRecord",
    "CheckpointError",
    "CheckpointMismatchError",
    "EngineCheckpoint",
    "LoadReport",
    "ReloadBracket",
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
