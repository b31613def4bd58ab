"""Shared pieces of the benchmarks: RSS sampling, launching 2 ranks, vLLM servers, interleaved timing, tables and
the JSON they write."""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

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


def rss_growth() -> Callable[[], int]:
    """Start sampling this process's RSS (:class:`RssSampler`); the function returned stops the sampler and gives
    the peak's growth over the RSS read here (a ``watch`` of :func:`interleave`)."""
    before = rss()
    sampler = RssSampler()
    sampler.start()
    return lambda: sampler.stop() - before


def tree_rss(proc: Any) -> int:
    """The RSS summed over a ``psutil.Process`` and its children (a vLLM server and its engine core)."""
    import psutil

    total = 0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total


class TreeRss(threading.Thread):
    """Peak growth of the RSS summed over a process and its children (:func:`tree_rss`), sampled every 5 ms."""

    def __init__(self, proc: Any) -> None:
        super().__init__(daemon=True)
        self.proc = proc
        self.base = self.peak = self.sample()
        self.running = True

    def sample(self) -> int:
        return tree_rss(self.proc)

    def run(self) -> None:
        while self.running:
            self.peak = max(self.peak, self.sample())
            time.sleep(0.005)

    def stop(self) -> int:
        self.running = False
        self.join()
        return max(self.peak, self.sample()) - self.base


def tree_rss_growth(proc: Any) -> Callable[[], int]:
    """Start a :class:`TreeRss` on ``proc`` (a ``psutil.Process``); the function returned stops it and gives the
    peak growth (a ``watch`` of :func:`interleave`)."""
    sampler = TreeRss(proc)
    sampler.start()
    return sampler.stop


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


def run_ranks(
    cmd: list[str],
    out: str,
    *,
    timeout: float,
    failure: str = "",
    env: Mapping[str, str] | None = None,
    capture: bool = True,
    tail: int = 3000,
) -> list[dict]:
    """Run ``cmd`` as the 2 ranks of a torch.distributed group on this machine (:func:`rank_env`, ``env`` on top) and
    return what each wrote to ``{out}.rank{r}.json``. Past ``timeout`` seconds both are killed. With ``capture``
    their output is kept, and a failure exits with ``failure`` followed by the last ``tail`` characters of each
    rank's; without, they print here and a failure exits with ``failure`` alone."""
    port = free_port()
    pipes: dict[str, Any] = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True} if capture else {}
    procs = [subprocess.Popen(cmd, env={**rank_env(r, port), **(env or {})}, **pipes) for r in range(2)]
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=timeout)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    if any(p.returncode for p in procs):
        raise SystemExit(failure + ("\n".join(log[-tail:] for log in logs) if capture else ""))
    return [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(2)]


def run_variant(
    worker: Path, variant: str, extra: list[str], common: list[str], tmp: str, timeout: float
) -> list[dict]:
    """Run one variant as 2 fresh ranks (so one variant's freed heap cannot flatter the next one's RSS)."""
    out = os.path.join(tmp, f"{variant}-{'-'.join(extra) or 'default'}".replace("/", "_"))
    cmd = [sys.executable, str(worker), variant, *extra, *common, "--out", out]
    return run_ranks(cmd, out, timeout=timeout, failure=f"variant {variant} {extra} failed:\n")


class Col(NamedTuple):
    """A column of :func:`format_table`: its title, the format spec of its values (``">10.2f"``) and a unit written
    right after each value (``"s"``, ``"MiB"``). The title is as wide as value and unit together, aligned as the
    spec says, else right for numeric types (``d``, ``f``, ...) and left for the rest (as ``format`` aligns them)."""

    title: str
    spec: str = ""
    unit: str = ""


_SPEC = re.compile(r"(?P<align>[<>^=]?)(?P<width>\d*)(?:\.\d+)?(?P<type>[a-zA-Z%]?)")


def format_table(
    cols: Sequence[Col], rows: Iterable[Sequence[object] | str], *, rule: bool = True, indent: str = ""
) -> str:
    """The lines of a table: the titles, a rule of dashes as long as them (with ``rule``), then one line per row,
    its values in ``cols``' formats, one space apart; every line starts with ``indent``. A row that is a ``str`` is a
    line of its own, printed as it is."""
    titles = []
    for c in cols:
        m = _SPEC.fullmatch(c.spec)
        if m is None:
            raise ValueError(f"column {c.title!r}: spec {c.spec!r} takes [align][width][.precision][type]")
        align = {"=": ">"}.get(m["align"], m["align"]) or (">" if m["type"] and m["type"] != "s" else "")
        width = str(int(m["width"]) + len(c.unit)) if m["width"] else ""
        titles.append(f"{c.title:{align}{width}}")
    header = " ".join(titles)
    lines = [indent + header] + ([indent + "-" * len(header)] if rule else [])
    for row in rows:
        if isinstance(row, str):
            lines.append(row)
        else:
            lines.append(indent + " ".join(f"{v:{c.spec}}{c.unit}" for c, v in zip(cols, row, strict=True)))
    return "\n".join(lines)


#: The columns of :func:`table`.
SYNC_COLUMNS = (
    Col("variant", "<22"),
    Col("options", "<14"),
    Col("budget", ">7"),
    Col("rank", ">4"),
    Col("median sync", ">10.2f", "s"),
    Col("x base", ">7.2f"),
    Col("peak gathered", ">11.1f", "MiB"),
    Col("x fewer", ">7.1f"),
    Col("RSS growth", ">8.0f", "MiB"),
    Col("x less", ">7.1f"),
    Col("largest grp", ">8.1f", "MiB"),
    Col("drift (elements)", ">16"),
)


def table(rows: list[dict], baseline: str) -> str:
    """Per variant and rank: time, gathered bytes, RSS growth, drift; ratios against ``baseline`` of the same run."""
    base = {r["rank"]: r for r in rows if r["variant"] == baseline}
    lines = []
    for r in rows:
        b = base[r["rank"]]
        lines.append(
            [
                r["variant"],
                ",".join(r["options"]) or "-",
                f"{r['budget_bytes'] // MiB}M" if r["budget_bytes"] else "-",
                r["rank"],
                r["median_sync_s"],
                r["median_sync_s"] / b["median_sync_s"],
                r["peak_gathered_bytes"] / MiB,
                b["peak_gathered_bytes"] / max(r["peak_gathered_bytes"], 1),
                r["rss_growth_bytes"] / MiB,
                b["rss_growth_bytes"] / max(r["rss_growth_bytes"], 1),
                r["largest_group_bytes"] / MiB,
                r["drift_changed_elements"],
            ]
        )
    return format_table(SYNC_COLUMNS, lines)


def write_json(path: str | Path, data: object, indent: int | None = 1) -> Path:
    """``data`` as JSON at ``path`` (its folder made if missing); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=indent))
    return path


def start_vllm_server(
    model: str, env: Mapping[str, str] | None = None, args: Sequence[str] = (), dtype: str = "float32"
) -> tuple[subprocess.Popen[bytes], str]:
    """A vLLM OpenAI server (dev mode, lora_stream's gloo weight transfer, ``dtype``, no tokenizer) for ``model`` on
    127.0.0.1, with ``env`` on top of this process's and ``args`` after the common flags; returns it and its URL
    (:func:`wait_vllm_server`, :func:`stop_vllm_servers`; :func:`vllm_servers` does all three)."""
    port = free_port()
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", **(env or {})}
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--dtype", dtype]
    cmd += ["--max-model-len", "128", "--enforce-eager", "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--skip-tokenizer-init", "--weight-transfer-config", '{"backend": "gloo"}', *args]
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


def stop_vllm_servers(servers: Iterable[tuple[subprocess.Popen[bytes], str]]) -> None:
    """Terminate every server of ``servers`` (``(process, url)`` pairs), then wait for each (60 s at most)."""
    servers = list(servers)
    for proc, _ in servers:
        proc.terminate()
    for proc, _ in servers:
        proc.wait(timeout=60)


@contextmanager
def vllm_servers(
    model: str,
    count: int = 1,
    *,
    timeout: float,
    env: Mapping[str, str] | None = None,
    args: Sequence[str] = (),
    one_by_one: bool = False,
    dtype: str = "float32",
) -> Iterator[list[tuple[subprocess.Popen[bytes], str]]]:
    """``count`` servers of :func:`start_vllm_server` (``env``, ``args``, ``dtype``) for ``model``, as
    ``(process, url)`` pairs, each ready (:func:`wait_vllm_server`, ``timeout`` seconds); stopped on leaving, however
    it is left (:func:`stop_vllm_servers`). All start at once, or with ``one_by_one`` each once the previous one is
    ready (a start-up takes the cores). ``with vllm_servers(path, timeout=600) as [(server, url)]:`` for one."""
    servers: list[tuple[subprocess.Popen[bytes], str]] = []
    try:
        for _ in range(count):
            servers.append(start_vllm_server(model, env, args, dtype))
            if one_by_one:
                wait_vllm_server(*servers[-1], timeout)
        if not one_by_one:
            for proc, url in servers:
                wait_vllm_server(proc, url, timeout)
        yield servers
    finally:
        stop_vllm_servers(servers)


class Sample(NamedTuple):
    """One timed call of :func:`interleave`: its seconds, what it returned, and what the ``watch`` measured."""

    seconds: float
    result: Any
    growth: int | None


def interleave(
    rounds: int,
    fns: Mapping[str, Callable[[int], object]],
    *,
    before: Callable[[str], object] | None = None,
    watch: Callable[[], Callable[[], int]] | None = None,
) -> dict[str, list[Sample]]:
    """Call each of ``fns`` once per round, in the same order every round, ``rounds`` rounds, so that the machine's
    drift hits them all alike; per name, a :class:`Sample` per round (dropping a warm-up round is the caller's:
    ``samples[1:]``). Each call gets the round's index, and only the call is timed: ``before(name)`` runs ahead of
    it (a barrier, a setting), and ``watch()`` starts a measurement right before it and returns what stops it right
    after, the sample's ``growth`` (:func:`rss_growth`, :func:`tree_rss_growth`)."""
    samples: dict[str, list[Sample]] = {name: [] for name in fns}
    for i in range(rounds):
        for name, fn in fns.items():
            if before is not None:
                before(name)
            stop = watch() if watch is not None else None
            t0 = time.perf_counter()
            result = fn(i)
            seconds = time.perf_counter() - t0
            samples[name].append(Sample(seconds, result, stop() if stop is not None else None))
    return samples


def median_seconds(samples: Iterable[Sample]) -> float:
    """The median of the samples' seconds."""
    return statistics.median(s.seconds for s in samples)


def median_growth(samples: Iterable[Sample]) -> float:
    """The median of the samples' ``growth``."""
    return statistics.median(s.growth or 0 for s in samples)


def rank_rows(ranks: Sequence[Mapping[str, Any]], key: str, value: object) -> list[list[dict]]:
    """Per rank's result, its ``rows`` whose ``key`` is ``value``."""
    return [[row for row in rank["rows"] if row[key] == value] for rank in ranks]


def median_of(rows: Iterable[Mapping[str, Any]], key: str) -> float:
    """The median of the rows' ``key`` (``None`` counting as 0), as a float."""
    return float(statistics.median(float(row[key] or 0.0) for row in rows))
