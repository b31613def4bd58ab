"""A 64-bit fingerprint of a tensor's bytes, computed where the tensor lives, without communication.

What a sync that skips unchanged outputs (:mod:`lora_stream.changes`) compares, per rank, over that rank's own
shards of every frozen source, and what an engine compares its held state and its kept base with. Version counters
are not enough: ``param.data.copy_()`` and DeepSpeed's own writes go through ``.data``, which bumps no counter. So
the bytes are read, and "unchanged" is a proof only if no *edit* of the bytes -- random or structured (sign flips,
scaling by powers of two, swapped rows, permutations) -- can keep the fingerprint. A weighted sum of words cannot
promise that: it is linear, so two changes of ``2**63`` (two sign bits) cancel every time.

**The hash.** The tensor's bytes are read as 64-bit words (the last, partial word zero-padded; the byte count is
hashed too) and cut into blocks of :data:`BLOCK_WORDS` words. Each block is hashed by NH, the universal hash of
UMAC (Black et al., CRYPTO 1999), over the word's two 32-bit halves ``lo`` and ``hi``, in two lanes with independent
keys ``k``::

    NH_k(block) = sum_i ((lo_i + klo_i) mod 2**32) * ((hi_i + khi_i) mod 2**32)   mod 2**64

Every bit of every word reaches the result through a product of two key-dependent terms, so nothing is linear in
the data. The dtype, the shape, the byte count and the sequence of block values are then hashed by BLAKE2b
(a cryptographic hash, on the host: two words per block).

**The bound.** For *any fixed pair* of distinct tensors of one dtype and shape (chosen without knowing the key:
every edit a trainer, an optimizer or an engine makes), the probability over the key that the fingerprints are
equal is at most ``2**-64`` for NH (``2**-32`` per lane, the lanes' keys independent; UMAC's theorem for NH on
equal-length inputs) plus BLAKE2b's 64-bit collision probability, ``2**-64``: at most ``2**-63``. Tensors of other
dtypes or shapes differ in what BLAKE2b reads. The key is fixed (the same pseudo-random words in every process, since
fingerprints recorded by one process are compared with those of another); the bound does not hold against someone
who reads this key and crafts an edit for it, which is not a way a weight changes. ``tests/test_fingerprint.py``
checks the structured edits in every dtype at every parity, and the bound's construction itself on a reduced word
size, where collisions are frequent enough to count.

Cost: on its device, a few elementwise passes per block (measured in ``benchmarks/bench_skip.py`` and in
``docs/performance.md``); the temporaries are a few blocks of int64 (:data:`CHUNK_WORDS`), never a copy of the
tensor, and one device-to-host transfer of the block values per tensor.
"""

from __future__ import annotations

import hashlib

import torch

__all__ = ["BLOCK_WORDS", "CHUNK_WORDS", "fingerprint", "fingerprint_of", "nh_reference"]

#: Words (8 bytes) per NH block: the key's length.
BLOCK_WORDS = 1 << 15
#: Words hashed per batch of blocks, with one set of temporaries (24 bytes a word): what a fingerprint allocates.
CHUNK_WORDS = 1 << 19
_LANES = 2
_keys: dict[torch.device, torch.Tensor] = {}


def _key(device: torch.device) -> torch.Tensor:
    """``[lane, half, BLOCK_WORDS]`` int32 key words (any 32-bit pattern): the same in every process."""
    k = _keys.get(device)
    if k is None:
        gen = torch.Generator().manual_seed(0x10A5_57EA_2026)
        k = torch.randint(-(1 << 31), 1 << 31, (_LANES, 2, BLOCK_WORDS), generator=gen, dtype=torch.int32).to(device)
        _keys[device] = k
    return k


class _NH:
    """NH over ``[blocks, n]`` blocks of 64-bit words, with the temporaries of one chunk allocated once.

    The words are read as int32 halves (``lo``, ``hi``: little-endian). ``lo + klo`` in int32 wraps, which is the
    sum modulo ``2**32`` bit for bit; it is written into the low half of a zeroed int64, which is then that sum as an
    unsigned value below ``2**32``. The product of two such values fits in 64 bits unsigned, and int64 arithmetic
    wraps, so the products' sum is NH modulo ``2**64``."""

    def __init__(self, key: torch.Tensor, words: int) -> None:
        self.key = key
        cap = min(words, CHUNK_WORDS)
        self._zx = torch.zeros(2, cap, 2, dtype=torch.int32, device=key.device)  # the high halves stay 0
        self._prod = torch.empty(cap, dtype=torch.int64, device=key.device)

    def __call__(self, words: torch.Tensor) -> torch.Tensor:
        """``[blocks * lanes]`` int64: NH of each row of ``words`` (``[blocks, n]`` int64) in each lane."""
        blocks, n = words.shape
        count = blocks * n
        halves = words.view(torch.int32).view(blocks, n, 2).permute(2, 0, 1)  # [lo/hi, blocks, n]
        zx = self._zx[:, :count].view(2, blocks, n, 2)
        wide = self._zx[:, :count].view(torch.int64).view(2, blocks, n)
        prod = self._prod[:count].view(blocks, n)
        out = []
        for lane in range(self.key.shape[0]):
            torch.add(halves, self.key[lane, :, None, :n], out=zx[..., 0])
            torch.mul(wide[0], wide[1], out=prod)
            out.append(prod.sum(dim=-1))
        return torch.stack(out, dim=-1).view(-1)


def nh_reference(words: torch.Tensor, key: torch.Tensor, half_bits: int = 32) -> torch.Tensor:
    """NH written as its definition, for tests: each row of ``words`` (``[blocks, n]`` int64 holding
    ``2 * half_bits``-bit words) in each lane of ``key`` (``[lanes, 2, >= n]``, any integers), ``[blocks, lanes]``,
    modulo ``2**(2 * half_bits)``. At 32 bits it equals :func:`fingerprint`'s fast form; at fewer bits collisions
    are frequent enough to count against the bound ``2**-half_bits`` per lane."""
    mask = (1 << half_bits) - 1
    n = words.shape[-1]
    lo = words & mask
    hi = (words >> half_bits) & mask
    out = []
    for lane in range(key.shape[0]):
        a = (lo + (key[lane, 0, :n].to(torch.int64) & mask)) & mask
        b = (hi + (key[lane, 1, :n].to(torch.int64) & mask)) & mask
        total = (a * b).sum(dim=-1)  # wraps modulo 2**64
        out.append(total if half_bits == 32 else total & ((1 << 2 * half_bits) - 1))
    return torch.stack(out, dim=-1)


@torch.no_grad()
def fingerprint(t: torch.Tensor) -> int:
    """The fingerprint of ``t``'s bytes, dtype and shape (see the module docstring). Reads ``t`` only."""
    head = hashlib.blake2b(digest_size=8)
    flat = t.detach().contiguous().view(-1).view(torch.uint8) if t.numel() else None
    n = 0 if flat is None else flat.numel()
    head.update(f"{t.dtype}|{tuple(t.shape)}|{n}".encode())
    if flat is None:
        return _signed(int.from_bytes(head.digest(), "little"))
    whole = n // 8
    nh = _NH(_key(flat.device), max(whole, 1))
    values: list[torch.Tensor] = []
    main = flat[: whole * 8].view(torch.int64)
    for start in range(0, whole, CHUNK_WORDS):
        chunk = main[start : start + CHUNK_WORDS]
        full = chunk.numel() // BLOCK_WORDS * BLOCK_WORDS
        if full:
            values.append(nh(chunk[:full].view(-1, BLOCK_WORDS)))
        if full < chunk.numel():
            values.append(nh(chunk[full:].view(1, -1)))
    if n % 8:  # the last, partial word, zero-padded, as a block of its own (the byte count is hashed above)
        padded = torch.zeros(8, dtype=torch.uint8, device=flat.device)
        padded[: n % 8] = flat[whole * 8 :]
        values.append(nh(padded.view(torch.int64).view(1, 1)))
    lanes = torch.cat(values).cpu()  # the block values only: 16 bytes per block, one transfer
    head.update(lanes.numpy().tobytes())
    return _signed(int.from_bytes(head.digest(), "little"))


def fingerprint_of(local: torch.Tensor | tuple[torch.Tensor, ...]) -> int:
    """The fingerprint of what a gatherer's ``local_shard`` returned: one tensor, or every buffer a gather may read
    (a ZeRO-3 parameter kept whole has its partition and its whole ``.data``), each hashed and the results
    hashed together."""
    if isinstance(local, torch.Tensor):
        return fingerprint(local)
    raw = b"".join((fingerprint(t) & ((1 << 64) - 1)).to_bytes(8, "little") for t in local)
    return _signed(int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little"))


def _signed(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x
