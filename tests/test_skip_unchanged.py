"""A sync moves only what changed: 2 sharded ranks (ZeRO-3, FSDP2) into a real vLLM server, and a colocated engine.

After the first sync, each sync gathers, merges and sends only the outputs whose sources changed (the LoRA-merged
weights, and what shares a vLLM module with them), counted per rank; the server then serves exactly (``==``) what a
full sync of the same weights serves. A frozen weight edited in place on one rank's shard is sent; a failed sync,
another writer, and a server restarted at the same address each force a full sync, which the record names.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from helpers import require, results_of, save_for_vllm, vllm_llama
from launch import assert_all_ok, describe, launch
from vllm_server import Server


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    require("vllm")
    require("deepspeed")
    return save_for_vllm(vllm_llama(tie=False), str(tmp_path_factory.mktemp("served") / "model"), tokenizer=True)


@pytest.fixture(scope="module")
def server(checkpoint: str):  # type: ignore[no-untyped-def]
    s = Server(checkpoint).wait_ready()
    yield s
    s.stop()


def _events(results) -> dict[str, list[dict]]:  # type: ignore[no-untyped-def]
    out: dict[str, list[dict]] = {}
    for r in results:
        for rec in results_of(r.output):
            out.setdefault(rec.get("event", ""), []).append(rec)
    return out


# Outputs of the served tiny Llama (2 layers, untied): embed, final norm, lm_head, and per layer 2 norms + 7 linears.
TOTAL = 3 + 2 * 9
#: Per layer, what a step changes (and what must travel with it into vLLM's fused modules).
SENT = {"all": 2 * 7, "attn": 2 * 4, "qv": 2 * 3}


@pytest.mark.parametrize("gatherer,targets", [("zero3", "all"), ("zero3", "attn"), ("fsdp2", "all"), ("fsdp2", "qv")])
def test_after_the_first_sync_only_what_changed_is_gathered_and_sent_and_served_exactly(
    server: Server, checkpoint: str, tmp_path: Path, gatherer: str, targets: str
) -> None:
    restart = gatherer == "zero3" and targets == "all"
    stop = threading.Event()

    def restarter() -> None:
        while not stop.is_set() and not (tmp_path / "restart").exists():
            time.sleep(0.1)
        if not stop.is_set():
            server.restart()
            (tmp_path / "restarted").write_text("1")

    thread = threading.Thread(target=restarter, daemon=True)
    thread.start()
    try:
        args = [gatherer, targets, server.url, checkpoint, str(tmp_path)] + (["restart"] if restart else [])
        results = launch("skip_sync", *args, timeout=600)
    finally:
        stop.set()
        thread.join(timeout=5)
    assert_all_ok(results)
    events = _events(results)
    syncs = {(e["rank"], e["label"]): e for e in events["sync"]}
    for rank in (0, 1):
        first, partial, again = syncs[rank, "v1"], syncs[rank, "v2"], syncs[rank, "v3"]
        # The first sync into a fresh server sends everything, and says why.
        assert first["tensors"] == TOTAL and first["skipped"] == 0 and "no sync committed" in first["full_because"]
        # Then only what the step changed, gathered and sent, on each rank.
        assert partial["full_because"] is None, partial
        assert partial["tensors"] == SENT[targets] and partial["skipped"] == TOTAL - SENT[targets], partial
        assert partial["gathered"] < first["gathered"] and partial["sent_bytes"] < first["sent_bytes"], partial
        # Another sink wrote the server (the full one): everything again, and the record names why (on rank 0, which
        # feeds the server; rank 1 learns that another rank needs everything).
        assert again["skipped"] == 0, again
        assert ("another update" if rank == 0 else "another trainer rank") in again["full_because"], again
        # The frozen weight edited on rank 1's shard only travels too, on both ranks' decision.
        edited = syncs[rank, "v4"]
        assert edited["full_because"] is None and edited["tensors"] == SENT[targets] + 1, edited
        # A failed (rolled-back) sync: the next one sends everything.
        assert syncs[rank, "v6"]["skipped"] == 0 and "failed" in syncs[rank, "v6"]["full_because"]
        assert syncs[rank, "v7"]["full_because"] is None
        if restart:
            v8 = syncs[rank, "v8"]
            assert v8["skipped"] == 0 and ("restarted" if rank == 0 else "another trainer rank") in v8["full_because"]
    equal = {e["label"]: e["equal"] for e in events["equal"]}
    assert equal.get("v2") is True and equal.get("v4") is True, describe(results)
    if restart:
        assert equal.get("v8") is True
    fault = events["fault"][0]
    assert fault["equal"] is True and fault["seconds"] < 60, fault
