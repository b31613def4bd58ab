"""An exchange one rank gave up on is never completed as a success, on 2 real gloo processes (no engine)."""

from __future__ import annotations

import pytest
from helpers import find_event, require, results_of
from launch import assert_all_ok, describe, launch


def test_an_exchange_a_rank_gave_up_on_raises_on_the_late_rank_too_and_the_next_one_pairs() -> None:
    results = launch("lockstep_faults", "late", timeout=120)
    assert_all_ok(results)
    r0, r1 = (find_event(results_of(r.output), "second", describe(results)) for r in results)
    assert r0["outcome"] == "raised" and "timed out" in r0["message"] and r0["lost"], describe(results)
    assert r0["seconds"] < 3.0 + 2.0, describe(results)
    # Before the fix the late rank read rank 0's posted OK and went on alone.
    assert r1["outcome"] == "raised" and "given up by rank 0" in r1["message"] and r1["failed"] == [0], describe(
        results
    )
    assert r1["seconds"] < 2.0, describe(results)  # it raises at once when it arrives
    for r in results:
        assert find_event(results_of(r.output), "third", describe(results))["statuses"] == [0, 0]


@pytest.mark.parametrize("kind", ["fsdp2", "zero3"])
def test_a_rank_slower_than_the_timeout_raises_at_its_next_exchange_and_the_next_pass_is_whole(kind: str) -> None:
    if kind == "zero3":
        require("deepspeed")
    results = launch("lockstep_faults", f"slow-{kind}", timeout=180)
    assert_all_ok(results)
    r0, r1 = (find_event(results_of(r.output), "slow", describe(results)) for r in results)
    assert r0["outcome"] == "raised" and r0["seconds"] < 3.0 + 3.0, describe(results)
    assert r1["outcome"] == "raised" and "given up by rank 0" in r1["message"], describe(results)
    again = [find_event(results_of(r.output), "again", describe(results)) for r in results]
    assert again[0]["tensors"] == again[1]["tensors"] > 0, describe(results)


def test_the_fleet_agreement_carries_every_server_whatever_the_length_of_their_addresses() -> None:
    results = launch("lockstep_faults", "fleet", timeout=120)
    assert_all_ok(results)
    f0, f1 = (find_event(results_of(r.output), "fleet", describe(results)) for r in results)
    assert f0["excluded"] == f1["excluded"] and len(f0["excluded"]) == 16, describe(results)
    assert f0["ok"] and f1["ok"], describe(results)


def test_a_stopped_store_host_cannot_hold_a_peer_past_its_deadline() -> None:
    """Rank 0 hosts the group's store and is stopped (SIGSTOP), not dead: rank 1 raises within its timeout plus
    the settlement's bound (before, it waited on the stopped store until rank 0 ran again: the store's own timeout
    is 30 minutes); rank 0, continued, raises too, naming rank 1; the next exchange pairs."""
    from lora_stream.lockstep import SETTLE_BOUND_S

    results = launch("lockstep_faults", "stopped-host", timeout=120)
    assert_all_ok(results)
    r0, r1 = (find_event(results_of(r.output), "second", describe(results)) for r in results)
    assert r1["outcome"] == "raised" and r1["seconds"] < 3.0 + SETTLE_BOUND_S + 3.0, describe(results)
    assert r0["outcome"] == "raised" and "given up by rank 1" in r0["message"], describe(results)
    for r in results:
        assert find_event(results_of(r.output), "third", describe(results))["statuses"] == [0, 0]
