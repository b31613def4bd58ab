"""ZeRO-3 trainer + vLLM external_launcher engine (TP=2) in each of 2 ranks; and an engine in a child process."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import clear_cpu_shm, event, require, run_child_engine_script, save_for_vllm, vllm_llama
from launch import assert_all_ok, describe, launch


@pytest.fixture(autouse=True)
def _stack() -> None:
    require("vllm")
    require("deepspeed")
    clear_cpu_shm()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("ckpt")
    return {
        "untied": save_for_vllm(vllm_llama(tie=False), str(root / "untied")),
        "tied": save_for_vllm(vllm_llama(tie=True), str(root / "tied")),
    }


@pytest.mark.parametrize(("scenario", "ckpt"), [("lora", "untied"), ("tied", "tied"), ("mts", "untied")])
def test_zero3_trainer_syncs_into_tp2_engines(scenario: str, ckpt: str, checkpoints: dict[str, str]) -> None:
    results = launch("vllm_colocated_dist", scenario, checkpoints[ckpt], timeout=300)
    assert_all_ok(results)
    assert all(event(r.output, "serves-merged") for r in results), describe(results)


def test_a_consumer_failure_mid_sync_raises_on_every_rank(checkpoints: dict[str, str]) -> None:
    results = launch("vllm_colocated_dist", "fail", checkpoints["untied"], timeout=300)
    assert_all_ok(results)
    r0, r1 = results
    raised0, raised1 = event(r0.output, "raised"), event(r1.output, "raised")
    assert raised1["error"] == "RuntimeError" and "injected" in raised1["message"], describe(results)
    assert raised0["error"] == "StreamAbortedError" and "rank 1" in raised0["message"], describe(results)
    assert all(event(r.output, "engine-alive") for r in results)


def test_engine_in_a_child_process_through_the_worker_extension(tmp_path: Path) -> None:
    path = save_for_vllm(vllm_llama(tie=False), str(tmp_path / "m"))
    stdout = run_child_engine_script("vllm_child_engine.py", path)
    assert event(stdout, "child-engine-match")["tensors"] > 0
    assert "worker_extension_cls" in event(stdout, "no-extension-error")["message"]
