"""Start N real processes on this machine (gloo over loopback) and wait for them with a hard timeout.

Each rank is a fresh process of its own (its own interpreter state, process groups, engines and exit code), forked
from a server process that has already imported torch, transformers, peft, DeepSpeed, vLLM and TRL: every rank would
otherwise spend seconds importing them, and the suite starts over a hundred ranks. The server imports only, never
computes (no thread pool, no process group exists before a fork). ``LORA_STREAM_TEST_FORKSERVER=0`` starts every rank
with a new interpreter instead (``subprocess``), as before.
"""

from __future__ import annotations

import multiprocessing
import os
import runpy
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


#: What the fork server imports once, for every rank it forks: the slowest imports the workers make (importing is
#: all it does: vLLM and TRL start nothing at import).
PRELOAD = [
    "torch",
    "torch.distributed",
    "transformers",
    "transformers.models.llama.modeling_llama",
    "peft",
    "deepspeed",
    "vllm",
    "trl",
]
#: The environment the fork server is started with: read by libraries when they are loaded (OpenMP reads its
#: thread count then), so it must already be what every rank gets.
_SERVER_ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
_context: multiprocessing.context.ForkServerContext | None = None


def _forkserver() -> multiprocessing.context.ForkServerContext | None:
    global _context
    if os.environ.get("LORA_STREAM_TEST_FORKSERVER", "1") == "0":
        return None
    if _context is None:
        from multiprocessing import forkserver

        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        saved = {k: os.environ.get(k) for k in _SERVER_ENV}
        os.environ.update(_SERVER_ENV)
        try:
            forkserver.ensure_running()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        _context = ctx
    return _context


def _run_rank(script: str, args: list[str], env: dict[str, str], log_path: str, cwd: str) -> None:
    """A rank, in a process forked by the fork server: what ``python script args...`` would run, with ``env``, its
    output to ``log_path``."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.argv = [script, *args]
    sys.path[:0] = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path.insert(0, str(Path(script).parent))  # as `python script` puts the script's folder first
    runpy.run_path(script, run_name="__main__")


class _Rank:
    """One rank's process, forked (the fork server) or started (``subprocess``), with its output in a file."""

    def __init__(self, script: str, args: list[str], env: dict[str, str], cwd: str, fork: bool = True) -> None:
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
        ctx = _forkserver() if fork else None
        self.proc: multiprocessing.process.BaseProcess | subprocess.Popen[str]
        if ctx is not None:
            self.proc = ctx.Process(target=_run_rank, args=(script, args, env, self.log.name, cwd), daemon=False)
            self.proc.start()
        else:
            self.proc = subprocess.Popen(
                [sys.executable, script, *args], env=env, stdout=self.log, stderr=subprocess.STDOUT, cwd=cwd
            )

    def poll(self) -> int | None:
        if isinstance(self.proc, subprocess.Popen):
            return self.proc.poll()
        return self.proc.exitcode

    def kill(self) -> None:
        self.proc.kill()
        if isinstance(self.proc, subprocess.Popen):
            self.proc.wait()
        else:
            self.proc.join()

    def output(self) -> str:
        with open(self.log.name) as f:
            text = f.read()
        self.log.close()
        os.unlink(self.log.name)
        return text


def launch(
    worker: str,
    *args: str,
    world: int = 2,
    timeout: float = 240.0,
    env: dict[str, str | None] | None = None,
    ranks: bool = True,
    fork: bool = True,
) -> list[RankResult]:
    """Run ``tests/workers/<worker>.py`` (or the script at the path ``worker``, if it ends with ``.py``) as ``world``
    ranks; kill them all if any outlives ``timeout`` seconds.

    A hang therefore fails the test (every rank's output is kept for the message) instead of stalling CI. ``env``
    adds to this process's environment; a value of ``None`` removes the variable. ``ranks=False``: a program that is
    not a rank (a user's script), started without the rendezvous variables (``RANK``, ``WORLD_SIZE``, ...).
    ``fork=False``: a new interpreter, not a fork of the server (a program whose vLLM engine runs in a child process
    of its own: V1 multiprocessing started from a forked rank hangs).
    """
    port = free_port()
    start = time.monotonic()
    rendezvous = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(world)} if ranks else {}
    base_env = {
        **os.environ,
        **rendezvous,
        "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
        **_SERVER_ENV,
    }
    for key, value in (env or {}).items():
        if value is None:
            base_env.pop(key, None)
        else:
            base_env[key] = value
    script = worker if worker.endswith(".py") else str(TESTS / "workers" / f"{worker}.py")
    cwd = str(TESTS.parent)
    procs = [
        _Rank(script, list(args), {**base_env, **({"RANK": str(r), "LOCAL_RANK": str(r)} if ranks else {})}, cwd, fork)
        for r in range(world)
    ]
    ends: dict[int, float] = {}
    while len(ends) < world and time.monotonic() - start < timeout:
        for r, p in enumerate(procs):
            if r not in ends and p.poll() is not None:
                ends[r] = time.monotonic() - start
        time.sleep(0.05)
    for p in procs:
        if p.poll() is None:
            p.kill()
    results = []
    for r, p in enumerate(procs):
        code = p.poll()
        results.append(
            RankResult(r, code if r in ends and code is not None else -9, p.output(), ends.get(r, float("inf")))
        )
    return results


def describe(results: list[RankResult]) -> str:
    return "\n".join(
        f"--- rank {r.rank} rc={r.returncode} after {r.seconds:.1f}s ---\n{r.output[-4000:]}" for r in results
    )


def assert_all_ok(results: list[RankResult]) -> None:
    assert all(r.returncode == 0 for r in results), describe(results)
