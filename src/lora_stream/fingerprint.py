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

**The key is the same everywhere.** A trainer and an engine compare fingerprints computed in different processes,
often on different torch builds (a training image and a vLLM image), so the key cannot come from torch's random
stream, whose output a build may change: it is SHAKE-256 of a fixed label (:data:`KEY_LABEL`, Python's
``hashlib``), read as little-endian 32-bit words, and :data:`KEY_ID` names it. The NH arithmetic itself (32-bit
sums and 64-bit products that wrap) is the same on every build and device. ``tests/test_fingerprint_edges.py`` pins
the key and a fingerprint to fixed values, and checks that the key is computed with torch's random stream broken.

**Every tensor is read exactly, or refused.** What is hashed is the tensor's bytes in logical (row-major) order,
wherever it lives:

* a contiguous tensor whose bytes start at a multiple of 8 is read in place as words;
* a tensor whose bytes do not (a view at an odd offset: ``int64`` cannot view it) or that is not contiguous is read
  in slabs of at most :data:`CHUNK_WORDS` words, copied into an aligned buffer of that size: the same words, so the
  same value as an aligned copy of it, with memory bounded (never a copy of the whole tensor);
* a quantized tensor (``torch.qint8``, ``quint8``, ``qint32``, ``quint4x2``: their storage cannot be viewed as bytes,
  and trying crashes the process) is its integer representation (``int_repr()``) with its quantizer: the scheme,
  the scale and zero point (per tensor), or the axis and the fingerprints of the scales and zero points (per
  channel);
* when the device runs out of memory, the same words are hashed on the host instead (same key, same integer
  arithmetic: the same value);
* a meta tensor, a non-strided layout (sparse, mkldnn) and anything whose bytes still cannot be read raise
  :class:`FingerprintError` with the reason: never a guess. The engine's state digest
  (:mod:`lora_stream.engine.state_digest`) turns that into a difference that names the tensor and the reason, so
  the sync is full and ``full_because`` says why.

Cost: on its device, a few elementwise passes per block (measured in ``benchmarks/bench_skip.py`` and in
``docs/performance.md``); the temporaries are a few blocks of int64 (:data:`CHUNK_WORDS`), never a copy of the
tensor (a non-contiguous or unaligned one is copied a slab at a time), and one device-to-host transfer of the block
values per tensor.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Iterator

import torch

from .errors import LoraStreamError

__all__ = [
    "BLOCK_WORDS",
    "CHUNK_WORDS",
    "KEY_ID",
    "KEY_LABEL",
    "FingerprintError",
    "RunningFingerprint",
    "fingerprint",
    "fingerprint_of",
    "nh_reference",
]

#: Words (8 bytes) per NH block: the key's length.
BLOCK_WORDS = 1 << 15
#: Words hashed per batch of blocks, with one set of temporaries (24 bytes a word): what a fingerprint allocates.
CHUNK_WORDS = 1 << 19
_LANES = 2
#: What the key is expanded from (SHAKE-256): changing it changes every fingerprint.
KEY_LABEL = b"lora_stream.fingerprint NH key, 2 lanes x 2 halves x 32768 words, v2"


def _key_bytes() -> bytes:
    return hashlib.shake_256(KEY_LABEL).digest(_LANES * 2 * BLOCK_WORDS * 4)


#: A short name of the key (BLAKE2b of its bytes): two processes with the same ``KEY_ID`` fingerprint alike.
KEY_ID = hashlib.blake2b(_key_bytes(), digest_size=8).hexdigest()
_keys: dict[torch.device, torch.Tensor] = {}


class FingerprintError(LoraStreamError):
    """A tensor whose bytes cannot be fingerprinted exactly (the message says which and why): never guessed."""


def _key(device: torch.device) -> torch.Tensor:
    """``[lane, half, BLOCK_WORDS]`` int32 key words (any 32-bit pattern): the same in every process and on every
    torch build, because they come from ``hashlib`` (SHAKE-256 of :data:`KEY_LABEL`), read as little-endian words
    whatever the host's byte order, and never from torch's random stream."""
    k = _keys.get(device)
    if k is None:
        raw = _key_bytes()
        words = struct.unpack(f"<{len(raw) // 4}i", raw)
        k = torch.tensor(words, dtype=torch.int32).view(_LANES, 2, BLOCK_WORDS).to(device)
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


def _words(words: torch.Tensor, nh: _NH, values: list[torch.Tensor]) -> None:
    """Hash consecutive words (at most :data:`CHUNK_WORDS`, starting at a block boundary): the full blocks, then
    the last, partial block as a block of its own."""
    full = words.numel() // BLOCK_WORDS * BLOCK_WORDS
    if full:
        values.append(nh(words[:full].view(-1, BLOCK_WORDS)))
    if full < words.numel():
        values.append(nh(words[full:].view(1, -1)))


def _in_place(t: torch.Tensor) -> torch.Tensor | None:
    """``t``'s bytes as a flat ``uint8`` view that ``int64`` can view, or ``None`` (not contiguous, or its bytes do
    not start at a multiple of 8: a view at an odd offset, which ``view(torch.int64)`` refuses, and which a device
    could not read as words anyway)."""
    if not t.is_contiguous():
        return None
    if (t.storage_offset() * t.element_size()) % 8 or t.data_ptr() % 8:
        return None
    return t.reshape(-1).view(torch.uint8)


def _lanes_in_place(flat: torch.Tensor, nh: _NH | None = None) -> torch.Tensor:
    """The block values of an aligned, contiguous tensor's bytes (``flat``), read in place; with ``nh``'s
    temporaries (on ``flat``'s device, for at least ``min(words, CHUNK_WORDS)`` words) where given."""
    n = flat.numel()
    whole = n // 8
    nh = nh if nh is not None else _NH(_key(flat.device), max(whole, 1))
    values: list[torch.Tensor] = []
    main = flat[: whole * 8].view(torch.int64)
    for start in range(0, whole, CHUNK_WORDS):
        _words(main[start : start + CHUNK_WORDS], nh, values)
    if n % 8:  # the last, partial word, zero-padded, as a block of its own (the byte count is hashed too)
        padded = torch.zeros(8, dtype=torch.uint8, device=flat.device)
        padded[: n % 8] = flat[whole * 8 :]
        values.append(nh(padded.view(torch.int64).view(1, 1)))
    return torch.cat(values).cpu()


def _slabs(t: torch.Tensor, limit: int) -> Iterator[torch.Tensor]:
    """``t``'s bytes in logical order, as flat contiguous ``uint8`` pieces of at most ``limit`` bytes (a
    non-contiguous tensor is copied a slab of rows at a time, on its device: never the whole of it)."""
    if t.is_contiguous():
        flat = t.reshape(-1).view(torch.uint8)  # uint8 views any offset: no copy
        for start in range(0, flat.numel(), limit):
            yield flat[start : start + limit]
        return
    row = (t.numel() // t.shape[0]) * t.element_size()
    if row > limit:  # one row is too big: its own rows, in order (t.dim() > 1 here: a 1-d row is one element)
        for i in range(t.shape[0]):
            yield from _slabs(t[i], limit)
        return
    rows = max(1, limit // row)
    for start in range(0, t.shape[0], rows):
        yield t[start : start + rows].contiguous().reshape(-1).view(torch.uint8)


def _lanes_copied(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The block values of ``t``'s bytes, copied slab by slab into an aligned buffer of at most
    :data:`CHUNK_WORDS` words on ``device`` and hashed there: the same words in the same blocks as
    :func:`_lanes_in_place` reads from an aligned copy of ``t``, so the same values."""
    n = t.numel() * t.element_size()
    cap = min(-(-n // 8), CHUNK_WORDS)  # words; a multiple of BLOCK_WORDS whenever there is more than one chunk
    buf = torch.zeros(cap, dtype=torch.int64, device=device)
    raw = buf.view(torch.uint8)
    nh = _NH(_key(device), cap)
    values: list[torch.Tensor] = []
    fill = 0
    for piece in _slabs(t, CHUNK_WORDS * 8):
        at = 0
        while at < piece.numel():
            take = min(cap * 8 - fill, piece.numel() - at)
            raw[fill : fill + take].copy_(piece[at : at + take])  # across devices too: contiguous, no temporary
            fill += take
            at += take
            if fill == cap * 8:  # a whole chunk: only the very last one can end before a block boundary
                _words(buf, nh, values)
                fill = 0
    whole = fill // 8
    if whole:
        _words(buf[:whole], nh, values)
    if fill % 8:  # the last, partial word, zero-padded, as a block of its own (as _lanes_in_place)
        raw[fill : (whole + 1) * 8].zero_()
        values.append(nh(buf[whole : whole + 1].view(1, 1)))
    return torch.cat(values).cpu()


def _out_of_memory(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or (isinstance(e, RuntimeError) and "out of memory" in str(e))


def _where(t: torch.Tensor, what: str | None) -> str:
    """Which tensor, on which rank, for a refusal."""
    rank = ""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        rank = f" on rank {torch.distributed.get_rank()}"
    name = what or "a tensor"
    return f"{name} ({t.dtype}, shape {tuple(t.shape)}, {t.device}){rank}"


@torch.no_grad()
def fingerprint(t: torch.Tensor, what: str | None = None) -> int:
    """The fingerprint of ``t``'s bytes, dtype and shape (see the module docstring). Reads ``t`` only. ``what``
    names the tensor in a :class:`FingerprintError` (raised where its bytes cannot be read exactly)."""
    t = t.detach()
    if t.is_meta or t.device.type == "meta":
        raise FingerprintError(f"cannot fingerprint {_where(t, what)}: a meta tensor holds no bytes")
    if t.layout != torch.strided:
        raise FingerprintError(
            f"cannot fingerprint {_where(t, what)}: its {t.layout} layout does not hold its values as bytes in order"
        )
    if t.is_quantized:  # before any view: viewing a quantized tensor's storage as bytes crashes the process
        return _quantized(t, what)
    if t.is_conj() or t.is_neg():  # a lazy conjugate/negation: the values it serves, not the bytes under it
        t = t.resolve_conj().resolve_neg()
    n = t.numel() * t.element_size()
    head = hashlib.blake2b(digest_size=8)
    head.update(f"{t.dtype}|{tuple(t.shape)}|{n}".encode())
    if n == 0:
        return _signed(int.from_bytes(head.digest(), "little"))
    try:
        flat = _in_place(t)
        lanes = _lanes_in_place(flat) if flat is not None else _lanes_copied(t, t.device)
    except Exception as e:
        if not _out_of_memory(e):
            raise FingerprintError(f"cannot fingerprint {_where(t, what)}: {type(e).__name__}: {e}") from e
        # Out of memory where the tensor lives: the same words, hashed on the host, slab by slab (the same key
        # and integer arithmetic, so the same value).
        try:
            lanes = _lanes_copied(t, torch.device("cpu"))
        except Exception as e2:
            raise FingerprintError(
                f"cannot fingerprint {_where(t, what)}: out of memory on {t.device} ({e}), and on the host: "
                f"{type(e2).__name__}: {e2}"
            ) from e2
    head.update(lanes.numpy().tobytes())
    return _signed(int.from_bytes(head.digest(), "little"))


class RunningFingerprint:
    """:func:`fingerprint` of a tensor of ``dtype`` and ``shape`` whose bytes arrive in consecutive pieces, in order:
    the same value, with no copy of the whole tensor anywhere (the element diff reads a shard a chunk at a time and
    fingerprints each chunk while it is at hand).

    Every piece but the last holds a whole number of blocks (``BLOCK_WORDS * 8`` bytes): NH hashes each block on its
    own, so the blocks' values are the ones :func:`fingerprint` computes over the whole. A piece is read in place
    where it is contiguous and aligned, else copied a slab at a time (as :func:`fingerprint` does)."""

    def __init__(self, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        self._bytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        self._head = hashlib.blake2b(digest_size=8)
        self._head.update(f"{dtype}|{tuple(shape)}|{self._bytes}".encode())
        self._dtype = dtype
        self._seen = 0
        # One set of NH temporaries for every piece (allocating and zeroing them per piece would cost more than
        # reading the piece): made at the first piece read in place, on its device.
        self._nh: _NH | None = None

    @torch.no_grad()
    def update(self, piece: torch.Tensor) -> None:
        """Hash the next ``piece`` (of the tensor's dtype; any shape: its bytes in logical order)."""
        if piece.dtype != self._dtype:
            raise ValueError(f"a piece of {piece.dtype} in a fingerprint of {self._dtype}")
        if self._seen % (BLOCK_WORDS * 8):
            raise ValueError("a piece after one that ended inside a block: only the last piece may")
        n = piece.numel() * piece.element_size()
        if self._seen + n > self._bytes:
            raise ValueError(f"pieces of {self._seen + n} bytes in a fingerprint of {self._bytes}")
        self._seen += n
        if n:
            piece = piece.detach()
            flat = _in_place(piece)
            if flat is None:
                lanes = _lanes_copied(piece, piece.device)
            else:
                if self._nh is None or self._nh.key.device != flat.device:
                    self._nh = _NH(_key(flat.device), max(1, -(-self._bytes // 8)))
                lanes = _lanes_in_place(flat, self._nh)
            self._head.update(lanes.numpy().tobytes())

    def value(self) -> int:
        """The fingerprint, once every byte arrived."""
        if self._seen != self._bytes:
            raise ValueError(f"{self._seen} of {self._bytes} bytes fingerprinted")
        return _signed(int.from_bytes(self._head.digest(), "little"))


def _quantized(t: torch.Tensor, what: str | None) -> int:
    """A quantized tensor: its integer representation and its quantizer (the values it stands for are exactly
    these), each hashed; a scheme this does not know is refused."""
    scheme = t.qscheme()
    try:
        if scheme in (torch.per_tensor_affine, torch.per_tensor_symmetric):
            params = f"scale {float(t.q_scale()).hex()}|zero point {int(t.q_zero_point())}"
        elif scheme in (torch.per_channel_affine, torch.per_channel_symmetric, torch.per_channel_affine_float_qparams):
            scales = fingerprint(t.q_per_channel_scales(), f"{what or 'a tensor'}'s scales")
            zeros = fingerprint(t.q_per_channel_zero_points(), f"{what or 'a tensor'}'s zero points")
            params = f"axis {t.q_per_channel_axis()}|scales {scales}|zero points {zeros}"
        else:
            raise FingerprintError(f"cannot fingerprint {_where(t, what)}: quantization scheme {scheme} is not known")
        body = fingerprint(t.int_repr(), what)
    except FingerprintError:
        raise
    except Exception as e:
        raise FingerprintError(f"cannot fingerprint {_where(t, what)}: {type(e).__name__}: {e}") from e
    head = hashlib.blake2b(f"{t.dtype}|{tuple(t.shape)}|{scheme}|{params}|{body}".encode(), digest_size=8)
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
