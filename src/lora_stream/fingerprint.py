"""A 64-bit fingerprint of a tensor's bytes, computed where the tensor lives, without communication.

What a sync that skips unchanged outputs (:mod:`lora_stream.changes`) compares, per rank, over that rank's own
shards of every frozen source. Version counters are not enough: ``param.data.copy_()`` and DeepSpeed's own writes
go through ``.data``, which bumps no counter. So the bytes are read: the tensor is viewed as 64-bit words (its tail
bytes one word each) and summed with pseudo-random odd weights, one per position, in wrapping 64-bit arithmetic,
block by block; each block's sum is mixed with its index. A change of any single word changes the sum (an odd
weight times a non-zero difference below 2**64 is never 0 modulo 2**64); several changes cancel with probability
about 2**-64. Dtype, shape and the byte count are part of the fingerprint.

Cost: one read of the tensor and one multiply-add per 8 bytes, on its device (measured in
``benchmarks/bench_skip.py``), and on a GPU a temporary of one block (:data:`BLOCK_WORDS` words).
"""

from __future__ import annotations

import hashlib

import torch

__all__ = ["BLOCK_WORDS", "fingerprint"]

#: Words (8 bytes) summed per block: the largest temporary a fingerprint allocates is one block of int64.
BLOCK_WORDS = 1 << 20
_MASK = (1 << 64) - 1
_weights: dict[torch.device, torch.Tensor] = {}


def _splitmix(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def _signed(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


def _block_weights(device: torch.device) -> torch.Tensor:
    w = _weights.get(device)
    if w is None:
        # Fixed pseudo-random odd weights, the same in every process (fingerprints are compared across syncs).
        gen = torch.Generator().manual_seed(0x10A5_57EA)
        hi = torch.randint(0, 1 << 31, (BLOCK_WORDS,), generator=gen, dtype=torch.int64)
        lo = torch.randint(0, 1 << 32, (BLOCK_WORDS,), generator=gen, dtype=torch.int64)
        w = ((hi << 32) | lo | 1).to(device)
        _weights[device] = w
    return w


def _weighted_sum(block: torch.Tensor, weights: torch.Tensor, dot: bool) -> torch.Tensor:
    """``sum(block * weights)`` in wrapping int64. On CPU (``dot``), int64 ``torch.dot`` wraps the same way without
    the block-sized temporary, whose fresh pages cost more than the arithmetic; other devices have no integer dot."""
    return torch.dot(block, weights) if dot else (block * weights).sum()


@torch.no_grad()
def fingerprint(t: torch.Tensor) -> int:
    """The fingerprint of ``t``'s bytes, dtype and shape (see the module docstring). Reads ``t`` only."""
    head = hashlib.blake2b(f"{t.dtype}|{tuple(t.shape)}".encode(), digest_size=8).digest()
    acc = int.from_bytes(head, "little")
    if t.numel() == 0:
        return acc
    flat = t.detach().contiguous().view(-1).view(torch.uint8)
    n = flat.numel()
    words = n // 8
    w = _block_weights(flat.device)
    sums: list[torch.Tensor] = []
    if words:
        main = flat[: words * 8].view(torch.int64)
        on_cpu = flat.device.type == "cpu"
        for start in range(0, words, BLOCK_WORDS):
            block = main[start : start + BLOCK_WORDS]
            sums.append(_weighted_sum(block, w[: block.numel()], on_cpu))
    tail = flat[words * 8 :]
    if tail.numel():
        sums.append((tail.to(torch.int64) * w[: tail.numel()]).sum())
    values = torch.stack(sums).tolist() if sums else []  # one device sync for every block
    for i, v in enumerate(values):
        acc = _splitmix(acc ^ ((v * (2 * _splitmix(i + n) + 1)) & _MASK))
    return _signed(acc)
