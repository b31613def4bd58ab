"""What a frozen step of a stream reads, and its fingerprint: the parameters behind a step's targets (the merge's
inputs included), whether any of them trains, and one fingerprint over everything a step reads.

Who calls it: :meth:`ParamStream.read_steps <lora_stream.ParamStream.read_steps>` (step 1 of a sync that may be
partial) and :meth:`ParamStream.fingerprints <lora_stream.ParamStream.fingerprints>`. What breaks if a step's reads
are counted elsewhere differently: a step whose input changed could be skipped as unchanged.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

from .core import Target
from .fingerprint import fingerprint, fingerprint_of
from .merge import BufferRead


def fingerprints(steps: list[Any], gatherer: Any) -> list[int | None]:
    """For each of ``steps``, a fingerprint of this rank's own bytes of every source it reads, or ``None`` where the
    step must be sent at every sync (see :meth:`ParamStream.fingerprints <lora_stream.ParamStream.fingerprints>`).
    Reads each local shard of a step with no trainable source once; a shard two steps read is read once."""
    local_shard = getattr(gatherer, "local_shard", None)
    cache: dict[int, int | None] = {}

    def of_param(p: Any) -> int | None:
        if id(p) not in cache:  # frozen: steps with a trainable source are not read
            shard = None if local_shard is None else local_shard(p)
            cache[id(p)] = None if shard is None else fingerprint_of(shard)
        return cache[id(p)]

    out: list[int | None] = []
    for step in steps:
        if any(_reads_trainable(t) for t in step.inputs):
            out.append(None)  # sent anyway: its frozen base is not read for nothing
            continue
        parts: list[int] | None = []
        for t in step.inputs:
            found = _target_fingerprints(t, of_param)
            if found is None or parts is None:
                parts = None
                break
            parts += found
        out.append(None if parts is None else _combine(parts))
    return out


def _params_read(t: Target) -> list[Any]:
    """The parameters ``t`` reads: its merge's (none for a buffer), or its own."""
    return t.merge.params() if t.merge is not None else [t.param]


def _reads_trainable(t: Target) -> bool:
    """Whether ``t`` reads a trainable parameter (a LoRA factor, a ``modules_to_save`` copy, anything trained)."""
    return any(getattr(p, "requires_grad", True) for p in _params_read(t))


def _target_fingerprints(t: Target, of_param: Callable[[Any], int | None]) -> list[int] | None:
    """The fingerprints of what ``t`` reads: its parameters' local shards, or a persistent buffer (whole: no
    gatherer shards buffers); ``None`` if one cannot be fingerprinted, or the base is quantized (its quantization
    state lives outside its bytes)."""
    merge = t.merge
    if getattr(getattr(merge, "base", None), "quantized", False):
        return None
    if not isinstance(merge, BufferRead):
        out = []
        for p in _params_read(t):
            fp = of_param(p)
            if fp is None:
                return None
            out.append(fp)
        return out
    buf = merge.module._buffers.get(merge.attr)
    return None if buf is None else [fingerprint(buf)]


def _combine(parts: list[int]) -> int:
    raw = b"".join((p & ((1 << 64) - 1)).to_bytes(8, "little") for p in parts)
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little", signed=True)
