"""The checkpoint sink from 2-rank sharded trainers (ZeRO-3, FSDP2): values, the memory bound, and failures."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import require, results_of
from launch import assert_all_ok, describe, launch


@pytest.mark.distributed
@pytest.mark.parametrize("how", ["zero3", "fsdp2"])
def test_a_sharded_trainer_saves_the_merged_model_within_the_bound(how: str, tmp_path: Path) -> None:
    if how == "zero3":
        require("deepspeed")
    results = launch("checkpoint_save", how, str(tmp_path), timeout=300)
    assert_all_ok(results)
    for r in results:
        (rec,) = results_of(r.output)
        assert rec["outcome"] == "ok", rec
        for case in ("tied", "saved"):
            assert rec[case]["peak_gathered"] <= rec[case]["bound"], rec
            if r.rank == 0:
                assert rec[case]["shards"] > 3, rec


@pytest.mark.distributed
def test_a_failure_on_the_writing_rank_raises_on_every_rank_and_leaves_nothing(tmp_path: Path) -> None:
    require("deepspeed")
    results = launch("checkpoint_save", "zero3-fail", str(tmp_path), timeout=300)
    assert_all_ok(results)
    r0, r1 = (results_of(r.output)[-1] for r in results)
    assert r0["error"] == "OSError" and "injected" in r0["message"], describe(results)
    assert r1["error"] == "StreamAbortedError" and "No space left on device" in r1["message"], describe(results)
    assert r1["seconds"] < 30
    assert list(tmp_path.iterdir()) == [], "a partial checkpoint or a temporary directory was left behind"
