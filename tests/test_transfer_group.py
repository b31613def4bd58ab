"""The gloo weight-transfer group: both engines' shutdown tears it down, so a peer blocked in a broadcast fails at
once (shutdown used to call a method the group does not have, and the error was swallowed)."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from helpers import require
from launch import free_port


def _pair(timeout_s: float) -> dict[int, object]:
    from lora_stream.transfer.gloo_engine import TransferGroup

    port, groups = free_port(), {}

    def join(rank: int) -> None:
        groups[rank] = TransferGroup("127.0.0.1", port, rank, 2, timeout_s)

    threads = [threading.Thread(target=join, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return groups


@pytest.mark.parametrize("side", ["trainer", "worker"])
def test_shutdown_tears_the_group_down_and_a_waiting_peer_fails_at_once(side: str) -> None:
    require("vllm")
    from lora_stream.transfer.gloo_engine import GlooWeightTransferEngine
    from lora_stream.transfer.gloo_trainer import GlooTrainerWeightTransferEngine

    groups = _pair(timeout_s=30.0)
    mine, peer = (groups[0], groups[1]) if side == "trainer" else (groups[1], groups[0])
    cls = GlooTrainerWeightTransferEngine if side == "trainer" else GlooWeightTransferEngine
    engine = cls.__new__(cls)  # only shutdown() is exercised: no server or model is needed for it
    engine.group = mine
    pending = peer.pg.broadcast([torch.zeros(4)], _root_from(0 if side == "trainer" else 1))  # waits for `mine`
    start = time.monotonic()
    threading.Timer(0.5, engine.shutdown).start()
    with pytest.raises(RuntimeError):
        pending.wait()
    assert time.monotonic() - start < 10, "the peer waited for its timeout: the group was not torn down"
    assert engine.group is None and mine.closed
    mine.close()  # idempotent


def _root_from(rank: int):  # type: ignore[no-untyped-def]
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = rank
    opts.rootTensor = 0
    return opts
