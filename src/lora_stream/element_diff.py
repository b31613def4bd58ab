"""One rank's shard of one element output against its baseline: the diff, its proof and its encoding, in one pass
over the shard on its device (:func:`diff_shard`), and what travels of it (:class:`Segment`).

Who calls it: the trainer's element read (:func:`lora_stream.elements.read_elements`), once per eligible output and
sync. What breaks if it is bypassed: a shard compared in one read and fingerprinted in another could change between
the two, and the engine would prove values the diff never saw.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .element_codec import Encoded, bits, encode
from .fingerprint import CHUNK_WORDS
from .linear_fingerprint import KEY_ID, P, linear_fingerprint

__all__ = ["DIFF_CHUNK_BYTES", "Segment", "diff_segment", "diff_shard"]


@dataclass
class Segment:
    """One rank's changed elements of one output: its flat range ``[lo, hi)`` of the checkpoint tensor, the
    encoded changes (indices relative to ``lo``), and the linear fingerprint of every new value in the range
    (:func:`~lora_stream.linear_fingerprint.linear_fingerprint` at offset ``lo``: the ranks' values add up to the
    whole tensor's)."""

    lo: int
    hi: int
    encoded: Encoded
    fp: int

    def describe(self) -> dict[str, Any]:
        return {"lo": self.lo, "hi": self.hi, "fp": self.fp, "key": KEY_ID, **self.encoded.describe()}


#: Bytes of the served dtype the diff reads at a time: a chunk is cast, compared and fingerprinted while it is at
#: hand, and no temporary is larger.
DIFF_CHUNK_BYTES = CHUNK_WORDS * 8


@torch.no_grad()
def diff_shard(
    values: torch.Tensor, dtype: torch.dtype, old: torch.Tensor | None, offset: int = 0
) -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor | None]:
    """One pass over ``values`` (this rank's flat shard), a chunk at a time, on its device: each chunk cast to
    ``dtype``, compared bit for bit with ``old`` (the baseline's shard, the engines' values) and fingerprinted.

    Returns ``(new, index, fp, replaced)``: ``new``, the cast shard -- ``old`` itself, advanced in place (each chunk
    written over the one it was compared with: only the changed elements' bits differ), or a new tensor on the
    shard's device when there is no ``old`` of its size and dtype; ``index``, the changed flat positions (every one
    without ``old``), ascending, on the same device; ``fp``, the linear fingerprint of ``new`` as the range of the
    checkpoint tensor that starts at element ``offset`` (each chunk's partial sum, taken while it is at hand);
    ``replaced``, what ``old`` held at ``index`` (``None`` without ``old``). Nothing of the shard is copied to the
    host. A failure part way puts back what it wrote into ``old`` before raising."""
    flat = values.detach().reshape(-1)
    n = flat.numel()
    if old is not None and (old.numel() != n or old.dtype != dtype or old.device != flat.device):
        old = None
    new = old if old is not None else torch.empty(n, dtype=dtype, device=flat.device)
    step = max(1, DIFF_CHUNK_BYTES // new.element_size())
    fp = 0
    found: list[torch.Tensor] = []
    kept: list[torch.Tensor] = []
    try:
        for a in range(0, n, step):
            chunk = flat[a : a + step].to(dtype)
            held = new[a : a + step]
            if old is not None:
                changed = (bits(chunk) != bits(held)).nonzero().reshape(-1)
                if changed.numel():
                    found.append(changed + a)
                    kept.append(held.index_select(0, changed))  # what the write below replaces
            # The whole chunk, written in order while it is at hand: cheaper than scattering the changed elements,
            # and the unchanged ones are written with the bits they hold.
            held.copy_(chunk)
            fp = (fp + linear_fingerprint(held, offset + a)) % P  # the values just written: what engines will hold
    except BaseException:
        for index, values_before in zip(found[: len(kept)], kept, strict=True):
            new.index_copy_(0, index, values_before)
        raise
    if old is None:
        return new, torch.arange(n, dtype=torch.int64, device=flat.device), fp, None
    empty = torch.zeros(0, dtype=torch.int64, device=flat.device)
    index = found[0] if len(found) == 1 else torch.cat(found) if found else empty
    replaced = kept[0] if len(kept) == 1 else torch.cat(kept) if kept else new[empty]
    return new, index, fp, replaced


def diff_segment(
    values: torch.Tensor,
    offset: int,
    dtype: torch.dtype,
    old: torch.Tensor | None,
    journal: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
) -> tuple[Segment, torch.Tensor, bool]:
    """This rank's :class:`Segment` of one output whose flat range ``[offset, offset + values.numel())`` it holds
    (:func:`diff_shard`, then the changes encoded), the new shard, and whether any element changed. Each write into
    ``old`` is noted in ``journal`` (``(shard, index, old values)``), for a restore."""
    new, index, fp, replaced = diff_shard(values, dtype, old, offset)
    if replaced is not None:
        journal.append((new, index, replaced))
    return Segment(offset, offset + new.numel(), encode(new, index), fp), new, bool(index.numel())
