"""A position-keyed linear fingerprint of a range of a tensor's bytes: it decomposes over any partition of the
positions and updates in O(changed).

What an element sync proves with (:mod:`lora_stream.element_diff` on the trainer, :mod:`lora_stream.engine.elements`
on the engine). :mod:`lora_stream.fingerprint`'s NH hash proves a whole tensor, but its value of a range says nothing
of the whole's, and it cannot follow a change without reading everything again. This one can: a rank's range, a
tensor-parallel slice or a fused block is fingerprinted on its own, the pieces' values add up to the whole's, and a
sync that changed ``k`` elements moves a fingerprint in ``O(k)``.

**The form.** A tensor's bytes, in logical (row-major) order, are read as *limbs*: 16-bit little-endian words (a
one-byte dtype: its bytes). Limb ``q`` of the whole checkpoint tensor (element ``i`` has limbs ``q = i * L + j``, ``L``
limbs an element) is lifted to ``t_q`` in ``[1, 2**16]`` (the limb read as a signed 16-bit integer, plus
``2**15 + 1``; a byte, plus 1); over the prime field of ``P = 2**61 - 1``::

    F(range) = sum over the range's limbs q of  w(q) * t_q   mod P,     w(q) = A[q mod B] * C[q div B]   mod P

with ``B`` = :data:`BLOCK_LIMBS` and ``A``, ``C`` tables of field elements (the key). ``F`` of a union of disjoint
ranges is the sum of their ``F`` (mod ``P``); a change of limb ``q`` from ``u`` to ``v`` moves ``F`` by
``w(q) * (v - u)``. No limb lifts to 0, so a zero limb counts: a range of zeros does not fingerprint as an empty
one.

**The bound.** For *any fixed pair* of distinct contents of one range (chosen without knowing the key: every edit a
trainer, an optimizer or an engine makes, sign flips, swaps, permutations and powers of two included), the
probability over the key that ``F`` is equal is at most ``2 / P`` (below ``2**-59.99``). The difference of two limbs
is a nonzero integer of magnitude below ``2**16``, so nonzero mod ``P``. Take a block ``b`` in which the pair differs;
its inner sum ``S_b = sum_j A[j] * v_{bB+j}`` differs with probability at least ``1 - 1/P`` over ``A`` (a nonzero
linear form in a uniform ``A[j]``); given that, ``sum_b C[b] * S_b`` differs with probability at least ``1 - 1/P``
over ``C``. Ranges of other dtypes are not compared (a segment carries its dtype). The key is fixed (the same in
every process: the trainer's and the engine's values are compared), so the bound does not hold against someone who
reads the key and crafts an edit for it, which is not how a weight changes. Being linear, it is the one hash here
that a chosen *difference* defeats -- two changes that cancel need ``w(q)`` -- which is why the key is random and
uniform, and why ``tests/test_linear_fingerprint.py`` checks structured edits and the bound itself on a small prime.

**The key.** ``A`` and ``C`` are SHAKE-256 of fixed labels (:data:`KEY_LABEL`), read as little-endian 64-bit words
and reduced to 61 bits (``2**61 - 1`` maps to 0: a bias of ``2**-61``), never torch's random stream; ``C`` grows
with the largest tensor seen (a SHAKE output is a prefix of every longer one). :data:`KEY_ID` names it.

**Exact arithmetic.** On the tensor's device: a block's inner sums are one float64 matrix product with ``A`` split
into limbs of 21, 21 and 19 bits, so each term (at most ``2**16 * 2**21``) and each block's sum (below ``2**52``) is
an integer a double holds exactly, whatever order the sum is taken in; the rest is int64, products of two field
elements split into 31- and 30-bit halves and reduced with ``2**61 = 1 mod P``. No product or sum overflows.

Cost: one read of the range's bytes on its device, converted a chunk at a time into one reused float64 buffer
(never a copy of the range), one matrix product per chunk, and one device-to-host transfer of each block's three
sums. An update: a gather and a scatter per changed limb.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterator

import torch

__all__ = [
    "BLOCK_LIMBS",
    "KEY_ID",
    "KEY_LABEL",
    "P",
    "UPDATE_PAYS_BELOW",
    "combine",
    "limbs_per_element",
    "linear_fingerprint",
    "linear_update",
]

#: The field's prime (a Mersenne prime: reducing is a shift and an add).
P = (1 << 61) - 1
#: Limbs per inner block: ``A``'s length. A block's sums against ``A``'s three limbs stay below ``2**52``.
BLOCK_LIMBS = 1 << 15
#: Blocks converted to float64 at a time (a chunk of ``CHUNK_BLOCKS * BLOCK_LIMBS`` limbs): the scratch buffer's size.
CHUNK_BLOCKS = 16
#: The fraction of a range's elements changed below which :func:`linear_update` costs less than reading the range
#: again with :func:`linear_fingerprint` (the two give the same value). On a 2-core CPU an update costs about 70
#: times a read per element (``benchmarks/bench_linear_fingerprint.py``: a gather and a scatter per changed limb
#: against one pass of a matrix product), so a caller updates below ``1/64`` and reads above it.
UPDATE_PAYS_BELOW = 1 / 64
#: What the key is expanded from (SHAKE-256): changing it changes every linear fingerprint.
KEY_LABEL = b"lora_stream.linear_fingerprint, P = 2**61 - 1, 32768-limb blocks, v1"
KEY_ID = hashlib.blake2b(KEY_LABEL, digest_size=8).hexdigest()

_MASK31 = (1 << 31) - 1
_MASK21 = (1 << 21) - 1
#: Up to this many blocks, a range's block sums are reduced in the field with Python's integers.
_FEW_BLOCKS = 256
_tables: dict[tuple[str, torch.device], torch.Tensor] = {}
_local = threading.local()


def _field(label: bytes, n: int) -> list[int]:
    raw = hashlib.shake_256(KEY_LABEL + label).digest(8 * n)
    return [w & P if (w & P) != P else 0 for w in (int.from_bytes(raw[8 * i : 8 * i + 8], "little") for i in range(n))]


def _inner(device: torch.device) -> torch.Tensor:
    """``[3, BLOCK_LIMBS]`` float64: ``A`` in three limbs of 21, 21 and 19 bits (each exact in a double)."""
    t = _tables.get(("A", device))
    if t is None:
        a = torch.tensor(_field(b"|A", BLOCK_LIMBS), dtype=torch.int64)
        t = torch.stack([a & _MASK21, (a >> 21) & _MASK21, a >> 42]).to(torch.float64).to(device)
        _tables[("A", device)] = t
    return t


def _inner_sum(device: torch.device) -> torch.Tensor:
    """``[3]``: each limb of ``A`` summed over a whole block."""
    t = _tables.get(("A+", device))
    if t is None:
        t = _tables[("A+", device)] = _inner(device).sum(1)
    return t


def _outer(device: torch.device, blocks: int) -> torch.Tensor:
    """``C`` for at least ``blocks`` blocks (grown by doubling; a longer SHAKE output starts with the shorter)."""
    t = _tables.get(("C", device))
    if t is None or t.numel() < blocks:
        n = max(blocks, 2 * (t.numel() if t is not None else 64))
        t = torch.tensor(_field(b"|C", n), dtype=torch.int64).to(device)
        _tables[("C", device)] = t
    return t


def _scratch(device: torch.device) -> torch.Tensor:
    """This thread's float64 buffer of one chunk on ``device``: converting each chunk into a new tensor costs more
    than reading it (fresh pages, on the host), so the conversion reuses one."""
    held: dict[torch.device, torch.Tensor] = _local.__dict__.setdefault("scratch", {})
    t = held.get(device)
    if t is None:
        t = held[device] = torch.empty(CHUNK_BLOCKS * BLOCK_LIMBS, dtype=torch.float64, device=device)
    return t


def _mod(x: torch.Tensor) -> torch.Tensor:
    """``x mod P`` for ``0 <= x < 2**63``."""
    r = (x & P) + (x >> 61)
    return torch.where(r >= P, r - P, r)


def _shift(x: torch.Tensor, s: int) -> torch.Tensor:
    """``x * 2**s mod P`` for ``0 <= x < P``: the bits that pass bit 61 come back at bit 0."""
    return _mod(((x & ((1 << (61 - s)) - 1)) << s) + (x >> (61 - s)))


def _mulmod(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a * b mod P`` elementwise, for ``0 <= a, b < P``, in int64 without overflow (halves of 31 and 30 bits)."""
    a0, a1 = a & _MASK31, a >> 31
    b0, b1 = b & _MASK31, b >> 31
    high = _mod(2 * (a1 * b1))  # a1 * b1 * 2**62, and 2**62 = 2 mod P
    middle = _shift(_mod(a1 * b0 + a0 * b1), 31)
    return _mod(high + middle + _mod(a0 * b0))


def _sum_mod(x: torch.Tensor) -> torch.Tensor:
    """``sum(x) mod P`` for field elements ``x`` (fewer than ``2**32``): their 31-bit halves summed apart."""
    return _mod(_mod((x & _MASK31).sum()) + _shift(_mod((x >> 31).sum()), 31))


def limbs_per_element(dtype: torch.dtype) -> int:
    """Limbs of one element of ``dtype``: 16-bit words, or one per byte for one-byte dtypes."""
    size = torch.empty((), dtype=dtype).element_size()
    return 1 if size == 1 else size // 2


#: What lifts a limb read as a signed integer (``int16``) or a byte (``uint8``) to ``t_q`` in ``[1, 2**16]``.
_LIFT = {torch.int16: 32769, torch.uint8: 1}


def _limbs(t: torch.Tensor) -> torch.Tensor:
    """A flat, contiguous ``t``'s limbs as an integer view (``int16`` or ``uint8``): no copy."""
    if t.is_quantized or t.layout != torch.strided or t.device.type == "meta":
        raise ValueError(f"a linear fingerprint reads plain strided tensors, not {t.dtype} on {t.device}")
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int16)


def _pieces(t: torch.Tensor) -> Iterator[torch.Tensor]:
    """``t``'s elements in logical order, as flat contiguous views (a non-contiguous tensor: row by row)."""
    if t.is_contiguous():
        yield t.reshape(-1)
    elif t.dim() <= 1:
        yield t.contiguous()  # a strided vector: its elements, copied (one row at most)
    else:
        for row in t:
            yield from _pieces(row)


def _sum_range(v: torch.Tensor, q0: int) -> int:
    """``sum w(q) * t_q mod P`` over limbs ``v`` (an integer view) at positions ``q0, q0 + 1,
    ...``. Each block's inner sums are one float64 matrix product with the limbs as read (``sum_j A[j] * s_j``),
    plus the lift times the sum of ``A`` over the block's positions: the limbs are converted a chunk at a time into
    one reused buffer, never padded; exact, since every term and sum is an integer below ``2**52`` in magnitude.
    The blocks' sums are reduced in the field once, at the end."""
    device = v.device
    a = _inner(device)  # [3, BLOCK_LIMBS]
    scratch = _scratch(device)
    lift = float(_LIFT[v.dtype])
    sums: list[torch.Tensor] = []  # [3, blocks] each, consecutive blocks from q0's
    at, n = 0, v.numel()
    while at < n:
        head = (q0 + at) % BLOCK_LIMBS
        m = min(n - at, CHUNK_BLOCKS * BLOCK_LIMBS - head)  # up to a block boundary, or the range's end
        x = scratch[:m].copy_(v[at : at + m])
        h = min(m, (BLOCK_LIMBS - head) % BLOCK_LIMBS)  # limbs before the first block boundary
        full = (m - h) // BLOCK_LIMBS
        end = h + full * BLOCK_LIMBS
        if h:
            part = a[:, head : head + h]
            sums.append((part @ x[:h] + lift * part.sum(1)).unsqueeze(1))
        if full:
            sums.append(a @ x[h:end].view(full, BLOCK_LIMBS).t() + lift * _inner_sum(device).unsqueeze(1))
        if m - end:
            part = a[:, : m - end]
            sums.append((part @ x[end:] + lift * part.sum(1)).unsqueeze(1))
        at += m
    parts = (sums[0] if len(sums) == 1 else torch.cat(sums, 1)).to(torch.int64)  # in [0, 2**52)
    return _outer_sum(parts, q0 // BLOCK_LIMBS)


def _outer_sum(parts: torch.Tensor, b0: int) -> int:
    """The form's outer level: ``sum_b C[b0 + b] * S_b mod P``, from each block's inner sum ``S_b`` given in ``A``'s
    three limbs (``parts``: int64 ``[3, blocks]``, each in ``[0, P)``; ``S_b = p0 + p1 * 2**21 + p2 * 2**42``)."""
    blocks = parts.shape[1]
    c = _outer(parts.device, b0 + blocks)[b0 : b0 + blocks]
    if blocks <= _FEW_BLOCKS:  # Python's integers: fewer steps than a dozen tensor operations on a few values
        rows: list[list[int]] = parts.tolist()
        weights: list[int] = c.tolist()
        total = sum(w * (x + (y << 21) + (z << 42)) for w, x, y, z in zip(weights, *rows, strict=True))
        return int(total) % P
    inner = _mod(_mod(parts[0] + _shift(parts[1], 21)) + _shift(parts[2], 42))
    return int(_sum_mod(_mulmod(c, inner)))


@torch.no_grad()
def linear_fingerprint(t: torch.Tensor, offset: int = 0) -> int:
    """``F`` of ``t``'s elements as the range of a flat checkpoint tensor that starts at element ``offset``, computed on
    ``t``'s device: the fingerprints of consecutive ranges :func:`combine` into the whole's."""
    if offset < 0:
        raise ValueError(f"a range starts at element {offset}")
    t = t.detach()
    per = limbs_per_element(t.dtype)
    total, at = 0, offset
    for piece in _pieces(t):
        if piece.numel():
            total = (total + _sum_range(_limbs(piece), at * per)) % P
        at += piece.numel()
    return total


def combine(values: Iterator[int] | list[int]) -> int:
    """The fingerprint of the union of disjoint ranges, from theirs."""
    return sum(values) % P


@torch.no_grad()
def linear_update(fp: int, index: torch.Tensor, old: torch.Tensor, new: torch.Tensor, offset: int = 0) -> int:
    """``fp`` moved by the change of the elements at flat ``index`` (of the range that starts at element ``offset``)
    from ``old`` to ``new`` (one dtype): ``O(len(index))``, on ``index``'s device. Equal to :func:`linear_fingerprint`
    of the changed range when ``fp`` was the unchanged range's."""
    if old.dtype != new.dtype or old.numel() != new.numel() or index.numel() != new.numel():
        raise ValueError("a linear update needs one old and one new value of one dtype per index")
    if not index.numel():
        return fp % P
    device = index.device
    per = limbs_per_element(new.dtype)
    was = _limbs(old.detach().reshape(-1).contiguous().to(device)).to(torch.int64).view(-1, per)
    now = _limbs(new.detach().reshape(-1).contiguous().to(device)).to(torch.int64).view(-1, per)
    q = ((index.to(torch.int64).reshape(-1, 1) + offset) * per + torch.arange(per, device=device)).reshape(-1)
    delta = (now - was).reshape(-1).to(torch.float64)  # a difference of lifted limbs: |.| < 2**16
    # The change per block, sum_j A[j] * delta_j, as the full read forms it: in float64 against A's three limbs,
    # each term below 2**37 and each block's sum below 2**52 in magnitude (integers a double holds exactly, added in
    # any order), then C per block in the field.
    blocks = q // BLOCK_LIMBS
    first, last = int(blocks.min()), int(blocks.max())
    acc = torch.zeros(3, last - first + 1, dtype=torch.float64, device=device)
    acc.index_add_(1, blocks - first, _inner(device)[:, q % BLOCK_LIMBS] * delta)
    # |.| < 2**52 < P: one P makes each a residue.
    return (fp + _outer_sum(_mod(acc.to(torch.int64) + P), first)) % P
