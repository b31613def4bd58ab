"""The transaction under a soak with random faults, into a fleet of two real vLLM servers (tests/soak.py).

A bounded number of rounds in CI, every fault kind at least once; ``benchmarks/bench_soak.py`` runs as many as you like,
with other seeds."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from helpers import require, save_for_vllm, vllm_llama
from soak import FAULTS, POINTS, Soak, soak_servers
from vllm_server import Server, running

#: Rounds in CI: each fault kind once, then random ones, the last one plain. ``LORA_STREAM_SOAK_ROUNDS`` overrides.
ROUNDS = int(os.environ.get("LORA_STREAM_SOAK_ROUNDS", "9"))
SEED = int(os.environ.get("LORA_STREAM_SOAK_SEED", "31"))
#: The every-point test's timeouts (no client runs, so the servers answer at once): an agreement waits 12 s (2 x 4 + 1
#: + a margin of 3), a slow rank sleeps 16 s.
SHORT = {"stream": 10.0, "sink": 4.0, "prefix_cache": 1.0, "lease": 6.0, "margin": 3.0}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    require("vllm")
    require("deepspeed")
    return save_for_vllm(vllm_llama(tie=False), str(tmp_path_factory.mktemp("soak") / "model"), tokenizer=True)


@pytest.fixture(scope="module")
def servers(checkpoint: str):  # type: ignore[no-untyped-def]
    """The two servers both soaks run against: each soak starts with a plain round, and restarts a server it kills."""
    started = soak_servers(checkpoint)
    with running(started) as ready:
        yield ready


def test_every_round_of_a_soak_with_random_faults_ends_with_every_server_on_its_last_committed_version(
    checkpoint: str, servers: list[Server], tmp_path: Path
) -> None:
    report = Soak(servers, checkpoint, tmp_path, seed=SEED).run(ROUNDS)
    text = json.dumps(report.as_json(), indent=1)
    assert not report.problems, text
    assert {r["fault"] for r in report.rounds} >= set(FAULTS), text
    assert len(report.rounds) == ROUNDS and report.rounds[-1]["committed"], text
    assert report.answers > 0 and report.uncommitted_answers == 0, text


def test_the_soak_with_the_merge_in_the_engine_ends_every_round_on_the_last_committed_version(
    checkpoint: str, servers: list[Server], tmp_path: Path
) -> None:
    """The same promises with ``merge="engine"``: the servers' workers merge on the base they keep, a partial
    update rolls back by recomputing, and a heal after a commit rolls forward. A rank raising, dying, and stopped
    past its lease; a plain round first and last."""
    for s in servers:
        if not s.healthy():  # the other soak left it down
            s.restart()
    kinds = ("raise", "die", "stop-rank")
    report = Soak(servers, checkpoint, tmp_path, seed=SEED + 2, merge="engine").run(len(kinds) + 2, kinds=kinds)
    text = json.dumps(report.as_json(), indent=1)
    assert not report.problems, text
    assert {r["fault"] for r in report.rounds} >= set(kinds) and report.rounds[-1]["committed"], text
    assert report.answers > 0 and report.uncommitted_answers == 0, text


def test_the_soak_with_elements_on_ends_every_round_on_the_last_committed_version(
    checkpoint: str, servers: list[Server], tmp_path: Path
) -> None:
    """The same promises with element syncs (``elements=True``): a fully fine-tuned ZeRO-3 trainer edits a few
    elements of each rank's partition before each sync, and the servers rebuild every tensor from the copy they
    keep. A rank raising, dying, and stopped past its lease, each interrupting an element sync (the last two before
    the servers are paused, their payload received), and a server stopped past its lease (within the sink's timeout)
    while it receives the payload, generating; after each, a plain
    round (full: it follows a failure) and one more (elements), so that every sync after a committed one goes as
    elements (the soak checks it) and the servers serve the trainer's own weights after every commit."""
    for s in servers:
        if not s.healthy():  # the other soak left it down
            s.restart()
    kinds = ("raise", "die", "stop-rank", "stall-server")
    # A plain round, then each fault with two plain rounds after it: a raise after the element blobs were sent
    # (group:1); then, at "staged" (every server holds the payload, none is paused yet, each one's update session is
    # open), the feeding rank of a server dying (its lease ends the session by itself, generation never paused) and
    # a rank stopped past the lease (both raise, the servers heal); then a server stopped while its workers receive
    # (the trainer waits for them in its store: the sync commits once it runs again, or fails and heals).
    faults = [("raise", 1, "group:1"), ("die", 0, "staged"), ("stop-rank", 1, "staged"), ("stall-server", 0, "group:1")]
    plan = [{"fault": "none", "rank": 0, "point": "commit", "server": 0}]
    for kind, rank, point in faults:
        plan.append({"fault": kind, "rank": rank, "point": point, "server": rank})
        plan += [{"fault": "none", "rank": rank, "point": point, "server": rank}] * 2
    plan = [dict(r, k=k) for k, r in enumerate(plan)]
    report = Soak(servers, checkpoint, tmp_path, seed=SEED + 7, elements=True).run(plan=plan)
    text = json.dumps(report.as_json(), indent=1)
    assert not report.problems, text
    assert {r["fault"] for r in report.rounds} >= set(kinds) and report.rounds[-1]["committed"], text
    assert report.answers > 0 and report.uncommitted_answers == 0, text
    # The second plain round after each fault, at least, commits as elements (and the last round is one of them).
    assert sum(r["elements"] for r in report.rounds) >= len(kinds) and report.rounds[-1]["elements"], text


def test_a_trainer_rank_dying_or_slower_than_the_wait_at_every_point_leaves_every_server_healed_and_in_sync(
    checkpoint: str, servers: list[Server], tmp_path: Path
) -> None:
    """Every transaction point, in turn (no client, shorter timeouts: this test is about the servers' state, which
    is checked after every round): one rank raises there (the other rank's server, which may hold every chunk
    by then, is rolled back too), the feeding rank of one server dies there (its server heals itself within its
    lease, and a restarted trainer's first sync commits), then a rank sleeps there past the agreement's wait (both
    raise within the deadline)."""
    plan = []
    for i, point in enumerate(POINTS):
        rank = i % 2
        plan.append({"fault": "raise", "rank": 1 - rank, "point": point, "server": rank})
        plan.append({"fault": "die", "rank": rank, "point": point, "server": rank})
        plan.append({"fault": "none", "rank": rank, "point": point, "server": rank})
        plan.append({"fault": "slow", "rank": 1 - rank, "point": point, "server": rank})
    plan.append({"fault": "none", "rank": 0, "point": "commit", "server": 0})
    for k, fault in enumerate(plan):
        fault["k"] = k
    for s in servers:
        if not s.healthy():  # the other soak left it down
            s.restart()
    soak = Soak(servers, checkpoint, tmp_path, seed=SEED + 1, timeouts=SHORT)
    report = soak.run(plan=[plan[-1] | {"k": -1}, *plan], client=False)
    text = json.dumps(report.as_json(), indent=1)
    assert not report.problems, text
    assert report.launches == len(POINTS) + 1, text  # one trainer launch after each death
