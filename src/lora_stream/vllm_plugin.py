"""vLLM plugin entry point: registers lora_stream's ``gloo`` weight-transfer backend in both of vLLM's factories.

Installed as ``[project.entry-points."vllm.general_plugins"] lora_stream_gloo``; vLLM calls :func:`register` in the
API server, the engine core and every worker before the worker builds its weight-transfer engine, so a server
started with ``--weight-transfer-config '{"backend": "gloo"}'`` accepts it once lora_stream is installed.
"""

from __future__ import annotations

__all__ = ["register"]


def register() -> None:
    """Register ``gloo`` with vLLM's worker and trainer engine factories (idempotent)."""
    from vllm.distributed.weight_transfer.factory import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )

    if "gloo" not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            "gloo", "lora_stream.transfer.gloo_engine", "GlooWeightTransferEngine"
        )
    if "gloo" not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(
            "gloo", "lora_stream.transfer.gloo_trainer", "GlooTrainerWeightTransferEngine"
        )
