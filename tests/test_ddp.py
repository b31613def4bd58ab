"""DDP: 2 real processes over gloo, started by the test."""

from helpers import event
from launch import assert_all_ok, launch


def test_ddp_every_rank_streams_the_oracle() -> None:
    results = launch("ddp_stream", world=2, timeout=180)
    assert_all_ok(results)
    assert all(event(r.output, "match")["tensors"] > 0 for r in results)
