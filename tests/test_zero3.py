"""DeepSpeed ZeRO-3: 2 real ranks over gloo, started by the tests (see workers/zero3_stream.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import count_events, event, require, results_of, tiny_llama
from launch import assert_all_ok, describe, launch


@pytest.fixture(autouse=True)
def _deepspeed() -> None:
    require("deepspeed")


def test_engine_lora_and_plain_models_stream_the_oracle_within_the_bound() -> None:
    results = launch("zero3_stream", "engine")
    assert_all_ok(results)
    for r in results:
        assert count_events(r.output, "match") == 2, describe(results)


def test_model_built_under_zero_init_by_from_pretrained(tmp_path: Path) -> None:
    tiny_llama(layers=3).save_pretrained(tmp_path / "model")
    results = launch("zero3_stream", "zinit", str(tmp_path / "model"))
    assert_all_ok(results)
    assert all(event(r.output, "match") for r in results), describe(results)


def test_moe_with_lora_on_experts_streams_the_merged_checkpoint_within_the_bound(tmp_path: Path) -> None:
    results = launch("zero3_stream", "moe", str(tmp_path))
    assert_all_ok(results)
    for r in results:
        rec = event(r.output, "moe-match")
        assert rec["experts"] == 2 * 4 * 3 and rec["peak"] <= rec["bound"], rec


def test_float32_factors_over_bf16_base_saved_lm_head_and_tied_embeddings() -> None:
    results = launch("zero3_stream", "mixed")
    assert_all_ok(results)
    assert all(event(r.output, "mixed-match") for r in results), describe(results)


def test_hundred_bf16_streams_leave_every_partition_bitwise_identical() -> None:
    results = launch("zero3_stream", "drift")
    assert_all_ok(results)
    assert all(event(r.output, "bitwise-identical") for r in results), describe(results)


def _abort_seconds(output: str) -> float:
    return float(event(output, "aborted")["seconds"])


def test_a_consumer_raising_on_rank_1_aborts_rank_0_within_seconds() -> None:
    results = launch("zero3_stream", "raise", timeout=120)
    r0, r1 = results
    assert r1.returncode == 0 and event(r1.output, "consumer-raised"), describe(results)
    assert r0.returncode == 3, describe(results)
    aborted = event(r0.output, "aborted")
    assert aborted["failed_ranks"] == [1] and "rank 1 stopped iterating early" in aborted["message"]
    assert _abort_seconds(r0.output) < 10


def test_rank_1_dying_aborts_rank_0_within_seconds() -> None:
    results = launch("zero3_stream", "die", timeout=120)
    r0, r1 = results
    assert r1.returncode == 17, describe(results)
    assert r0.returncode == 3, describe(results)
    assert _abort_seconds(r0.output) < 10


def test_a_consumer_raising_inside_with_aborts_peers_even_if_its_pass_is_kept_alive() -> None:
    """The stop is sent when the exception leaves the ``with`` block, not when the pass is garbage-collected."""
    results = launch("zero3_stream", "raise-kept", timeout=120)
    r0, r1 = results
    assert event(r1.output, "consumer-raised"), describe(results)
    aborted = event(r0.output, "aborted")
    assert r0.returncode == 3 and aborted["failed_ranks"] == [1], describe(results)
    assert "ValueError: consumer on rank 1 failed" in aborted["message"], aborted  # the reason travelled
    assert _abort_seconds(r0.output) < 10


def test_direct_gather_equals_gathered_parameters_bit_for_bit_and_falls_back_where_it_must() -> None:
    results = launch("zero3_stream", "direct", timeout=300)
    assert_all_ok(results)
    for r in results:
        models = [e["model"] for e in results_of(r.output) if e.get("event") == "direct-equal"]
        assert models == ["lora-mts-tied", "plain", "bf16-base-f32-factors", "qwen3-moe"], describe(results)


def test_prefetch_streams_the_oracle_with_two_groups_held_and_break_releases_both() -> None:
    results = launch("zero3_stream", "prefetch")
    assert_all_ok(results)
    for r in results:
        e = event(r.output, "prefetch-match")
        assert e["largest"] < e["peak"] <= e["bound"], e


def test_with_a_gather_in_flight_a_consumer_raising_on_rank_1_aborts_rank_0_within_one_group() -> None:
    results = launch("zero3_stream", "prefetch-raise", timeout=120)
    r0, r1 = results
    assert r1.returncode == 0 and event(r1.output, "consumer-raised"), describe(results)
    assert r0.returncode == 3, describe(results)
    aborted = event(r0.output, "aborted")
    assert aborted["failed_ranks"] == [1] and "before group 3 of" in aborted["message"], aborted
    assert _abort_seconds(r0.output) < 10


@pytest.mark.parametrize("gatherer", ["zero3", "fsdp2"])
def test_verifications_probe_leaves_the_sharded_trainer_as_it_found_it(gatherer: str) -> None:
    """verify='s probe runs the trainer's forward between its steps. Under ZeRO-3 it once became DeepSpeed's trace
    of the next step (TRL's backward then met a released weight); under FSDP2 it left the root's parameters
    unsharded. On 2 ranks, before each of 3 steps: every module's training flag (one layer held in eval mode by the
    trainer), DeepSpeed's coordinator and each parameter's status, or FSDP2's shards, are the same after the probe as
    before it, and the steps train what they train without the probes."""
    if gatherer == "zero3":
        require("deepspeed")
    probed = launch("probe_as_found", gatherer, world=2, timeout=240)
    plain = launch("probe_as_found", gatherer, world=2, timeout=240, env={"LORA_STREAM_TEST_PROBE": "0"})
    assert_all_ok(probed + plain)
    for a, b in zip(probed, plain):
        (with_probe,), (without,) = results_of(a.output), results_of(b.output)
        assert with_probe["same"] == [True, True, True], describe(probed)
        assert with_probe["layer1_eval"] and without["layer1_eval"], with_probe
        assert with_probe["trained"] == without["trained"], (with_probe, without)
