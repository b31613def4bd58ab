"""lora_stream: stream a trainer's weights, LoRA merged out of place, into an inference engine one group at a time.

>>> from lora_stream import stream_merged_params
>>> with stream_merged_params(model) as weights:  # doctest: +SKIP
...     for name, tensor in weights:
...         ...
"""

from __future__ import annotations

from .adapter import AdapterStream
from .errors import (
    LoraStreamError,
    StreamAbortedError,
    UnsupportedAdapterError,
    UnsupportedModelError,
)
from .gatherers import Fsdp1Gatherer, Fsdp2Gatherer, PlainGatherer, ZeroThreeGatherer
from .merged_params import stream_merged_params
from .names import register_wrapper
from .sinks import (
    AdapterLoadError,
    AdapterSyncRecord,
    CheckpointMismatchError,
    SafetensorsSink,
    ServerError,
    SyncRecord,
    VLLMColocatedSink,
    VLLMLoadError,
    VLLMLoRASink,
    VLLMServerSink,
    save_merged,
)
from .sinks.verify import Verification, VerificationError
from .stream import ParamStream

__version__ = "0.1.0"

#: What a user calls or catches (25 names). Everything else lives in its submodule: the exceptions users rarely catch
#: apart from :class:`LoraStreamError`, their base, in ``lora_stream.errors``; ``lora_stream.transaction``,
#: ``lora_stream.changes``, ``lora_stream.stream``, ``lora_stream.gatherers``, ``lora_stream.sinks``, ...; test hooks in
#: :mod:`lora_stream.testing`. ``tests/test_public_surface.py`` holds this list.
__all__ = [
    "AdapterLoadError",
    "AdapterStream",
    "AdapterSyncRecord",
    "CheckpointMismatchError",
    "Fsdp1Gatherer",
    "Fsdp2Gatherer",
    "LoraStreamError",
    "ParamStream",
    "PlainGatherer",
    "SafetensorsSink",
    "ServerError",
    "StreamAbortedError",
    "SyncRecord",
    "UnsupportedAdapterError",
    "UnsupportedModelError",
    "VLLMColocatedSink",
    "VLLMLoRASink",
    "VLLMLoadError",
    "VLLMServerSink",
    "Verification",
    "VerificationError",
    "ZeroThreeGatherer",
    "register_wrapper",
    "save_merged",
    "stream_merged_params",
]
