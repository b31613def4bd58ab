"""Start N real processes on this machine (gloo over loopback) and wait for them with a hard timeout."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class RankResult:
    rank: int
    returncode: int
    output: str
    seconds: float


def launch(
    worker: str, *args: str, world: int = 2, timeout: float = 240.0, env: dict[str, str] | None = None
) -> list[RankResult]:
    """Run ``tests/workers/<worker>.py`` as ``world`` ranks; kill them all if any outlives ``timeout`` seconds.

    A hang therefore fails the test (every rank's output is kept for the message) instead of stalling CI.
    """
    port = free_port()
    procs = []
    start = time.monotonic()
    base_env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": str(world),
        "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        **(env or {}),
    }
    logs = []
    for rank in range(world):
        log = tempfile.TemporaryFile("w+")
        logs.append(log)
        procs.append(
            subprocess.Popen(
                [sys.executable, str(TESTS / "workers" / f"{worker}.py"), *args],
                env={**base_env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=str(TESTS.parent),
            )
        )
    ends: dict[int, float] = {}
    while len(ends) < world and time.monotonic() - start < timeout:
        for r, p in enumerate(procs):
            if r not in ends and p.poll() is not None:
                ends[r] = time.monotonic() - start
        time.sleep(0.05)
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    results = []
    for r, (p, log) in enumerate(zip(procs, logs)):
        log.seek(0)
        results.append(RankResult(r, p.returncode if r in ends else -9, log.read(), ends.get(r, float("inf"))))
        log.close()
    return results


def describe(results: list[RankResult]) -> str:
    return "\n".join(
        f"--- rank {r.rank} rc={r.returncode} after {r.seconds:.1f}s ---\n{r.output[-4000:]}" for r in results
    )


def assert_all_ok(results: list[RankResult]) -> None:
    assert all(r.returncode == 0 for r in results), describe(results)
