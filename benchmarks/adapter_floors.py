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


def median_seconds(fn: Callable[[], None], repeats: int) -> float:
    """Median seconds of ``repeats`` calls of ``fn``, a barrier before each."""
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
        "flat_all_gather_s": median_seconds(flat_gather, repeats),
        "per_param_all_gather_s": median_seconds(per_param, repeats),
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


def flat_gather_of(groups: list[Pieces]) -> Callable[[], None]:
    """The floor as a callable: one ``all_gather_into_tensor`` per group of its pieces, packed beforehand into a
    buffer kept between calls (no copy timed)."""
    world = dist.get_world_size()
    flat = []
    for pieces in groups:
        total = sum(n for _, n in pieces)
        send = torch.zeros(total, dtype=torch.uint8)
        off = 0
        for local, n in pieces:
            send[off : off + local.numel()].copy_(local)
            off += n
        flat.append((send, torch.empty(total * world, dtype=torch.uint8)))

    def flat_gather() -> None:
        for send, recv in flat:
            dist.all_gather_into_tensor(recv, send)

    return flat_gather


def interleaved(syncs: dict[str, Callable[[], None]], rounds: int) -> dict[str, dict[str, float]]:
    """Each labelled sync run once per round, in the same order every round, ``rounds`` rounds after a warm-up round
    (a barrier before each run), so this machine's drift hits every label alike (:func:`common.interleave`): per
    label the median and every run's seconds."""
    from common import interleave

    # The warm-up round is dropped: the first sync of each plans and allocates.
    fns = {k: lambda _, fn=fn: fn() for k, fn in syncs.items()}
    runs = interleave(rounds + 1, fns, before=lambda _: dist.barrier())
    seconds = {k: [s.seconds for s in v[1:]] for k, v in runs.items()}
    return {k: {"median_s": statistics.median(v), "runs_s": v} for k, v in seconds.items()}


#: The adapter A/B variants (``bench_adapter.py --ab free,keep``): the gatherer's options of each.
AB: dict[str, dict[str, Any]] = {
    "free": {"keep_bytes": 0},  # buffers freed at the end of every pass (before keep_bytes)
    "keep": {"keep_bytes": 64 << 20},  # what AdapterStream(model) does: lora_stream.gatherers.base.KEEP_BYTES
    # the buffer kept, but its layout (the views into it) rebuilt every pass
    "keep-nolayout": {"keep_bytes": 64 << 20, "_cache_layouts": False},
    # ZeRO-3: the path agreement in a collective of its own, not in the stream's status exchange
    "keep-nofold": {"keep_bytes": 64 << 20, "_agree_in_lockstep": False},
    # measurement only: lora_A yielded as a view of the reused buffer, not copied out (valid here only because the
    # benchmark copies every tensor into its destination at once; vLLM keeps them, see docs/adapter_sync.md)
    "keep-nocopy": {"keep_bytes": 64 << 20, "_no_copy_out": True},
}


def ab_run(args: Any, make: Callable[..., Any], pieces_of: Callable[[list[list[Any]]], list[Pieces]]) -> None:
    """A worker's ``--ab`` mode: one adapter stream per label of ``args.ab`` (``make(**AB[label])``), and the floor
    (one flat all-gather of the same bytes per group), run in interleaved rounds; writes ``{"ab": ...}``."""
    import json
    from pathlib import Path

    streams = {}
    for label in args.ab.split(","):
        options = dict(AB[label])
        attrs = {k: options.pop(k) for k in list(options) if k.startswith("_")}
        streams[label] = stream = make(**options)
        if attrs.pop("_no_copy_out", False):
            g = stream.gatherer
            g.__class__ = type(f"NoCopy{type(g).__name__}", (type(g),), {"reuses_buffers": False})
        for k, v in attrs.items():
            setattr(stream.gatherer, k, v)
    first = next(iter(streams.values()))
    dest = {m.name: torch.zeros(m.shape, dtype=m.dtype) for m in first.metadata()}

    def sync_of(stream: Any) -> Callable[[], None]:
        def sync() -> None:
            for name, tensor in stream:
                dest[name].copy_(tensor)

        return sync

    syncs = {label: sync_of(s) for label, s in streams.items()}
    syncs["floor"] = flat_gather_of(pieces_of([g.params for g in first._groups]))
    result = interleaved(syncs, args.syncs)
    for label, s in streams.items():
        result[label]["collectives_per_sync"] = collectives_of(syncs[label])  # type: ignore[assignment]
        result[label]["kept_bytes"] = s.last_stats.kept_bytes
    row = {"rank": dist.get_rank(), "ab": result}
    Path(f"{args.out}.rank{dist.get_rank()}.json").write_text(json.dumps(row))
    dist.barrier()


#: Where a sync's time goes, by the function that spends it (cProfile's own time, the callee's ``tottime``).
#: Everything not named here is the stream's and the consumer's Python: per tensor, the stream's bookkeeping and
#: checks and the generator's hand-over.
STAGES: dict[str, tuple[str, ...]] = {
    "pack (cat of the local shards)": ("{built-in method torch.cat}",),
    "unpack (copy into place)": ("{built-in method torch.split_with_sizes_copy}",),
    "lora_B scaled (mul)": ("{built-in method torch.mul}",),
    "outputs allocated (empty)": ("{built-in method torch.empty}",),
}


def stage_breakdown(sync: Callable[[], None], repeats: int, consumer: str = "sync") -> dict[str, float]:
    """Seconds per sync by stage, from cProfile over ``repeats`` syncs (profiling inflates the Python share, so the
    stages are shown beside the unprofiled median, not summed against it):

    * the all-gather's wait and the lockstep status exchanges' (waits for the slower rank included);
    * the copies: ``lora_A`` out of the reused buffer (called from the stream) and the consumer's into its
      destination (called from the function named ``consumer``);
    * :data:`STAGES`; ``python``: the rest.
    """
    import cProfile
    import pstats

    prof = cProfile.Profile()
    dist.barrier()
    prof.enable()
    for _ in range(repeats):
        sync()
    prof.disable()
    stats: dict[Any, Any] = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    total = sum(tt for (_cc, _nc, tt, _ct, _callers) in stats.values())
    out: dict[str, float] = {}

    def own(label: str) -> float:
        return sum(v[2] for k, v in stats.items() if pstats.func_std_string(k) == label)

    def by_caller(label: str, where: str) -> float:
        return sum(
            tt
            for k, v in stats.items()
            if pstats.func_std_string(k) == label
            for caller, (_cc, _nc, tt, _ct) in v[4].items()
            if where in caller[0] or where == caller[2]
        )

    wait = "{method 'wait' of 'torch._C._distributed_c10d.Work' objects}"
    wait = wait if own(wait) else "{built-in method torch._C._distributed_c10d.wait}"
    exchange = by_caller(wait, "lockstep.py")
    out["all-gather (wait)"] = own(wait) - exchange
    out["status exchanges (wait)"] = exchange
    copy = "{method 'copy_' of 'torch._C.TensorBase' objects}"
    out["consumer copy"] = by_caller(copy, consumer)
    out["lora_A copied out"] = own(copy) - out["consumer copy"]
    for label, names in STAGES.items():
        out[label] = sum(own(n) for n in names)
    out["python and the rest"] = total - sum(out.values())
    return {k: v / repeats for k, v in out.items()}
