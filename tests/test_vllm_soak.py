"""The transaction under a soak with random faults, into a fleet of two real vLLM servers (tests/soak.py).

A bounded number of rounds in CI, every fault kind at least once; ``benchmarks/soak.py`` runs as many as you like,
with other seeds."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from helpers import require, save_for_vllm, vllm_llama
from soak import FAULTS, Soak
from vllm_server import Server

#: Rounds in CI: each fault kind once, then random ones, the last one plain. ``LORA_STREAM_SOAK_ROUNDS`` overrides.
ROUNDS = int(os.environ.get("LORA_STREAM_SOAK_ROUNDS", "8"))
SEED = int(os.environ.get("LORA_STREAM_SOAK_SEED", "31"))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    require("vllm")
    require("deepspeed")
    return save_for_vllm(vllm_llama(tie=False), str(tmp_path_factory.mktemp("soak") / "model"), tokenizer=True)


def test_every_round_of_a_soak_with_random_faults_ends_with_every_server_on_its_last_committed_version(
    checkpoint: str, tmp_path: Path
) -> None:
    servers = [Server(checkpoint), Server(checkpoint)]
    try:
        for s in servers:
            s.wait_ready()
        report = Soak(servers, checkpoint, tmp_path, seed=SEED).run(ROUNDS)
    finally:
        for s in servers:
            s.stop()
    text = json.dumps(report.as_json(), indent=1)
    assert not report.problems, text
    assert {r["fault"] for r in report.rounds} >= set(FAULTS), text
    assert len(report.rounds) == ROUNDS and report.rounds[-1]["committed"], text
    assert report.answers > 0 and report.uncommitted_answers == 0, text
