"""The data plane between a trainer and vLLM's servers, shared by both halves: the chunk plan
(:mod:`~lora_stream.transfer.packing`), the group and its store (:mod:`~lora_stream.transfer.group`), the wire types
and keys (:mod:`~lora_stream.transfer.protocol`), and the trainer's sending half (:mod:`~lora_stream.transfer.sender`).
The workers' receiving half is :mod:`lora_stream.engine.receiver`."""

from __future__ import annotations

from .packing import ChunkPlan, plan_chunks

__all__ = ["ChunkPlan", "plan_chunks"]
