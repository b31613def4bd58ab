"""Buffers a pass reuses, so the process does not grow by one fresh allocation per merge.

On CPU, glibc serves large allocations from mmap until the first one is freed; then it raises its mmap threshold and
serves same-sized requests from the heap, where freed memory stays in the process. A stream that allocates a fresh
float32 temporary per merge and a fresh output per tensor therefore grows the process by far more than it ever holds
at once (`../shared/notes/anchors.md` measured a per-module stream growing as much as a whole-model gather). Reusing
a few buffers across the whole pass keeps the allocator out of it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

import torch

__all__ = ["Workspace", "OutputPool", "Scratch", "release_freed_heap", "HeapTrimmer", "ProcessMemory"]


class Workspace:
    """Flat float32 scratch buffers for merges, grown on demand and reused by every merge of a pass.

    A merge asks for slot ``i`` with at least ``numel`` elements and gets a 1-D view; the buffers live until the
    pass ends, so their total is bounded by the largest merge's need (a few ``merge_block_bytes``).
    """

    def __init__(self) -> None:
        self._slots: dict[tuple[int, torch.device], torch.Tensor] = {}

    def get(self, slot: int, numel: int, device: torch.device) -> torch.Tensor:
        buf = self._slots.get((slot, device))
        if buf is None or buf.numel() < numel:
            self._slots.pop((slot, device), None)
            buf = torch.empty(numel, dtype=torch.float32, device=device)
            self._slots[(slot, device)] = buf
        return buf[:numel]

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * 4 for b in self._slots.values())

    def clear(self) -> None:
        self._slots.clear()


class OutputPool:
    """Output tensors of the previous group, handed out again for the same shape and dtype in the next group.

    Only safe when the consumer keeps no reference to a yielded tensor past its group (``reuse_outputs=True``):
    the next group overwrites it. At most one group's outputs are pooled; the rest are freed at the group's end.
    """

    def __init__(self) -> None:
        self._free: dict[tuple[torch.Size, torch.dtype, torch.device], list[torch.Tensor]] = {}
        self._used: list[torch.Tensor] = []

    def empty(self, shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        free = self._free.get((shape, dtype, device))
        out = free.pop() if free else torch.empty(shape, dtype=dtype, device=device)
        self._used.append(out)
        return out

    def end_group(self) -> None:
        self._free = {}
        for t in self._used:
            self._free.setdefault((t.shape, t.dtype, t.device), []).append(t)
        self._used = []

    def clear(self) -> None:
        self._free, self._used = {}, []


class Scratch:
    """What a merge may allocate from: the pass's float32 workspace, and its output allocator."""

    def __init__(self, outputs: OutputPool | None = None) -> None:
        self.workspace = Workspace()
        self.outputs = outputs

    def empty(self, shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if self.outputs is None:
            return torch.empty(shape, dtype=dtype, device=device)
        return self.outputs.empty(shape, dtype, device)


def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "malloc_trim") else None


_LIBC = _libc()


def release_freed_heap() -> bool:
    """Give memory freed inside the process back to the OS (glibc ``malloc_trim(0)``); False where unavailable."""
    if _LIBC is None:
        return False
    _LIBC.malloc_trim(0)
    return True


_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _resident_bytes() -> int | None:
    """The process's resident set now (``/proc/self/statm``, one short read); None where unavailable."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE_BYTES
    except (OSError, ValueError, IndexError):
        return None


class HeapTrimmer:
    """Returns freed heap to the OS during a pass only once the process has grown past a bound.

    Trimming is not free twice over: ``malloc_trim`` walks the heap, and every page it returns is faulted back in
    by the next output allocation. Trimming after a fixed amount of released bytes paid both on every sync even
    when the process never grew (measured: ~0.17 s of a 1.6 s ZeRO-3 sync). So the policy is a bound on what the
    pass may add to the resident set: ``bound_bytes`` above the resident set at the pass's start. It reads RSS
    after each group (one ``statm`` read); where RSS cannot be read it falls back to trimming once per
    ``every_bytes`` released.
    """

    def __init__(self, bound_bytes: int, every_bytes: int) -> None:
        self.bound_bytes = bound_bytes
        self.every_bytes = every_bytes
        self.trims = 0
        self._start = _resident_bytes() if _LIBC is not None else None
        self._released = 0

    def after_group(self, released_bytes: int) -> None:
        """Called once a group's gathered memory is released; trims if the pass has grown past its bound."""
        if _LIBC is None:
            return
        if self._start is not None:
            now = _resident_bytes()
            if now is None or now - self._start <= self.bound_bytes:
                return
        else:
            self._released += released_bytes
            if self._released < self.every_bytes:
                return
            self._released = 0
        release_freed_heap()
        self.trims += 1


class ProcessMemory:
    """The process's resident set during a pass, on Linux: peak via ``VmHWM`` after resetting it at the start.

    Resetting the high-water mark (writing 5 to ``/proc/self/clear_refs``) is process-wide, so it is opt-in
    (``ParamStream(measure_rss=True)``). Elsewhere the figures stay ``None``.
    """

    def __init__(self) -> None:
        self.start: int | None = None

    @staticmethod
    def _status(field: str) -> int | None:
        try:
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith(field + ":"):
                        return int(line.split()[1]) * 1024
        except OSError:
            return None
        return None

    def begin(self) -> None:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            return
        self.start = _resident_bytes()

    def peak(self) -> int | None:
        return self._status("VmHWM") if self.start is not None else None
