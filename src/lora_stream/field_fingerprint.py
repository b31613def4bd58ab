"""A fingerprint of a tensor's elements that adds up over any partition of their positions and updates in O(changed).

The proof an element sync needs where no one process holds a whole tensor: a trainer rank fingerprints its own
range, an engine worker what it serves of it (a tensor-parallel slice, the row block of a fused tensor), and the
values add up to the whole tensor's, however the positions are cut. After a sync that changed ``k`` elements, the new
value is the old one plus ``k`` terms. Element syncs do not use it yet: on this project's CPU machine, updating it
costs more per changed element than :mod:`lora_stream.fingerprint` costs per element read (measured in
``docs/performance.md``), so today's syncs read and hash their ranges with that fingerprint instead.

**The form.** The element at flat position ``i`` of the whole tensor is read as the unsigned integer of its bits, plus
one: ``d_i = bits(x_i) + 1``, between 1 and ``2**32`` (dtypes of 1, 2 or 4 bytes; others are refused). For a key ``r``
in the prime field of ``p = 2**61 - 1``::

    F_r(x) = sum_i d_i * r**i   mod p

computed in two lanes with independent keys; a fingerprint is the pair. It reads bits, so ``-0.0`` and ``0.0`` differ,
and a NaN equals only the same NaN bits. The dtype and the shape are not part of it: whatever compares two
fingerprints compares those separately.

* **It adds up.** The fingerprint of positions ``[lo, hi)``, taken by whoever holds them, is ``sum d_i r**i`` over
  those ``i`` only: the sum, mod ``p``, of the fingerprints of any partition of the positions is the whole's
  (:func:`field_add`).
* **It updates.** Changing the elements at positions ``S`` changes each lane by ``sum_{i in S} (d'_i - d_i) r**i``
  (:func:`field_delta`): ``O(|S|)``.

**The bound.** For *any fixed pair* of distinct tensors over the same positions, chosen without knowing the key --
every edit a trainer, an optimizer or an engine makes, structured (sign flips, swapped or permuted elements, scaling by
powers of two) as much as random -- ``F_r(x) - F_r(y) = sum_i (d_i - e_i) r**i``. Each coefficient lies strictly
between ``-2**32`` and ``2**32``, so it is nonzero modulo ``p`` exactly where the tensors differ: the difference is a
nonzero polynomial in ``r`` of degree below ``n`` (the positions' span), with at most ``n - 1`` roots. Over a key
uniform in the field, one lane collides with probability at most ``(n - 1) / p``; the two lanes' keys are
independent, so both collide with probability at most ``((n - 1) / p)**2``. Positions are below
:data:`MAX_POSITIONS` (``2**40``); for a tensor of at most ``2**32`` elements the bound is ``2**-58``.
``tests/test_field_fingerprint.py`` checks the structured edits, the sums over partitions, the updates, and the bound's
construction on a small prime, where collisions are frequent enough to count.

**The key is the same everywhere**, as :mod:`lora_stream.fingerprint`'s: SHAKE-256 of :data:`KEY_LABEL` (Python's
``hashlib``, never torch's random stream), so that a trainer and an engine on different builds agree. The bound does
not hold against someone who reads the key and crafts an edit for it, which is not a way a weight changes.

**Cost.** Everything runs where the tensor lives. A whole tensor: each word cut into 16-bit halves, times the powers
``r**j`` of a block of :data:`BLOCK` positions cut into 21-bit limbs, summed per block in one float64 matrix product
(every sum is an integer below ``2**52``: exact); each block's sum is then scaled to its first position on the host,
a few integers per block. An update: per changed element, its power from three tables of :data:`BLOCK` entries and
the products in int64, each split into 31-bit halves before it is summed (no product or sum passes ``2**63``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

from .fingerprint import FingerprintError

__all__ = [
    "BLOCK",
    "KEY_ID",
    "KEY_LABEL",
    "MAX_POSITIONS",
    "P",
    "FieldFingerprint",
    "element_words",
    "field_add",
    "field_delta",
    "field_fingerprint",
    "field_reference",
]

#: The field's prime, ``2**61 - 1``.
P = (1 << 61) - 1
#: Positions per block of a whole-tensor fingerprint, and entries of each table of powers.
BLOCK = 1 << 14
#: Positions a fingerprint covers: three tables of :data:`BLOCK` powers reach ``2**42``; the bound is stated to
#: ``2**40``.
MAX_POSITIONS = 1 << 40
#: What the keys are expanded from (SHAKE-256): changing it changes every fingerprint.
KEY_LABEL = b"lora_stream.field_fingerprint, 2 lanes, p = 2**61 - 1, v1"
#: Elements of one batch of a whole-tensor fingerprint (temporaries: a few 8-byte values per element).
_BATCH = 1 << 20  # a multiple of BLOCK: every batch starts a block
_M31 = (1 << 31) - 1

#: A fingerprint: one field element per lane.
FieldFingerprint = tuple[int, int]


def _keys() -> tuple[int, int]:
    raw = hashlib.shake_256(KEY_LABEL).digest(64)
    keys = []
    for lane in range(2):
        # 8 bytes reduced into [2, p - 2]: a key of 0 or 1 would read no positions apart.
        k = int.from_bytes(raw[8 * lane : 8 * lane + 8], "little") % (P - 3) + 2
        keys.append(k)
    return keys[0], keys[1]


_KEYS = _keys()
#: A short name of the keys: two processes with the same ``KEY_ID`` fingerprint alike.
KEY_ID = hashlib.blake2b(repr((_KEYS, P)).encode(), digest_size=8).hexdigest()
_tables: dict[torch.device, torch.Tensor] = {}
_limbs: dict[torch.device, torch.Tensor] = {}


def _powers(device: torch.device) -> torch.Tensor:
    """``[lane, level, BLOCK]`` int64: ``r**(j * BLOCK**level)`` for ``j < BLOCK``, levels 0, 1, 2 (computed exactly
    with Python integers once per process, then kept on ``device``)."""
    t = _tables.get(device)
    if t is None:
        rows = []
        for r in _KEYS:
            for level in range(3):
                step = pow(r, BLOCK**level, P)
                row, x = [], 1
                for _ in range(BLOCK):
                    row.append(x)
                    x = x * step % P
                rows.append(row)
        t = torch.tensor(rows, dtype=torch.int64).view(2, 3, BLOCK).to(device)
        _tables[device] = t
    return t


def _limb_table(device: torch.device) -> torch.Tensor:
    """``[BLOCK, 6]`` float64: ``r**j`` of each lane cut into three 21-bit limbs (lane-major). A block's sums
    against 16-bit halves of the words are below ``2**17 * 2**21 * BLOCK = 2**52``: exact in float64, whatever order
    a matrix product adds them in."""
    t = _limbs.get(device)
    if t is None:
        powers = _powers(torch.device("cpu"))[:, 0]  # [lane, BLOCK]
        mask = (1 << 21) - 1
        cols = [(powers[lane] >> (21 * k)) & mask for lane in range(2) for k in range(3)]
        t = torch.stack(cols, 1).to(torch.float64).to(device)
        _limbs[device] = t
    return t


def _mulmod(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a * b mod p`` elementwise for int64 ``a``, ``b`` in ``[0, p)``: 31-bit halves, so that no product or sum
    passes ``2**63``."""
    a_hi, a_lo = a >> 31, a & _M31  # < 2**30, < 2**31
    b_hi, b_lo = b >> 31, b & _M31
    hh = a_hi * b_hi  # < 2**60; its weight 2**62 is 2 mod p
    mid = a_hi * b_lo + a_lo * b_hi  # < 2**62; weight 2**31
    ll = a_lo * b_lo  # < 2**62
    ll = (ll & P) + (ll >> 61)  # < 2**61 + 2
    # mid * 2**31 = (mid >> 30) * 2**61 + (mid & (2**30 - 1)) * 2**31, and 2**61 is 1 mod p.
    s = 2 * hh + (mid >> 30) + ((mid & ((1 << 30) - 1)) << 31) + ll  # < 3 * 2**61 + 2**32 < 2**63
    s = (s & P) + (s >> 61)
    return torch.where(s >= P, s - P, s)


def _dot(d: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``[..., 4]`` int64 partial sums over the last dimension of ``d * w`` (``d`` in ``[0, 2**32]``, ``w`` in
    ``[0, p)``), from which :func:`_combine` takes the value mod ``p``: each product is cut into 31-bit parts before
    it is summed, so that sums of up to ``2**31`` terms stay exact."""
    w_hi, w_lo = w >> 31, w & _M31
    t1 = d * w_hi  # < 2**62, weight 2**31
    t2 = d * w_lo  # < 2**63
    return torch.stack([(t1 >> 31).sum(-1), (t1 & _M31).sum(-1), (t2 >> 31).sum(-1), (t2 & _M31).sum(-1)], -1)


def _combine(parts: Sequence[int]) -> int:
    a, b, c, e = (int(x) for x in parts)
    return ((a << 62) + (b << 31) + (c << 31) + e) % P


def _bits(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``t`` flat (row-major) viewed as integers of its element size, and that size; refused
    (:class:`FingerprintError`) for what has no such bits: a dtype of another size, a quantized, meta or non-strided
    tensor."""
    if t.layout != torch.strided or t.is_meta or t.is_quantized:
        raise FingerprintError(f"a {t.layout} {t.dtype} tensor on {t.device} has no element bits to fingerprint")
    size = t.element_size()
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32}.get(size)
    if view is None:
        raise FingerprintError(f"{t.dtype}: elements of {size} bytes (the field fingerprint reads 1, 2 or 4)")
    return t.detach().reshape(-1).view(view), size


def _words(bits: torch.Tensor, size: int) -> torch.Tensor:
    """int64 ``bits + 1`` of ``bits`` (a slice of :func:`_bits`), unsigned."""
    words = bits.to(torch.int64)
    if size > 1:
        words = words & ((1 << (8 * size)) - 1)
    return words + 1


def element_words(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements, flat in row-major order, as int64 ``bits + 1``, on ``t``'s device (refused as
    :func:`field_fingerprint` refuses)."""
    return _words(*_bits(t))


def field_fingerprint(t: torch.Tensor, offset: int = 0) -> FieldFingerprint:
    """The fingerprint of ``t``'s elements (flat, row-major) at the positions ``offset, offset + 1, ...`` of the whole
    tensor they belong to: ``t`` may be a rank's range of it, a tensor-parallel slice's rows, or all of it."""
    n = t.numel()
    if offset < 0 or offset + n > MAX_POSITIONS:
        raise FingerprintError(f"positions [{offset}, {offset + n}) beyond the fingerprint's {MAX_POSITIONS}")
    bits, size = _bits(t)
    limbs = _limb_table(bits.device)
    out = [0, 0]
    steps = [pow(r, BLOCK, P) for r in _KEYS]
    # Blocks of BLOCK positions from the tensor's own start: block b covers offset + b*BLOCK + j. Each word is cut
    # into 16-bit halves, each half times each lane's limbs summed per block in one matrix product, exactly.
    halves = 2 if size == 4 else 1  # a 4-byte word in two 16-bit halves; a narrower one is its own low half
    for start in range(0, n, _BATCH):
        chunk = bits[start : start + _BATCH]
        m = chunk.numel()
        rows, rest = divmod(m, BLOCK)
        parts = []
        if size == 4:
            words = (chunk.to(torch.int64) & 0xFFFFFFFF) + 1
            cut = torch.stack([words & 0xFFFF, words >> 16], 0).to(torch.float64)
        else:
            mask = (1 << (8 * size)) - 1
            cut = ((chunk.to(torch.int32) & mask) + 1).to(torch.float64).view(1, m)
        if rows:
            parts.append(cut[:, : rows * BLOCK].reshape(halves, rows, BLOCK) @ limbs)
        if rest:
            parts.append(cut[:, rows * BLOCK :].reshape(halves, 1, rest) @ limbs[:rest])
        sums = torch.cat(parts, 1).to(torch.int64).tolist()  # [half, block, lane * 3 + limb]
        for lane in range(2):
            acc = 0
            for row in reversed(range(len(sums[0]))):  # Horner over the blocks: block b is scaled by r**(b * BLOCK)
                value = 0
                for half in range(halves):
                    limb = sums[half][row][3 * lane : 3 * lane + 3]
                    value += (limb[0] + (limb[1] << 21) + (limb[2] << 42)) << (16 * half)
                acc = (acc * steps[lane] + value) % P
            out[lane] = (out[lane] + acc * pow(_KEYS[lane], offset + start, P)) % P
    return out[0], out[1]


def field_delta(positions: torch.Tensor, old: torch.Tensor, new: torch.Tensor) -> FieldFingerprint:
    """What changing the elements at ``positions`` (int64, of the whole tensor) from ``old`` to ``new`` (one dtype)
    adds to a fingerprint: ``O(len(positions))``."""
    if positions.numel() == 0:
        return 0, 0
    if int(positions.min()) < 0 or int(positions.max()) >= MAX_POSITIONS:
        raise FingerprintError(f"a position beyond the fingerprint's {MAX_POSITIONS}")
    d_new, d_old = element_words(new), element_words(old)
    pos = positions.to(device=d_new.device, dtype=torch.int64).reshape(-1)
    table = _powers(d_new.device)
    far = int(pos.max()) >= 1 << 28
    out = []
    for lane in range(2):
        w = _mulmod(table[lane, 0][pos & (BLOCK - 1)], table[lane, 1][(pos >> 14) & (BLOCK - 1)])
        if far:  # positions past 2**28: the third table's factor
            w = _mulmod(w, table[lane, 2][pos >> 28])
        out.append((_combine(_dot(d_new, w).tolist()) - _combine(_dot(d_old, w).tolist())) % P)
    return out[0], out[1]


def field_add(*values: FieldFingerprint) -> FieldFingerprint:
    """The fingerprint of the union of disjoint positions, from each part's (or an update added to a value)."""
    return sum(v[0] for v in values) % P, sum(v[1] for v in values) % P


def field_reference(words: Sequence[int], offset: int = 0, keys: Sequence[int] = _KEYS, p: int = P) -> list[int]:
    """The definition, in Python integers, over ``words`` (each ``bits + 1``) at positions ``offset, ...``, for each
    key: what the tests hold :func:`field_fingerprint` to (and, on a small ``p``, the bound's construction)."""
    out = []
    for r in keys:
        x, acc = pow(r, offset, p), 0
        for d in words:
            acc = (acc + d * x) % p
            x = x * r % p
        out.append(acc)
    return out
