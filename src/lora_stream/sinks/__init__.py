"""Sinks consume a :class:`~lora_stream.ParamStream`: an inference engine, a checkpoint on disk."""

from __future__ import annotations

from .preflight import CheckpointMismatchError, checkpoint_metadata, compare_with_checkpoint
from .record import SyncRecord
from .vllm_colocated import WORKER_EXTENSION, VLLMColocatedSink, VLLMLoadError

__all__ = [
    "WORKER_EXTENSION",
    "CheckpointMismatchError",
    "SyncRecord",
    "VLLMColocatedSink",
    "VLLMLoadError",
    "checkpoint_metadata",
    "compare_with_checkpoint",
]
