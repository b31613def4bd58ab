"""The safetensors layout of a merged checkpoint: which tensor goes into which shard file, every file's header, and
whether a checkpoint directory on disk is whole by those headers.

:class:`~lora_stream.sinks.checkpoint.SafetensorsSink` plans the shards with :func:`plan_shards` from
``metadata()`` before the first byte, so each header is written first and the tensors follow as they arrive. The
headers are byte for byte what ``safetensors.torch.save_file`` writes (dtype codes, shapes, 8-byte alignment), and
the file names and the cut are ``save_pretrained``'s (``max_shard_size`` read by :func:`parse_size`). The sink calls
:func:`is_whole` when it finds a moved-aside old copy after a killed save, before it moves that copy back.
"""

from __future__ import annotations

import json
import math
import re
import stat
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError
from ..stream_pass import ParamMeta

__all__ = ["ShardPlan", "is_whole", "parse_size", "plan_shards"]

#: safetensors' dtype names (its format's ``dtype`` strings, as ``safetensors.torch.save_file`` writes them).
_ST_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.complex64: "C64",
}
# Newer in torch than the floor this package supports, so looked up by name.
for _attr, _code in (
    ("float8_e4m3fn", "F8_E4M3"),
    ("float8_e5m2", "F8_E5M2"),
    ("float8_e4m3fnuz", "F8_E4M3FNUZ"),
    ("float8_e5m2fnuz", "F8_E5M2FNUZ"),
    ("float8_e8m0fnu", "F8_E8M0"),
    ("float4_e2m1fn_x2", "F4"),
    ("uint16", "U16"),
    ("uint32", "U32"),
    ("uint64", "U64"),
):
    if isinstance(getattr(torch, _attr, None), torch.dtype):
        _ST_DTYPES[getattr(torch, _attr)] = _code
#: Dtypes that pack two values per element: safetensors' header counts values, so the last dimension doubles.
_PACKED_X2 = {d for d in _ST_DTYPES if _ST_DTYPES[d] == "F4"}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})


def parse_size(size: int | str) -> int:
    """``5_000_000_000``, ``"5GB"`` (10**9) or ``"5GiB"`` (2**30), as ``save_pretrained`` reads ``max_shard_size``."""
    if isinstance(size, int):
        if size <= 0:
            raise ValueError(f"max_shard_size must be positive, got {size}")
        return size
    m = _SIZE.match(size)
    if not m:
        raise ValueError(f"max_shard_size {size!r} is not a size like 5GB, 500MiB or 1000000")
    return max(1, int(float(m.group(1)) * _UNITS[(m.group(2) or "").upper()]))


def _nbytes(m: ParamMeta) -> int:
    return math.prod(m.shape) * torch.empty((), dtype=m.dtype).element_size()


@dataclass(frozen=True)
class ShardPlan:
    """Which tensors go to which file, and every file's header, decided before the first byte is written."""

    files: list[str]
    members: list[list[int]]
    headers: list[bytes]
    total_size: int


def plan_shards(
    metadata: list[ParamMeta], max_shard_bytes: int, file_metadata: dict[str, str]
) -> tuple[ShardPlan, dict[str, str]]:
    """Cut ``metadata`` (in stream order) into shards of at most ``max_shard_bytes`` (a larger tensor gets a shard of
    its own, as ``save_pretrained`` does) and build each shard's safetensors header. Returns the plan and the
    index's weight map (``{}`` when there is one file, ``model.safetensors``)."""
    members: list[list[int]] = [[]]
    size = 0
    for i, m in enumerate(metadata):
        n = _nbytes(m)
        if members[-1] and size + n > max_shard_bytes:
            members.append([])
            size = 0
        members[-1].append(i)
        size += n
    if not members[-1]:
        members.pop()
    count = len(members)
    files = (
        ["model.safetensors"] if count <= 1 else [f"model-{k + 1:05d}-of-{count:05d}.safetensors" for k in range(count)]
    )
    headers: list[bytes] = []
    for idx in members or [[]]:
        header: dict[str, Any] = {"__metadata__": dict(file_metadata)}
        offset = 0
        for i in idx:
            m = metadata[i]
            if m.dtype not in _ST_DTYPES:
                raise CheckpointError(f"tensor {m.name!r} has dtype {m.dtype}, which safetensors cannot store")
            n = _nbytes(m)
            shape = list(m.shape)
            if m.dtype in _PACKED_X2 and shape:
                shape[-1] *= 2
            header[m.name] = {
                "dtype": _ST_DTYPES[m.dtype],
                "shape": shape,
                "data_offsets": [offset, offset + n],
            }
            offset += n
        raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
        headers.append(struct.pack("<Q", len(raw)) + raw)
    weight_map = {metadata[i].name: files[k] for k, idx in enumerate(members) for i in idx} if count > 1 else {}
    total = sum(_nbytes(m) for m in metadata)
    return ShardPlan(files, members or [[]], headers, total), weight_map


def is_whole(path: Path) -> bool:
    """Whether a moved-aside old copy is whole (not a copy whose removal was cut short): every safetensors file as long
    as its header says and every shard the index names present, and not empty. A regular file, or a directory that
    holds no safetensors files (whatever was under the target name), counts as whole: it was moved aside in one
    rename."""
    try:
        if not stat.S_ISDIR(path.lstat().st_mode):
            return True
        if not any(path.iterdir()):
            return False
        index = path / "model.safetensors.index.json"
        if index.exists():
            shards = set(json.loads(index.read_text())["weight_map"].values())
            if not all((path / f).is_file() for f in shards):
                return False
        for f in path.glob("*.safetensors"):
            with open(f, "rb") as h:
                head = h.read(8)
                if len(head) < 8:
                    return False
                (n,) = struct.unpack("<Q", head)
                header = json.loads(h.read(n))
            end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
            if f.stat().st_size < 8 + n + end:
                return False
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False
    return True
