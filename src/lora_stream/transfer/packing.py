"""Packing tensors into byte buffers for a broadcast: the plan both ends compute from the same metadata.

The trainer packs consecutive tensors into one uint8 buffer per *chunk* and broadcasts it; the receiver unpacks
views. Both sides must agree on every chunk boundary and offset, so the plan is derived from nothing but the
metadata (shapes, dtypes), the group structure and the buffer size, and the trainer also sends the chunk sizes it
used, which the receiver checks against its own plan.

Rules: chunks follow the stream's group boundaries where they can -- whole groups are packed together while they
fit in ``buffer_bytes``; a group larger than the buffer is split between tensors; a tensor larger than the buffer
travels alone (as its own bytes, without a copy on the trainer). Offsets are aligned to 64 bytes so that every view
is aligned for its dtype.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["ALIGN", "ChunkPlan", "plan_chunks", "tensor_nbytes", "pack_into", "unpack"]

ALIGN = 64


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def tensor_nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


@dataclass(frozen=True)
class ChunkPlan:
    """Tensor indices per chunk, and each tensor's byte offset inside its chunk."""

    chunks: list[list[int]]
    offsets: list[int]
    sizes: list[int]

    def chunk_bytes(self, c: int) -> int:
        last = self.chunks[c][-1]
        return self.offsets[last] + self.sizes[last]


def plan_chunks(
    shapes: Sequence[Sequence[int]], dtypes: Sequence[torch.dtype], group_sizes: Sequence[int], buffer_bytes: int
) -> ChunkPlan:
    """Plan chunks for tensors ``0..n-1`` given as consecutive groups of ``group_sizes`` tensors."""
    if buffer_bytes <= 0:
        raise ValueError(f"buffer_bytes must be positive, got {buffer_bytes}")
    if sum(group_sizes) != len(shapes):
        raise ValueError(f"group sizes add up to {sum(group_sizes)}, but there are {len(shapes)} tensors")
    sizes = [tensor_nbytes(s, d) for s, d in zip(shapes, dtypes)]
    chunks: list[list[int]] = []
    current: list[int] = []
    used = 0

    def close() -> None:
        nonlocal current, used
        if current:
            chunks.append(current)
        current, used = [], 0

    start = 0
    for gsize in group_sizes:
        members = list(range(start, start + gsize))
        start += gsize
        gbytes = sum(_align(sizes[i]) for i in members)
        if gbytes <= buffer_bytes:
            if used + gbytes > buffer_bytes:
                close()
            current += members
            used += gbytes
            continue
        close()  # a group larger than the buffer starts a chunk of its own and is split between tensors
        for i in members:
            if sizes[i] > buffer_bytes:
                close()
                chunks.append([i])
                continue
            if used + _align(sizes[i]) > buffer_bytes:
                close()
            current.append(i)
            used += _align(sizes[i])
        close()
    close()
    offsets = [0] * len(sizes)
    for chunk in chunks:
        off = 0
        for i in chunk:
            offsets[i] = off
            off = _align(off + sizes[i])
    return ChunkPlan(chunks, offsets, sizes)


def pack_into(buffer: torch.Tensor, plan: ChunkPlan, chunk: int, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Copy the chunk's tensors into ``buffer`` (uint8) at their offsets; return the used prefix."""
    for i, t in zip(plan.chunks[chunk], tensors):
        n = plan.sizes[i]
        buffer[plan.offsets[i] : plan.offsets[i] + n].copy_(t.contiguous().view(-1).view(torch.uint8))
    return buffer[: plan.chunk_bytes(chunk)]


def unpack(
    buffer: torch.Tensor, plan: ChunkPlan, chunk: int, shapes: Sequence[Sequence[int]], dtypes: Sequence[torch.dtype]
) -> list[torch.Tensor]:
    """Views of the chunk's tensors inside ``buffer`` (no copy)."""
    out = []
    for i in plan.chunks[chunk]:
        raw = buffer[plan.offsets[i] : plan.offsets[i] + plan.sizes[i]]
        out.append(raw.view(dtypes[i]).view(tuple(shapes[i])))
    return out
