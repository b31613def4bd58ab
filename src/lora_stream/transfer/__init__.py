"""Data plane between a trainer and vLLM's server: packing and the gloo weight-transfer backend."""

from __future__ import annotations

from .packing import ChunkPlan, plan_chunks

__all__ = ["ChunkPlan", "plan_chunks"]
