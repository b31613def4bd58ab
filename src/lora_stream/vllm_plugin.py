"""vLLM plugin entry point: registers lora_stream's weight-transfer backend (as ``gloo`` and ``lora_stream``) in
both of vLLM's factories.

Installed as ``[project.entry-points."vllm.general_plugins"] lora_stream_gloo``; vLLM calls :func:`register` in the
API server, the engine core and every worker before the worker builds its weight-transfer engine, so a server
started with ``--weight-transfer-config '{"backend": "gloo"}'`` accepts it once lora_stream is installed.
"""

from __future__ import annotations

__all__ = ["BACKEND_NAMES", "register"]

#: The names a server's ``--weight-transfer-config`` may give lora_stream's worker engine: ``gloo`` (its first name)
#: and ``lora_stream``. The engine speaks gloo or nccl on its data plane, as the trainer's sink asks.
BACKEND_NAMES = ("gloo", "lora_stream")


def register() -> None:
    """Register lora_stream's engine under :data:`BACKEND_NAMES` with vLLM's worker and trainer engine factories
    (idempotent)."""
    from vllm.distributed.weight_transfer.factory import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )

    for name in BACKEND_NAMES:
        if name not in WeightTransferEngineFactory._registry:
            WeightTransferEngineFactory.register_engine(
                name, "lora_stream.transfer.gloo_engine", "GlooWeightTransferEngine"
            )
        if name not in WeightTransferTrainerFactory._registry:
            WeightTransferTrainerFactory.register_engine(
                name, "lora_stream.transfer.gloo_trainer", "GlooTrainerWeightTransferEngine"
            )
