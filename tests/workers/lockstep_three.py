"""Rank worker: the settlement of a status exchange across 3 gloo processes while the store's host is stopped.

Three ranks (the last two scenarios also run with two; "rank 2" is then rank 1). Rank 0's process hosts the
group's store (``init_process_group`` over ``env://``), so stopping rank 0 stops the
store. Every scenario stops a process (``SIGSTOP``) for ``STOP_S``, longer than the settlement's bound (patched to
``BOUND_S`` here, so that the test takes seconds) and far shorter than any deadline, and a peer's helper thread
continues it (``SIGCONT``). Each rank reports its outcome of the second exchange; the third exchange (a long
timeout) must pair on every rank afterwards.

Usage: lockstep_three.py SCENARIO
  gave-up-then-host-stopped  rank 1 reaches the second exchange alone and gives it up after its timeout (the store
              settles it given up); ranks 0 and 2 reach it later, and their ``all_reduce`` completes with rank 1's
              contribution, still in flight; rank 0 is stopped just after its ``all_reduce`` completed, before it
              settles anything, and rank 2 settles a moment later. Rank 2's settlement gets no answer (the store
              is stopped). The issue's case: rank 2 took that as done and returned while ranks 0 and 1 raised.
  host-stopped-after-completion  nobody gives up: every ``all_reduce`` completes, and rank 0 is stopped just after
              its own completed, before it settles anything; rank 2 settles a moment later.
  peer-stopped-after-claim  rank 2 is stopped just after the store answered that its claim on the second exchange
              is settled: the store runs, only rank 2 is late to learn the outcome.
Each outcome is one RESULT {json} line.
"""

from __future__ import annotations

import datetime
import os
import signal
import sys
import threading
import time

import torch.distributed as dist
from helpers import finish, report, report_exchange

import lora_stream.lockstep as lockstep
from lora_stream.lockstep import Lockstep, Status

TIMEOUT_S = 2.0
LATE_S = 3.5
BOUND_S = 1.0
STOP_S = 5.0

lockstep.SETTLE_BOUND_S = BOUND_S  # read at each settlement: seconds, not the default's


def _stopped(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except OSError:
        return False


def _resume_after_stop(pid: int) -> threading.Thread:
    """Continue ``pid`` ``STOP_S`` after it stopped itself (on a thread: this rank's main thread may be waiting in
    an exchange meanwhile)."""

    def run() -> None:
        deadline = time.monotonic() + 60.0
        while not _stopped(pid):
            if time.monotonic() > deadline:
                return
            time.sleep(0.01)
        time.sleep(STOP_S)
        os.kill(pid, signal.SIGCONT)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _after_all_reduce(then: str) -> None:
    """Just after this process's next ``all_reduce`` completes, before the exchange settles: ``"stop"`` stops the
    process; ``"pause"`` waits a moment (a slow rank: its peers' last messages are out by then)."""
    real = dist.all_reduce

    class Work:
        def __init__(self, work: object) -> None:
            self.work = work

        def wait(self, timeout: datetime.timedelta | None = None) -> bool:
            ok = self.work.wait(timeout=timeout) if timeout is not None else self.work.wait()  # type: ignore[attr-defined]
            if then == "stop":
                time.sleep(0.1)  # let every peer's all_reduce finish with this process's last messages
                os.kill(os.getpid(), signal.SIGSTOP)
            else:
                time.sleep(0.6)  # the store's host is stopped by now
            return bool(ok)

        def is_completed(self) -> bool:
            return bool(self.work.is_completed())  # type: ignore[attr-defined]

    def patched(*args: object, **kwargs: object) -> Work:
        dist.all_reduce = real  # once
        return Work(real(*args, **kwargs))  # type: ignore[arg-type]

    dist.all_reduce = patched  # type: ignore[assignment]


def _stop_after_claim_settled() -> None:
    """This process stops itself just after the store answered that its claim on the next exchange is settled
    (the answer is ``done``, or the confirmations include this rank's), before it learns the outcome."""
    real = lockstep._group_store
    bit = 1 << dist.get_rank()
    armed = [True]

    def settled(answer: bytes) -> bool:
        text = bytes(answer).decode()
        return text == "done" or (text.startswith("c:") and bool(int(text[2:], 16) & bit))

    class Store:
        def __init__(self, store: object) -> None:
            self.store = store

        def __getattr__(self, name: str) -> object:
            method = getattr(self.store, name)

            def call(*args: object) -> object:
                out = method(*args)
                if armed[0] and name == "compare_set" and settled(out):  # type: ignore[arg-type]
                    armed[0] = False
                    lockstep._group_store = real
                    os.kill(os.getpid(), signal.SIGSTOP)
                return out

            return call

    lockstep._group_store = lambda group: Store(real(group))  # type: ignore[assignment]


def _second(rank: int) -> None:
    lock = Lockstep(None, "three", datetime.timedelta(seconds=TIMEOUT_S))
    report_exchange(rank, "second", lambda: lock.statuses(Status.OK, "second"))


def main() -> None:
    scenario = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    last = dist.get_world_size() - 1
    pids: list[int] = [0] * dist.get_world_size()
    dist.all_gather_object(pids, os.getpid())
    Lockstep(None, "three", datetime.timedelta(seconds=60)).statuses(Status.OK, "first")
    if scenario == "gave-up-then-host-stopped":
        if rank == 0:
            _after_all_reduce("stop")
        if rank == 2:
            _after_all_reduce("pause")
        if rank == 1:
            _resume_after_stop(pids[0])
        else:
            time.sleep(LATE_S)  # rank 1 gives the exchange up meanwhile
    elif scenario == "host-stopped-after-completion":
        if rank == 0:
            _after_all_reduce("stop")
        if rank == last:
            _after_all_reduce("pause")
        if rank == 1:
            _resume_after_stop(pids[0])
    elif scenario == "peer-stopped-after-claim":
        if rank == last:
            _stop_after_claim_settled()
        if rank == (1 if last > 1 else 0):
            _resume_after_stop(pids[last])
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")
    _second(rank)
    # Every rank is past the second exchange (a stopped one once continued): the next one must pair.
    statuses, _ = Lockstep(None, "three", datetime.timedelta(seconds=60)).statuses(Status.OK, "third")
    report(rank=rank, event="third", statuses=statuses)
    sys.stdout.flush()
    finish(0)


if __name__ == "__main__":
    main()
