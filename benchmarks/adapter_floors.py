"""The adapter benchmark's floors, measured by a rank worker in its own process group (zero3_worker.py and
fsdp2_worker.py with ``--adapter``): the raw all-gathers of exactly the bytes the adapter stream gathers, and the
collectives one sync issues."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

#: One group's pieces: this rank's bytes of each parameter (1-D uint8) and the bytes every rank contributes for it
#: (the shard padded as the trainer pads it).
Pieces = list[tuple[torch.Tensor, int]]

_COLLECTIVES = ("all_gather_into_tensor", "all_gather", "all_reduce", "broadcast", "barrier", "reduce_scatter_tensor")


@contextmanager
def counting() -> Iterator[dict[str, int]]:
    """Counts the calls of torch.distributed's collectives, by name, while active."""
    counts = dict.fromkeys(_COLLECTIVES, 0)
    saved = {n: getattr(dist, n) for n in _COLLECTIVES}

    def wrap(name: str) -> Callable[..., Any]:
        fn = saved[name]

        def counted(*a: Any, **k: Any) -> Any:
            counts[name] += 1
            return fn(*a, **k)

        return counted

    for n in _COLLECTIVES:
        setattr(dist, n, wrap(n))
    try:
        yield counts
    finally:
        for n, fn in saved.items():
            setattr(dist, n, fn)


def collectives_of(sync: Callable[[], object]) -> dict[str, int]:
    """The collectives one call of ``sync`` issues (those it issued at least once)."""
    with counting() as counts:
        sync()
    return {k: v for k, v in counts.items() if v}


def _median(fn: Callable[[], None], repeats: int) -> float:
    runs = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - t0)
    return statistics.median(runs)


def all_gather_floors(groups: list[Pieces], repeats: int) -> dict[str, float]:
    """Median seconds of the raw all-gathers of ``groups``' bytes, each packed beforehand (no copy timed):

    * ``flat_all_gather_s``: one ``all_gather_into_tensor`` per group of its pieces packed into one buffer;
    * ``per_param_all_gather_s``: one per piece, issued asynchronously and then waited for (what the direct paths
      did per parameter before they coalesced small parameters).
    """
    world = dist.get_world_size()
    flat, single = [], []
    for pieces in groups:
        total = sum(n for _, n in pieces)
        send = torch.zeros(total, dtype=torch.uint8)
        off = 0
        for local, n in pieces:
            send[off : off + local.numel()].copy_(local)
            single.append((send.narrow(0, off, n), torch.empty(n * world, dtype=torch.uint8)))
            off += n
        flat.append((send, torch.empty(total * world, dtype=torch.uint8)))

    def flat_gather() -> None:
        for send, recv in flat:
            dist.all_gather_into_tensor(recv, send)

    def per_param() -> None:
        handles = [dist.all_gather_into_tensor(recv, send, async_op=True) for send, recv in single]
        for h in handles:
            h.wait()

    return {
        "flat_all_gather_s": _median(flat_gather, repeats),
        "per_param_all_gather_s": _median(per_param, repeats),
        "flat_all_gathers": len(flat),
        "per_param_all_gathers": len(single),
        "gathered_bytes": sum(n * world for pieces in groups for _, n in pieces),
    }


def zero3_pieces(groups: list[list[Any]]) -> list[Pieces]:
    """Each group's ZeRO-3 partitions (``ds_tensor``, padded as DeepSpeed pads it)."""
    return [
        [
            (
                p.ds_tensor.view(-1).narrow(0, 0, p.ds_tensor.ds_numel).view(torch.uint8),
                p.ds_tensor.ds_numel * p.element_size(),
            )
            for p in {id(p): p for p in params}.values()
        ]
        for params in groups
    ]


def fsdp2_pieces(groups: list[list[Any]]) -> list[Pieces]:
    """Each group's ``Shard(0)`` local shards, padded to ``ceil(rows / world)`` rows."""
    world = dist.get_world_size()
    out = []
    for params in groups:
        pieces = []
        for p in {id(p): p for p in params}.values():
            rows = p.shape[0]
            n = -(-rows // world) * (p.numel() // rows) * p.element_size()
            pieces.append((p.to_local().detach().contiguous().view(-1).view(torch.uint8), n))
        out.append(pieces)
    return out
