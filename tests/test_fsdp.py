"""FSDP2 (fully_shard): 2 real ranks over gloo, started by the tests (see workers/fsdp_stream.py)."""

from __future__ import annotations

import re

from launch import assert_all_ok, describe, launch


def test_fsdp2_lora_and_plain_models_stream_the_oracle_within_the_bound() -> None:
    results = launch("fsdp_stream", "fsdp2")
    assert_all_ok(results)
    assert all(r.output.count("tensors match") == 2 for r in results), describe(results)


def test_fsdp2_hundred_bf16_streams_leave_local_shards_bitwise_identical() -> None:
    results = launch("fsdp_stream", "fsdp2-drift")
    assert_all_ok(results)
    assert all("bitwise identical" in r.output for r in results), describe(results)


def test_fsdp2_a_consumer_raising_on_rank_1_aborts_rank_0_within_seconds() -> None:
    results = launch("fsdp_stream", "fsdp2-raise", timeout=120)
    r0, r1 = results
    assert r1.returncode == 0 and "CONSUMER-RAISED" in r1.output, describe(results)
    assert r0.returncode == 3 and "failed_ranks=(1,)" in r0.output, describe(results)
    m = re.search(r"ABORTED after ([0-9.]+)s", r0.output)
    assert m and float(m.group(1)) < 10


def test_fsdp1_use_orig_params_on_and_off_lora_and_plain_stream_the_oracle_within_the_bound() -> None:
    results = launch("fsdp_stream", "fsdp1")
    assert_all_ok(results)
    assert all(r.output.count("tensors match") == 4 for r in results), describe(results)


def test_fsdp1_hundred_bf16_streams_leave_local_shards_bitwise_identical() -> None:
    results = launch("fsdp_stream", "fsdp1-drift")
    assert_all_ok(results)
    assert all("bitwise identical" in r.output for r in results), describe(results)


def test_fsdp1_a_consumer_raising_on_rank_1_aborts_rank_0_within_seconds() -> None:
    results = launch("fsdp_stream", "fsdp1-raise", timeout=120)
    r0, r1 = results
    assert r1.returncode == 0 and "CONSUMER-RAISED" in r1.output, describe(results)
    assert r0.returncode == 3 and "failed_ranks=(1,)" in r0.output, describe(results)


def test_fsdp1_before_the_first_forward_is_a_clear_error() -> None:
    results = launch("fsdp_stream", "fsdp1-noforward")
    assert_all_ok(results)
    assert all("CLEAR-ERROR" in r.output and "forward" in r.output for r in results), describe(results)
