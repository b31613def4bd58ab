"""Shared pieces of the sync benchmarks: RSS sampling, launching 2 ranks per variant, the result table."""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

MiB = 2**20
PAGE = os.sysconf("SC_PAGE_SIZE")


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


class RssSampler(threading.Thread):
    """Samples this process's resident set every ``period`` seconds; ``stop()`` returns the peak.

    With ``keep=True`` every sample is also kept in ``samples`` as ``(time.perf_counter(), rss_bytes)``, for the
    RSS-against-time plot (``window`` cuts out one sync).
    """

    def __init__(self, period: float = 0.002, keep: bool = False) -> None:
        super().__init__(daemon=True)
        self.period = period
        self.peak = rss()
        self.running = True
        self.samples: list[tuple[float, int]] | None = [] if keep else None

    def run(self) -> None:
        while self.running:
            now = rss()
            self.peak = max(self.peak, now)
            if self.samples is not None:
                self.samples.append((time.perf_counter(), now))
            time.sleep(self.period)

    def window(self, start: float, end: float, base: int) -> list[tuple[float, int]]:
        """The kept samples between ``start`` and ``end`` (perf_counter times) as (seconds since ``start``, bytes
        above ``base``)."""
        return [(t - start, r - base) for t, r in self.samples or [] if start <= t <= end]

    def stop(self) -> int:
        self.running = False
        self.join()
        return max(self.peak, rss())


def llama_config(args: argparse.Namespace, **overrides: object):  # type: ignore[no-untyped-def]
    """The benchmarks' Llama shape from the command line (``--layers/--hidden/--intermediate/--vocab``)."""
    from transformers import LlamaConfig

    kw = dict(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=args.hidden // 64,
        tie_word_embeddings=False,
    )
    kw.update(overrides)
    return LlamaConfig(**kw)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def add_model_args(parser: argparse.ArgumentParser, layers: int = 16) -> None:
    """The benchmark model's shape: ``--layers/--hidden/--intermediate/--vocab`` (what :func:`llama_config` reads)."""
    parser.add_argument("--layers", type=int, default=layers)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=2816)
    parser.add_argument("--vocab", type=int, default=32000)


def model_cli(
    description: str, syncs: int, out: Path, extra: Callable[[argparse.ArgumentParser], object] | None = None
) -> tuple[argparse.Namespace, list[str]]:
    """The orchestrators' command line (model shape, syncs, budgets, output, and what ``extra`` adds), and the
    arguments for the workers."""
    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.add_argument("--syncs", type=int, default=syncs)
    ap.add_argument("--budgets-mib", default="32,128")
    ap.add_argument("--out", default=str(out))
    if extra is not None:
        extra(ap)
    args = ap.parse_args()
    worker_args = [f"--{k}={getattr(args, k)}" for k in ("layers", "hidden", "intermediate", "vocab", "syncs")]
    return args, worker_args


def rank_env(rank: int, port: int, world: int = 2) -> dict[str, str]:
    """The environment of one torch.distributed rank on this machine (one intra-op thread: the ranks share cores)."""
    return {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": str(world),
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "OMP_NUM_THREADS": "1",
    }


def run_variant(
    worker: Path, variant: str, extra: list[str], common: list[str], tmp: str, timeout: float
) -> list[dict]:
    """Run one variant as 2 fresh ranks (so one variant's freed heap cannot flatter the next one's RSS)."""
    out = os.path.join(tmp, f"{variant}-{'-'.join(extra) or 'default'}".replace("/", "_"))
    port = free_port()
    procs = []
    for rank in range(2):
        env = rank_env(rank, port)
        procs.append(
            subprocess.Popen(
                [sys.executable, str(worker), variant, *extra, *common, "--out", out],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=timeout)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    if any(p.returncode for p in procs):
        raise SystemExit(f"variant {variant} {extra} failed:\n" + "\n".join(log[-3000:] for log in logs))
    return [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(2)]


def table(rows: list[dict], baseline: str) -> str:
    """Per variant and rank: time, gathered bytes, RSS growth, drift; ratios against ``baseline`` of the same run."""
    base = {r["rank"]: r for r in rows if r["variant"] == baseline}
    header = (
        f"{'variant':<22} {'options':<14} {'budget':>7} {'rank':>4} {'median sync':>11} {'x base':>7} "
        f"{'peak gathered':>14} {'x fewer':>7} {'RSS growth':>11} {'x less':>7} {'largest grp':>11} "
        f"{'drift (elements)':>16}"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        b = base[r["rank"]]
        budget = f"{r['budget_bytes'] // MiB}M" if r["budget_bytes"] else "-"
        lines.append(
            f"{r['variant']:<22} {','.join(r['options']) or '-':<14} {budget:>7} {r['rank']:>4} "
            f"{r['median_sync_s']:>10.2f}s "
            f"{r['median_sync_s'] / b['median_sync_s']:>7.2f} {r['peak_gathered_bytes'] / MiB:>11.1f}MiB "
            f"{b['peak_gathered_bytes'] / max(r['peak_gathered_bytes'], 1):>7.1f} "
            f"{r['rss_growth_bytes'] / MiB:>8.0f}MiB {b['rss_growth_bytes'] / max(r['rss_growth_bytes'], 1):>7.1f} "
            f"{r['largest_group_bytes'] / MiB:>8.1f}MiB {r['drift_changed_elements']:>16}"
        )
    return "\n".join(lines)


def start_vllm_server(model: str, env: dict[str, str] | None = None) -> tuple[subprocess.Popen[bytes], str]:
    """A vLLM OpenAI server (dev mode, lora_stream's gloo weight transfer, float32, no tokenizer) for ``model`` on
    127.0.0.1, with ``env`` on top of this process's; returns it and its URL (:func:`wait_vllm_server`)."""
    port = free_port()
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", **(env or {})}
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--dtype", "float32"]
    cmd += ["--max-model-len", "128", "--enforce-eager", "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--skip-tokenizer-init", "--weight-transfer-config", '{"backend": "gloo"}']
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return proc, f"http://127.0.0.1:{port}"


def wait_vllm_server(proc: subprocess.Popen[bytes], url: str, timeout: float) -> None:
    """Until ``url/health`` answers 200; exit if the server dies or ``timeout`` seconds pass."""
    import requests

    deadline = time.monotonic() + timeout
    while True:
        try:
            if requests.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except requests.RequestException:
            pass
        if time.monotonic() > deadline or proc.poll() is not None:
            raise SystemExit(f"vLLM server at {url} did not start")
        time.sleep(1)
