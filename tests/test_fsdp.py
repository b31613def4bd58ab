"""FSDP2 (fully_shard): 2 real ranks over gloo, started by the tests (see workers/fsdp_stream.py)."""

from __future__ import annotations

from helpers import count_events, event, results_of
from launch import assert_all_ok, describe, launch


def test_fsdp2_lora_and_plain_models_stream_the_oracle_within_the_bound() -> None:
    results = launch("fsdp_stream", "fsdp2")
    assert_all_ok(results)
    assert all(count_events(r.output, "match") == 2 for r in results), describe(results)


def test_fsdp2_hundred_bf16_streams_leave_local_shards_bitwise_identical() -> None:
    results = launch("fsdp_stream", "fsdp2-drift")
    assert_all_ok(results)
    assert all(event(r.output, "bitwise-identical") for r in results), describe(results)


def test_fsdp2_a_consumer_raising_on_rank_1_aborts_rank_0_within_seconds() -> None:
    results = launch("fsdp_stream", "fsdp2-raise", timeout=120)
    r0, r1 = results
    assert r1.returncode == 0 and event(r1.output, "consumer-raised"), describe(results)
    aborted = event(r0.output, "aborted")
    assert r0.returncode == 3 and aborted["failed_ranks"] == [1], describe(results)
    assert aborted["seconds"] < 10


def test_fsdp1_use_orig_params_on_and_off_lora_and_plain_stream_the_oracle_within_the_bound() -> None:
    results = launch("fsdp_stream", "fsdp1")
    assert_all_ok(results)
    assert all(count_events(r.output, "match") == 4 for r in results), describe(results)


def test_fsdp1_hundred_bf16_streams_leave_local_shards_bitwise_identical() -> None:
    results = launch("fsdp_stream", "fsdp1-drift")
    assert_all_ok(results)
    assert all(event(r.output, "bitwise-identical") for r in results), describe(results)


def test_fsdp1_a_consumer_raising_on_rank_1_aborts_rank_0_within_seconds() -> None:
    results = launch("fsdp_stream", "fsdp1-raise", timeout=120)
    r0, r1 = results
    assert r1.returncode == 0 and event(r1.output, "consumer-raised"), describe(results)
    assert r0.returncode == 3 and event(r0.output, "aborted")["failed_ranks"] == [1], describe(results)


def test_fsdp1_before_the_first_forward_is_a_clear_error() -> None:
    results = launch("fsdp_stream", "fsdp1-noforward")
    assert_all_ok(results)
    assert all("forward" in event(r.output, "clear-error")["message"] for r in results), describe(results)


def test_fsdp2_direct_gather_equals_full_tensor_bit_for_bit() -> None:
    results = launch("fsdp_stream", "fsdp2-direct")
    assert_all_ok(results)
    for r in results:
        models = [e["model"] for e in results_of(r.output) if e.get("event") == "direct-equal"]
        assert models == ["lora-r3-mts", "plain", "bf16"], describe(results)
