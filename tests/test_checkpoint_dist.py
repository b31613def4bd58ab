"""The checkpoint sink from 2-rank sharded trainers (ZeRO-3, FSDP2): values, the memory bound, and failures."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import event, require, results_of
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


@pytest.mark.distributed
@pytest.mark.parametrize("how", ["ddp", "fsdp2"])
def test_nothing_is_published_unless_every_rank_succeeded_and_a_publish_failure_raises_everywhere(
    how: str, tmp_path: Path
) -> None:
    """Over an old checkpoint: a failure on rank 1 alone (in its pass; just before the vote) and a failure of rank
    0's publish (before any rename; between the fallback's renames) raise on both ranks within seconds, with as many
    exchanges on each; the old checkpoint stays byte for byte and nothing is left beside it. Under DDP rank 1's pass
    does not talk to rank 0's, so only the vote before publishing stops rank 0."""
    results = launch("checkpoint_save", f"faults-{how}", str(tmp_path), timeout=300)
    assert_all_ok(results)
    r0, r1 = ([e for e in results_of(r.output) if e.get("event") == "fault"] for r in results)
    assert [e["point"] for e in r0] == [e["point"] for e in r1] == ["group:1", "commit", "synced", "renamed"]
    for a, b in zip(r0, r1):
        where = f"{how}, a failure at {a['point']} on rank {a['failing']}"
        mine, other = (a, b) if a["failing"] == 0 else (b, a)
        assert mine["error"] == "RuntimeError" and "injected" in mine["message"], where
        assert other["error"] == "StreamAbortedError" and other["failed_ranks"] == [a["failing"]], where
        assert "injected" in other["message"], f"{where}: the failing rank's reason did not reach the other"
        assert a["intact"] is True, f"{where}: the old checkpoint under the target name changed"
        assert a["beside"] == [], f"{where}: left beside the target: {a['beside']}"
        assert a["exchanges"] == b["exchanges"], f"{where}: the ranks ran {a['exchanges']} and {b['exchanges']}"
        assert max(a["seconds"], b["seconds"]) < 30, f"{where}: a wait for the 60 s timeout?"
    assert all(event(r.output, "saved") for r in results), describe(results)
