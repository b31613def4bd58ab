"""Sinks consume a :class:`~lora_stream.ParamStream`: an inference engine, a checkpoint on disk."""

from __future__ import annotations

from .preflight import CheckpointMismatchError, checkpoint_metadata, compare_with_checkpoint
from .record import SyncRecord
from .vllm_colocated import WORKER_EXTENSION, VLLMColocatedSink, VLLMLoadError
from .vllm_server import ServerError, VLLMServerClient, VLLMServerSink

__all__ = [
    "WORKER_EXTENSION",
    "CheckpointMismatchError",
    "ServerError",
    "SyncRecord",
    "VLLMColocatedSink",
    "VLLMLoadError",
    "VLLMServerClient",
    "VLLMServerSink",
    "checkpoint_metadata",
    "compare_with_checkpoint",
]
