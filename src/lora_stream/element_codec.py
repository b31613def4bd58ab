"""How the elements of one tensor that changed travel: flat indices plus values, a bitmask plus values, or dense.

Both halves of an element sync import this module and nothing else of each other: the trainer
(:mod:`lora_stream.elements`) encodes, the engine (:mod:`lora_stream.engine.elements`) decodes. An encoded tensor is
one ``uint8`` blob (what every transport already carries) plus a small descriptor (:class:`Encoded`): the encoding,
the count of changed elements, and the tensor's element count and dtype.

The three encodings, for ``k`` changed elements of ``n``, each ``s`` bytes:

* ``"indices"``: the flat indices (``int32`` when ``n < 2**31``, else ``int64``), ascending, then the values:
  ``k * (4 + s)`` bytes;
* ``"bitmask"``: one bit per element (bit ``i % 8`` of byte ``i // 8``), then the values in index order:
  ``ceil(n / 8) + k * s`` bytes; encoding and decoding touch each byte once and each changed element's bit, never
  an integer per element;
* ``"dense"``: every value: ``n * s`` bytes.

:func:`encode` picks the smallest (ties: the first of that list). Values are compared and carried as their *bits*
(a NaN, a ``-0.0``, a subnormal travel as they are): what arrives is bit for bit what was sent.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["ENCODINGS", "Encoded", "bits", "decode", "encode", "encoded_size"]

#: The encodings, in the order :func:`encode` breaks ties.
ENCODINGS = ("indices", "bitmask", "dense")

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as integers of its element size: equal bits compare equal (NaN == NaN, -0.0 != 0.0)."""
    return t.view(_INT_OF_SIZE[t.element_size()])


def _index_dtype(n: int) -> torch.dtype:
    return torch.int32 if n < 2**31 else torch.int64


def encoded_size(encoding: str, changed: int, numel: int, itemsize: int) -> int:
    """Bytes of an ``encoding`` of ``changed`` elements of ``numel``, each ``itemsize`` bytes."""
    if encoding == "indices":
        return changed * (torch.tensor([], dtype=_index_dtype(numel)).element_size() + itemsize)
    if encoding == "bitmask":
        return (numel + 7) // 8 + changed * itemsize
    if encoding == "dense":
        return numel * itemsize
    raise ValueError(f"unknown element encoding {encoding!r} (known: {ENCODINGS})")


@dataclass(frozen=True)
class Encoded:
    """One tensor's changed elements as they travel: ``blob`` and what decoding it needs."""

    encoding: str
    #: Changed elements carried (``numel`` for ``"dense"``).
    count: int
    numel: int
    dtype: torch.dtype
    blob: torch.Tensor

    def describe(self) -> dict[str, object]:
        """The descriptor that travels beside the blob (JSON-able)."""
        return {"encoding": self.encoding, "count": self.count, "numel": self.numel, "dtype": str(self.dtype)[6:]}


def encode(new: torch.Tensor, index: torch.Tensor) -> Encoded:
    """The elements of ``new`` (a flat tensor: every value of the range it covers) at the ascending flat ``index``
    (``int64``), in the smallest of :data:`ENCODINGS`, on the host. Only what travels leaves ``new``'s device: the
    changed values and their indices (or, dense, every value)."""
    new = new.detach().reshape(-1)
    numel, k, dtype, s = new.numel(), int(index.numel()), new.dtype, new.element_size()
    best = min(ENCODINGS, key=lambda e: (encoded_size(e, k, numel, s), ENCODINGS.index(e)))
    if best == "dense":
        return Encoded("dense", numel, numel, dtype, new.to("cpu").contiguous().view(torch.uint8).reshape(-1).clone())
    values = new[index.reshape(-1).to(new.device)].to("cpu")
    index = index.to("cpu", torch.int64).reshape(-1)
    if best == "indices":
        head = index.to(_index_dtype(numel)).view(torch.uint8)
    else:
        # Each changed element sets bit i % 8 of byte i // 8 (the indices are distinct, so a sum is an OR): the
        # bytes are written once, the bits O(changed), never a byte per element.
        acc = torch.zeros((numel + 7) // 8, dtype=torch.int32)
        acc.index_add_(0, index >> 3, torch.ones_like(index, dtype=torch.int32) << (index & 7).to(torch.int32))
        head = acc.to(torch.uint8)
    blob = torch.cat([head.reshape(-1), values.view(torch.uint8).reshape(-1)])
    return Encoded(best, k, numel, dtype, blob)


def decode(
    encoding: str, blob: torch.Tensor, count: int, numel: int, dtype: torch.dtype
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """``(index, values)`` of an encoded blob: ``index`` flat, ``int64``, ascending (``None`` for ``"dense"``: then
    ``values`` is every element, flat). Raises ``ValueError`` when the blob's size is not what the descriptor says
    (a different lora_stream on the other side, or a torn transfer): never a guess."""
    blob = blob.detach().to("cpu").reshape(-1)
    if blob.dtype != torch.uint8:
        raise ValueError(f"an element payload travels as uint8, got {blob.dtype}")
    s = torch.tensor([], dtype=dtype).element_size()
    expected = encoded_size(encoding, count, numel, s)
    if blob.numel() != expected:
        raise ValueError(
            f"an element payload of {blob.numel()} bytes, but {encoding!r} of {count} of {numel} {dtype} elements "
            f"takes {expected}"
        )
    if count < 0 or count > numel:
        raise ValueError(f"{count} changed elements of a tensor of {numel}")
    if encoding == "dense":
        return None, blob.clone().view(dtype)
    head_bytes = expected - count * s
    head, body = blob[:head_bytes].clone(), blob[head_bytes:].clone()
    values = body.view(dtype)
    if encoding == "indices":
        index = head.view(_index_dtype(numel)).to(torch.int64)
    else:
        # Only the bytes with a bit set are unpacked: O(bytes + changed), never an int per element.
        at = head.nonzero().reshape(-1)
        bit = (head[at].to(torch.int32).unsqueeze(1) >> torch.arange(8, dtype=torch.int32)) & 1
        index = (at.unsqueeze(1) * 8 + torch.arange(8, dtype=torch.int64))[bit.bool()]
        if index.numel() and int(index[-1]) >= numel:
            raise ValueError("an element bitmask with bits set past the tensor's end")
    if index.numel() != count:
        raise ValueError(f"an element payload names {index.numel()} elements, its descriptor {count}")
    if count and (int(index.min()) < 0 or int(index.max()) >= numel or bool((index[1:] <= index[:-1]).any())):
        raise ValueError("an element payload's indices are not ascending within the tensor")
    return index, values
