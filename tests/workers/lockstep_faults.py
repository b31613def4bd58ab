"""Rank worker: what a given-up exchange, a slow rank and a fleet agreement do across 2 gloo processes.

Usage: lockstep_faults.py SCENARIO
  late        rank 1 reaches an exchange after rank 0 gave up on it: both raise; the next exchange pairs.
  slow-fsdp2  an FSDP2 stream pass, rank 1 slower than the timeout at group 1: rank 0 raises within the timeout,
              rank 1 raises at its next exchange (no gather alone, no 30-minute hang); a second pass is whole.
  slow-zero3  the same under DeepSpeed ZeRO-3.
  fleet       24 servers with long addresses, excluded on both ranks: the agreement carries them all, both ranks
              learn the same set, and one more agreement pairs after it.
  stopped-host  rank 0, whose process hosts the group's store, stops itself (SIGSTOP) before an exchange; rank 1
              times out, and raises within its timeout plus the settlement's bound while rank 0 is still stopped
              (the store's own timeout is 30 minutes), then continues rank 0 (SIGCONT), which raises too ("given up
              by rank 1"); the next exchange pairs.
Each outcome is one RESULT {json} line.
"""

from __future__ import annotations

import datetime
import sys
import time

import torch
import torch.distributed as dist
from helpers import finish, lora, report, report_exchange, tiny_llama

from lora_stream import ParamStream, StreamAbortedError
from lora_stream.lockstep import Lockstep, Status

TIMEOUT_S = 3.0
LATE_S = 6.0


def scenario_late() -> None:
    rank = dist.get_rank()
    lock = lambda: Lockstep(None, "late", datetime.timedelta(seconds=TIMEOUT_S))  # noqa: E731
    lock().statuses(Status.OK, "first")
    if rank == 1:
        time.sleep(LATE_S)
    report_exchange(rank, "second", lambda: lock().statuses(Status.OK, "second"), returned="ok")
    # Rank 0 is here while rank 1 still sleeps: wait long enough for it.
    statuses, _ = Lockstep(None, "late", datetime.timedelta(seconds=60)).statuses(Status.OK, "third")
    report(rank=rank, event="third", outcome="ok", statuses=statuses)


STOP_S = 15.0


def scenario_stopped_host() -> None:
    import os
    import signal

    rank = dist.get_rank()
    pids: list[int] = [0, 0]
    dist.all_gather_object(pids, os.getpid())
    lock = lambda: Lockstep(None, "stopped-host", datetime.timedelta(seconds=TIMEOUT_S))  # noqa: E731
    lock().statuses(Status.OK, "first")
    start = time.monotonic()
    if rank == 0:
        os.kill(os.getpid(), signal.SIGSTOP)  # rank 1 continues it after STOP_S
    try:
        lock().statuses(Status.OK, "second")
        report(rank=rank, event="second", outcome="ok", seconds=time.monotonic() - start)
    except StreamAbortedError as exc:
        report(rank=rank, event="second", outcome="raised", message=str(exc), seconds=time.monotonic() - start)
    if rank == 1:
        time.sleep(max(0.0, STOP_S - (time.monotonic() - start)))
        os.kill(pids[0], signal.SIGCONT)
    statuses, _ = Lockstep(None, "stopped-host", datetime.timedelta(seconds=60)).statuses(Status.OK, "third")
    report(rank=rank, event="third", outcome="ok", statuses=statuses)


def _whole(stream: ParamStream) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in stream}


def scenario_slow(kind: str) -> None:
    rank = dist.get_rank()
    model = lora(tiny_llama(layers=4), target_modules="all-linear")
    if kind == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for n, m in model.named_modules():
            if n.endswith(tuple(f"layers.{i}" for i in range(4))):
                fully_shard(m, mesh=mesh)
        fully_shard(model, mesh=mesh)
        target = model
    else:
        import deepspeed
        from helpers import zero3_engine

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        target = zero3_engine(model)
    start = time.monotonic()
    try:
        with ParamStream(target, group_by="layer", timeout=TIMEOUT_S) as stream:
            for i, _ in enumerate(stream.iter_groups()):
                if rank == 1 and i == 1:
                    time.sleep(LATE_S)
        report(rank=rank, event="slow", outcome="ok", seconds=time.monotonic() - start)
    except StreamAbortedError as exc:
        report(rank=rank, event="slow", outcome="raised", message=str(exc), seconds=time.monotonic() - start)
    # Both ranks are past the failed pass: the next one must pair every collective and be whole.
    time.sleep(1.0 if rank == 0 else 0.0)
    out = _whole(ParamStream(target, group_by="layer", timeout=60))
    report(rank=rank, event="again", outcome="ok", tensors=len(out))


def scenario_fleet() -> None:
    from lora_stream import VLLMServerSink
    from lora_stream.coordination import Coordinator
    from lora_stream.sinks.server_route import ServerRoute
    from lora_stream.transaction import Transaction

    rank = dist.get_rank()
    urls = [f"http://replica-{i:02d}-{'x' * 80}.example.invalid:8000" for i in range(24)]
    sink = VLLMServerSink(urls, rank=rank, on_replica_failure="exclude")
    route = ServerRoute(sink, sink._memory)  # this rank's servers, as a sync's commit step sees them
    for r in route.mine:
        if r.index % 3 != 2:  # two thirds of each rank's servers failed, with long reasons
            r.failure = RuntimeError(f"server {r.index} failed: " + "y" * 400)
    tx = Transaction(Coordinator(None, "fleet", datetime.timedelta(seconds=30)), "fleet")
    excluded, _ = route._agree_on_fleet(tx)
    tx.vote("after the fleet")  # one more agreement: it must pair
    report(
        rank=rank,
        event="fleet",
        excluded=sorted(excluded),
        ok=tx.ok,
        error=None if tx.error is None else str(tx.error)[:300],
    )


def main() -> None:
    scenario = sys.argv[1]
    if scenario == "slow-zero3":
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
    else:
        dist.init_process_group("gloo")
    if scenario == "late":
        scenario_late()
    elif scenario == "slow-fsdp2":
        scenario_slow("fsdp2")
    elif scenario == "slow-zero3":
        scenario_slow("zero3")
    elif scenario == "fleet":
        scenario_fleet()
    elif scenario == "stopped-host":
        scenario_stopped_host()
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")
    sys.stdout.flush()
    finish(0)


if __name__ == "__main__":
    main()
