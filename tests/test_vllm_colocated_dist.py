"""ZeRO-3 trainer + vLLM external_launcher engine (TP=2) in each of 2 ranks; and an engine in a child process."""

from __future__ import annotations

import pytest
from helpers import clear_cpu_shm, event, require, results_of, run_child_engine_script, save_for_vllm, vllm_llama
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


@pytest.mark.parametrize("trainer", ["zero3", "ddp"])
def test_a_failure_on_rank_1_at_any_point_raises_everywhere_and_leaves_every_engine_bit_identical(
    checkpoints: dict[str, str], trainer: str
) -> None:
    """ZeRO-3 (or replicated, DDP-style) ranks + one tensor-parallel engine across both, verified syncs: a failure on
    rank 1 alone at each transaction point (pre-flight, mid-stream, reload check, verification, prefix-cache reset,
    commit)."""
    from lora_stream.testing import FAULT_POINTS

    scenario = "faults" if trainer == "zero3" else "faults-ddp"
    results = launch("vllm_colocated_dist", scenario, checkpoints["untied"], timeout=420)
    assert_all_ok(results)
    r0 = results[0]
    points = [e["point"] for e in results_of(r0.output) if e.get("event") == "fault"]
    assert len(points) == len(FAULT_POINTS), describe(results)
    for rank, r in enumerate(results):
        for e in (e for e in results_of(r.output) if e.get("event") == "fault"):
            where = f"rank {rank} at {e['point']}"
            if rank == 1:
                assert e["error"] == "RuntimeError" and "injected" in e["message"], where
            else:
                assert e["error"] == "StreamAbortedError" and e["failed_ranks"] == [1], where
                assert "injected failure" in e["message"], where  # rank 1's reason reaches rank 0
            assert e["equal"] is True, f"{where}: the engine's outputs changed after a failed sync"
            assert e["version"] == "v1", where
            assert e["seconds"] < 60, f"{where}: took {e['seconds']:.0f} s (a wait for a timeout?)"
        assert event(r.output, "recovered")["version"] == "v2"


@pytest.mark.parametrize("trainer", ["zero3", "ddp"])
def test_a_verified_sync_failing_on_rank_1_before_or_in_the_pass_raises_everywhere_within_seconds(
    checkpoints: dict[str, str], trainer: str
) -> None:
    """verify=True, a failure on rank 1 alone in the pre-flight, taking the engine's snapshot (rank 1 never starts
    its pass; under ZeRO-3 rank 0 learns of it inside its own), or in the pass: every rank raises within seconds, far
    under the stream's 60 s timeout, having run as many status exchanges as the other; the engine serves v1 exactly."""
    results = launch("vllm_colocated_dist", "early" if trainer == "zero3" else "early-ddp", checkpoints["untied"])
    assert_all_ok(results)
    r0, r1 = ([e for e in results_of(r.output) if e.get("event") == "fault"] for r in results)
    assert [e["point"] for e in r0] == [e["point"] for e in r1] == ["prepare", "snapshot", "group:0", "group:1"]
    for a, b in zip(r0, r1):
        where = f"{trainer}, a failure at {a['point']} on rank 1"
        assert b["error"] == "RuntimeError" and "injected" in b["message"], where
        assert a["error"] == "StreamAbortedError" and a["failed_ranks"] == [1], where
        assert "injected failure" in a["message"], where
        assert a["exchanges"] == b["exchanges"], f"{where}: the ranks ran {a['exchanges']} and {b['exchanges']}"
        for e in (a, b):
            assert e["equal"] is True and e["version"] == "v1", f"{where}: the engine changed after a failed sync"
            assert e["seconds"] < 30, f"{where}: took {e['seconds']:.0f} s (a wait for the 60 s timeout)"
    assert all(event(r.output, "recovered")["version"] == "v2" for r in results), describe(results)


@pytest.fixture(scope="module")
def child_engine(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One engine in a child process for the module: a merged sync, a rolled-back one, a partial one, then the
    engine-side merge's syncs into the same engine (tied checkpoint: lm_head travels, or is computed, as the
    embedding's alias). Its output."""
    path = save_for_vllm(vllm_llama(tie=True), str(tmp_path_factory.mktemp("child") / "m"))
    return run_child_engine_script("vllm_child_engine.py", path, timeout=420)


def test_engine_in_a_child_process_through_the_worker_extension(child_engine: str) -> None:
    stdout = child_engine
    assert event(stdout, "child-engine-match")["tensors"] > 0
    assert event(stdout, "child-engine-rollback") == {"event": "child-engine-rollback", "equal": True, "version": "v1"}
    partial = event(stdout, "child-engine-partial")
    assert "failed" in partial["full_because"], partial
    assert partial["skipped"] > 0 and partial["partial_full_because"] is None and partial["verified"], partial
    assert "worker_extension_cls" in event(stdout, "no-extension-error")["message"]


def test_element_syncs_into_an_engine_in_a_child_process(child_engine: str) -> None:
    e = event(child_engine, "child-elements")
    assert e["full_because"] is None and e["elements"]["tensors"] > 0 and e["verified"], e
    assert e["raised"] and e["rolled_back"], e
    assert e["again"]["tensors"] > 0 and e["same"], e


def test_the_engine_side_merge_into_an_engine_in_a_child_process(child_engine: str) -> None:
    stdout = child_engine
    equal = event(stdout, "child-merge-equal")
    assert equal["equal"] is True and equal["first_full_because"] and equal["partial_full_because"] is None, equal
    assert equal["partial_bytes"] <= 1.1 * equal["adapter_bytes"], equal
    rollback = event(stdout, "child-merge-rollback")
    assert rollback == {"event": "child-merge-rollback", "raised": True, "equal": True, "version": "v3"}, rollback
    assert event(stdout, "child-merge-after")["full_because"] is not None  # after a failure: the base again
