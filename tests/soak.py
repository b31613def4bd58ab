"""The soak: a 2-rank ZeRO-3 trainer keeps a fleet of two real vLLM servers in sync, round after round, with a
random fault in each round, while a client generates against both servers throughout.

After every round it checks the transaction's promises by their strongest observables:

- both trainer ranks ended the round the same way (both committed, or every surviving rank raised), each within the
  sink's deadline (a slow rank: within its sleep plus the deadline);
- every server is not paused, holds no open update (its lease is free), reports its last committed version, and
  serves exactly (``==``) what it served at that version;
- after a commit, each server serves the trainer's merged weights (checked by the rank that feeds it);
- the next round's sync is taken (a plain round commits);
- every response the client got during the whole soak is one a committed version gives.

With ``elements=True`` the trainer fully fine-tunes the model (no LoRA) and syncs with element syncs
(``VLLMServerSink(elements=True)``): between syncs it edits a few elements of each rank's own ZeRO-3 partition, so
that a sync following a committed one (same trainer launch) sends only those elements, which the servers rebuild
from the copy they keep; each such round must go as elements, and every other promise above holds unchanged (a
committed server serves the trainer's own weights). Its plan puts two plain rounds after every fault round: the
first is full (it follows a failure), the second goes as elements, and the next fault interrupts an element sync.

Faults: ``raise`` / ``slow`` / ``die`` on a random rank at a random transaction point, ``kill-server`` and
``stop-server`` (SIGSTOP past the sink's timeout, then SIGCONT) on a random server mid-transfer; processes stopped
rather than dead: ``stop-rank`` (a trainer rank SIGSTOPped past the lease at a random point, then continued) and
``stall-server`` (a server SIGSTOPped longer than the lease, shorter than the sink's timeout, mid-transfer).
After a trainer death the driver checks that the servers healed by themselves within their lease, then launches
the trainer again for the remaining rounds. Used by ``tests/test_vllm_soak.py`` (a bounded number of rounds) and
``benchmarks/bench_soak.py`` (as many as you like).
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests
from helpers import greedy_completion
from launch import RankResult, describe, launch
from vllm_server import Server

FAULTS = ("raise", "slow", "die", "kill-server", "stop-server", "stall-server", "stop-rank")
#: Kinds whose round may commit or fail, as long as every rank and every server agree: a stopped rank or a stalled
#: server that comes back within the agreements' wait, its lease intact, lets the sync go on.
EITHER = frozenset({"stall-server", "stop-rank"})
#: Transaction points of the server sink (``FAULT_POINTS``; the model has four groups; ``verify`` is not a server
#: sink's point).
POINTS = ("prepare", "group:0", "group:1", "group:3", "reload-check", "prefix-cache", "commit")
PROMPT = "t5 t17 t42 t99"
#: Short timeouts, so that a round with a fault ends in seconds; the relations between them are what is tested.
TIMEOUTS = {"stream": 20.0, "sink": 15.0, "prefix_cache": 5.0, "lease": 12.0, "slow_extra": 4.0, "stop_extra": 8.0}
#: Slack on the measured bounds: process scheduling on a loaded 2-core machine.
SLACK_S = 15.0
# Tolerance for the client's responses only: a response computed in a batch with other requests may differ from the
# same version's lone answer in the last bits. Versions differ by far more (a training step at lr 0.5).
_CLIENT_TOL = 1e-4


def soak_servers(checkpoint: str) -> list[Server]:
    """The soak's two servers, started (not yet ready): each one's OpenMP threads on a core of its own, so that two
    engines generating on a 2-core machine do not spin against each other and starve the trainer."""
    cores = os.cpu_count() or 2
    return [
        Server(checkpoint, env={"VLLM_CPU_OMP_THREADS_BIND": str(i % cores), "OMP_NUM_THREADS": "1"}) for i in range(2)
    ]


def make_plan(seed: int, rounds: int, kinds: tuple[str, ...] = FAULTS, plain_after: int = 0) -> list[dict[str, Any]]:
    """Rounds 0..rounds-1: a plain one first (the servers' first update also loads lora_stream's engine in their
    workers, which takes seconds on a loaded machine), every kind once (in a seeded order), then random kinds and
    plain rounds; the last round is plain (the fleet must take a sync after everything before). ``plain_after``:
    that many plain rounds after every fault round (an element soak's: a full sync after the failure, then an
    element sync); 0 gives the plans it always gave for a seed."""
    rng = random.Random(seed)
    order = list(kinds)
    rng.shuffle(order)
    plan: list[dict[str, Any]] = []
    for k in range(rounds):
        slot, spacer = divmod(k - 1, plain_after + 1)
        if k == 0 or k == rounds - 1 or spacer:
            kind = "none"
        elif slot < len(order):
            kind = order[slot]
        else:
            kind = rng.choice([*kinds, "none"])
        point = rng.choice(POINTS)
        if kind == "stop-rank" and slot < len(order):
            point = "commit"  # its first round: past the lease with its server loaded, just before the vote
        plan.append({"k": k, "fault": kind, "rank": rng.randrange(2), "point": point, "server": rng.randrange(2)})
    return plan


def rounds_at_every_point(kind: str, rank: int, start: int = 0) -> list[dict[str, Any]]:
    """One round of ``kind`` on ``rank`` at each of :data:`POINTS`, each followed by a plain round."""
    plan: list[dict[str, Any]] = []
    for point in POINTS:
        plan.append({"k": start + len(plan), "fault": kind, "rank": rank, "point": point, "server": rank})
        plan.append({"k": start + len(plan), "fault": "none", "rank": rank, "point": point, "server": rank})
    return plan


def completion(url: str, timeout: float = 60.0) -> tuple[tuple[int, ...], tuple[float, ...]]:
    return greedy_completion(url, PROMPT, max_tokens=8, timeout=timeout)


def _close(a: tuple[tuple[int, ...], tuple[float, ...]], b: tuple[tuple[int, ...], tuple[float, ...]]) -> bool:
    return a[0] == b[0] and all(abs(x - y) <= _CLIENT_TOL for x, y in zip(a[1], b[1]))


class Client:
    """Generates against every server, one request at a time each with ``gap`` seconds between them (two servers
    generating without a break would leave a 2-core machine's trainers no CPU), until stopped; keeps every answer."""

    def __init__(self, urls: list[str], gap: float = 0.3) -> None:
        self.gap = gap
        self.urls = urls
        self.answers: list[tuple[int, tuple[tuple[int, ...], tuple[float, ...]]]] = []
        self.errors = 0
        self._run = threading.Event()
        self._quit = threading.Event()
        self._idle = [threading.Event() for _ in urls]  # no urls: a client that sends nothing
        self._threads = [threading.Thread(target=self._loop, args=(i,), daemon=True) for i in range(len(urls))]
        for t in self._threads:
            t.start()

    def _loop(self, i: int) -> None:
        while not self._quit.is_set():
            if not self._run.is_set():
                self._idle[i].set()
                time.sleep(0.05)
                continue
            self._idle[i].clear()
            try:
                self.answers.append((i, completion(self.urls[i], timeout=120)))
            except Exception:  # aborted, refused or the server is down: allowed; a wrong answer is not
                self.errors += 1
            time.sleep(self.gap)

    def resume(self) -> None:
        self._run.set()

    def pause(self) -> None:
        self._run.clear()
        for e in self._idle:
            e.wait(timeout=180)

    def stop(self) -> None:
        self.pause()
        self._quit.set()


@dataclass
class SoakReport:
    rounds: list[dict[str, Any]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    answers: int = 0
    client_errors: int = 0
    uncommitted_answers: int = 0
    launches: int = 0

    def as_json(self) -> dict[str, Any]:
        return {
            "rounds": self.rounds,
            "problems": self.problems,
            "answers": self.answers,
            "client_errors": self.client_errors,
            "uncommitted_answers": self.uncommitted_answers,
            "launches": self.launches,
        }


class Soak:
    """Drives one soak over ``servers`` (two running :class:`~vllm_server.Server`, serving ``checkpoint``)."""

    def __init__(
        self,
        servers: list[Server],
        checkpoint: str,
        workdir: Path,
        *,
        seed: int = 0,
        timeouts: dict | None = None,  # type: ignore[type-arg]
        merge: str = "trainer",
        elements: bool = False,
    ) -> None:
        #: Where the merge runs (the sink's ``merge=``): ``"engine"`` soaks the servers' own merges and base.
        self.merge = merge
        #: Element syncs (the sink's ``elements=``): a fully fine-tuned trainer whose syncs send changed elements.
        if elements and merge != "trainer":
            raise ValueError("an element soak merges nothing: elements=True needs merge='trainer'")
        self.elements = elements
        #: The launch whose last round committed (``None``: the last round failed, or none ran): with elements, the
        #: next committed round of that launch must have gone as elements.
        self._committed_in: int | None = None
        self.servers = servers
        self.urls = [s.url for s in servers]
        self.checkpoint = checkpoint
        self.workdir = workdir
        self.seed = seed
        self.timeouts = {**TIMEOUTS, **(timeouts or {})}
        self.report = SoakReport()

    # -- the servers' state ------------------------------------------------------------------------------------------
    def _state(self, i: int) -> dict[str, Any]:
        url = self.urls[i]
        lease = requests.get(f"{url}/lora_stream/lease", timeout=10).json()
        paused = requests.get(f"{url}/is_paused", timeout=10).json()["is_paused"]
        return {"paused": paused, "holding": lease["holding"], "version": self.servers[i].version(), "lease": lease}

    def _settled(self, i: int, within: float) -> dict[str, Any]:
        """Wait until server ``i`` is neither paused nor held (its lease may still be healing it)."""
        deadline = time.monotonic() + within
        while True:
            state = self._state(i)
            if (not state["paused"] and not state["holding"]) or time.monotonic() > deadline:
                return state
            time.sleep(0.25)

    # -- one soak ---------------------------------------------------------------------------------------------------
    def run(
        self,
        rounds: int = 0,
        kinds: tuple[str, ...] = FAULTS,
        log: Any = None,
        plan: list[dict[str, Any]] | None = None,
        client: bool = True,
    ) -> SoakReport:
        """``rounds`` random rounds of ``kinds`` (:func:`make_plan`), or exactly ``plan``; ``client=False``: no
        client generating meanwhile (the servers' state is still checked after every round)."""
        if plan is None:
            plan = make_plan(self.seed, rounds, kinds, plain_after=2 if self.elements else 0)
        served = [[completion(u)] for u in self.urls]  # each server's outputs, per committed version, initial first
        versions: list[str | None] = [s.version() for s in self.servers]
        self._fresh_version = versions[0]  # what a freshly started server reports ("default" with vLLM 0.32)
        initial = [served[i][0] for i in range(2)]
        client = Client(self.urls if client else [])
        left = list(plan)
        try:
            while left:
                left = self._launch(left, served, versions, initial, client, log)
        finally:
            client.stop()
        for i, answer in client.answers:
            if not any(_close(answer, v) for v in served[i]):
                self.report.uncommitted_answers += 1
        self.report.answers = len(client.answers)
        self.report.client_errors = client.errors
        if self.report.uncommitted_answers:
            self.report.problems.append(
                f"{self.report.uncommitted_answers} of {len(client.answers)} responses came from no committed version"
            )
        return self.report

    def _launch(
        self,
        left: list[dict[str, Any]],
        served: list[list[Any]],
        versions: list[str | None],
        initial: list[Any],
        client: Client,
        log: Any,
    ) -> list[dict[str, Any]]:
        """One launch of the trainer for the rounds ``left``; returns the rounds a trainer death left undone."""
        markers = self.workdir / f"markers-{self.report.launches}"
        markers.mkdir(parents=True)
        plan_file = markers / "plan.json"
        plan_file.write_text(
            json.dumps(
                {
                    "rounds": left,
                    "timeouts": self.timeouts,
                    "seed": self.seed,
                    "merge": self.merge,
                    "elements": self.elements,
                }
            )
        )
        results: list[RankResult] = []
        job = threading.Thread(
            target=lambda: results.extend(
                launch("vllm_soak", str(plan_file), *self.urls, self.checkpoint, str(markers), timeout=3600)
            ),
            daemon=True,
        )
        self.report.launches += 1
        job.start()
        t = self.timeouts
        for n, fault in enumerate(left):
            k = fault["k"]
            done = [markers / f"round{k}.rank{r}" for r in range(2)]
            stopped: threading.Thread | None = None
            killed = False
            while not all(p.exists() or self._dead(markers, r) for r, p in enumerate(done)):
                if (markers / f"fault{k}").exists() and not (markers / f"faulted{k}").exists():
                    server = self.servers[fault["server"]]
                    if fault["fault"] == "stop-rank":
                        pid = json.loads((markers / f"fault{k}").read_text())["pid"]
                        os.kill(pid, signal.SIGSTOP)
                        hold = t["lease"] + t["stop_extra"]

                        def cont_rank(pid: int = pid, hold: float = hold, done: Path = markers / f"faulted{k}") -> None:
                            time.sleep(hold)
                            done.write_text("done")  # before the rank runs again: it finds it at once
                            os.kill(pid, signal.SIGCONT)

                        stopped = threading.Thread(target=cont_rank, daemon=True)
                        stopped.start()
                        while not (markers / f"faulted{k}").exists():
                            time.sleep(0.05)
                        continue
                    if fault["fault"] == "kill-server":
                        server.kill()
                        killed = True
                    else:
                        os.killpg(server.proc.pid, signal.SIGSTOP)
                        # stop-server: past the sink's timeout; stall-server: past the lease, within the timeout.
                        hold = t["sink"] + t["stop_extra"] if fault["fault"] == "stop-server" else t["lease"] + 1.5

                        def cont(pid: int = server.proc.pid, hold: float = hold) -> None:
                            time.sleep(hold)
                            os.killpg(pid, signal.SIGCONT)

                        stopped = threading.Thread(target=cont, daemon=True)
                        stopped.start()
                    (markers / f"faulted{k}").write_text("done")
                if not job.is_alive():
                    break
                time.sleep(0.05)
            outcomes = [json.loads(p.read_text()) if p.exists() else None for p in done]
            if stopped is not None:
                stopped.join()
            if killed:
                self.servers[fault["server"]].restart()
                served[fault["server"]].append(initial[fault["server"]])
                versions[fault["server"]] = self._fresh_version
            died = [r for r in range(2) if outcomes[r] is None]
            row = self._check(fault, outcomes, died, served, versions, client)
            self.report.rounds.append(row)
            if log is not None:
                log(row)
            if died:
                (markers / "exit").write_text("exit")
                job.join(timeout=120)
                if any(r.returncode not in (0, 9) for r in results):
                    self.report.problems.append(f"round {k}: a trainer rank ended badly\n{describe(results)}")
                return left[n + 1 :]
            (markers / f"go{k}").write_text("go")
        job.join(timeout=120)
        if job.is_alive() or any(r.returncode != 0 for r in results):
            self.report.problems.append(f"the trainer did not end cleanly\n{describe(results)}")
        return []

    @staticmethod
    def _dead(markers: Path, rank: int) -> bool:
        """Whether trainer rank ``rank`` of this launch started and is gone."""
        pid_file = markers / f"pid.rank{rank}"
        if not pid_file.exists():
            return False
        try:
            os.kill(json.loads(pid_file.read_text())["pid"], 0)
        except ProcessLookupError:
            return True
        return False

    def _check(
        self,
        fault: dict[str, Any],
        outcomes: list[dict[str, Any] | None],
        died: list[int],
        served: list[list[Any]],
        versions: list[str | None],
        client: Client,
    ) -> dict[str, Any]:
        k, kind = fault["k"], fault["fault"]
        t = self.timeouts
        problems: list[str] = []
        alive = [o for o in outcomes if o is not None]
        committed = {o["committed"] for o in alive}
        if len(committed) != 1:
            problems.append(f"the ranks disagreed: {[(o['rank'], o['committed']) for o in alive]}")
        did_commit = committed == {True}
        expected = kind == "none"
        if did_commit != expected and kind not in EITHER:
            problems.append(
                f"{'committed' if did_commit else 'raised'} where the fault {kind} should have "
                + ("let it commit" if expected else "failed it")
            )
        for o in alive:
            bound = o["deadline_s"] + SLACK_S
            if kind == "slow" and o["rank"] == fault["rank"]:
                bound += o["wait_s"] + t["slow_extra"]
            if kind == "stop-server":
                bound += 1.0
            if kind == "stop-rank" and o["rank"] == fault["rank"]:
                bound += t["lease"] + t["stop_extra"]
            if kind == "stall-server":
                bound += t["lease"] + 1.5
            if o["seconds"] > bound:
                problems.append(f"rank {o['rank']} took {o['seconds']:.1f} s, past its bound of {bound:.1f} s")
            if did_commit and not o.get("serves_trainer", False):
                problems.append(f"rank {o['rank']}'s server does not serve the trainer's weights: {o.get('mismatch')}")
        as_elements = did_commit and self.elements and all(o.get("elements", False) for o in alive)
        if did_commit and self.elements:
            if len({o.get("elements", False) for o in alive}) != 1:
                said = [(o["rank"], o.get("elements")) for o in alive]
                problems.append(f"the ranks disagreed on sending elements: {said}")
            # A sync after a committed one by the same trainer, with no other writer in between (a restarted server
            # follows a failed round), changes a few elements: it goes as elements.
            if self._committed_in == self.report.launches and not as_elements:
                why = [
                    {key: o.get(key) for key in ("full_because", "elements_refused", "tensors", "skipped")}
                    for o in alive
                ]
                problems.append(f"a sync after a committed one did not go as elements: {why}")
        self._committed_in = self.report.launches if did_commit else None
        # The servers: a vanished trainer's are healed by their lease; give it that long (plus its heartbeat).
        within = t["lease"] * 1.5 + SLACK_S if died or kind in ("stop-server", *EITHER) else SLACK_S
        client.pause()
        states = []
        for i in range(2):
            state = self._settled(i, within)
            states.append({key: state[key] for key in ("paused", "holding", "version")})
            if did_commit:
                versions[i] = f"v{k}-{self.seed}"
            if state["paused"] or state["holding"]:
                problems.append(f"server {i} is left {'paused' if state['paused'] else 'holding an update'}: {state}")
            if state["version"] != versions[i]:
                problems.append(
                    f"server {i} reports {state['version']!r}, its last committed version is {versions[i]!r}"
                )
            now = completion(self.urls[i])
            if did_commit:
                served[i].append(now)
            elif now != served[i][-1]:
                problems.append(f"server {i} does not serve exactly its last committed version {versions[i]!r}")
        client.resume()
        self.report.problems += [f"round {k} ({kind} {fault}): {p}" for p in problems]
        return {
            "k": k,
            "fault": kind,
            "rank": fault["rank"],
            "point": fault["point"],
            "server": fault["server"],
            "committed": did_commit,
            "elements": as_elements,
            "element_tensors": [o.get("element_tensors") if o else None for o in outcomes],
            "died": died,
            "seconds": [round(o["seconds"], 1) if o else None for o in outcomes],
            "errors": [o.get("error") if o else "died" for o in outcomes],
            "servers": states,
            "ok": not problems,
        }
