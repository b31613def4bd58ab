"""The safetensors checkpoint sink in one process: layout, values, config, atomicity (the 2-rank cases are in
test_checkpoint_dist.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import VLLM_ENV, assert_matches, assert_vllm_serves, lora, oracle, tiny_llama, vllm_generate
from launch import TESTS

from lora_stream import CheckpointError, ParamStream, SafetensorsSink, save_merged


def _load(path: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return {n: p.detach() for n, p in AutoModelForCausalLM.from_pretrained(path).named_parameters()}


@pytest.mark.parametrize(
    ("tie", "saved"), [(False, None), (True, None), (True, ["lm_head"])], ids=["untied", "tied", "tied+saved-lm_head"]
)
def test_saved_checkpoint_loads_as_the_merged_model(tmp_path: Path, tie: bool, saved: list[str] | None) -> None:
    from safetensors import safe_open

    pm = lora(tiny_llama(tie=tie), target_modules="all-linear", modules_to_save=saved, use_dora=tie)
    out = tmp_path / "merged"
    record = save_merged(pm, out, max_shard_size=20_000)
    ref = oracle(pm)
    loaded = _load(out)
    assert_matches(((n, loaded[n]) for n in ref), ref)
    assert set(loaded) == set(ref)
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is (tie and not saved)
    assert config["dtype"] == "float32"
    # Several shards, an index mapping every name to its file, the right total, every shard readable.
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) > 3 and set(index["weight_map"].values()) == set(shards)
    names, total = set(), 0
    for shard in shards:
        with safe_open(str(out / shard), framework="pt") as f:
            assert f.metadata()["format"] == "pt" and json.loads(f.metadata()["merged_adapters"]) == ["default"]
            for name in f.keys():
                assert index["weight_map"][name] == shard
                t = f.get_tensor(name)
                names.add(name)
                total += t.numel() * t.element_size()
    assert names == set(ref) == set(index["weight_map"])
    assert index["metadata"]["total_size"] == total == record.bytes
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "temporary directories left behind"


def test_one_shard_is_model_safetensors_and_bf16_is_recorded(tmp_path: Path) -> None:
    pm = lora(tiny_llama(), target_modules=["q_proj"])
    save_merged(pm, tmp_path / "m", dtype=torch.bfloat16)
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
    ]
    assert json.loads((tmp_path / "m" / "config.json").read_text())["dtype"] == "bfloat16"
    loaded = _load(tmp_path / "m")
    ref = oracle(pm)
    assert_matches(((n, loaded[n]) for n in ref), ref, tol=4e-3)


def test_an_existing_directory_is_refused_unless_overwrite_and_then_replaced(tmp_path: Path) -> None:
    pm = lora(tiny_llama(), target_modules=["q_proj"], seed=1)
    out = tmp_path / "m"
    out.mkdir()
    (out / "keep.txt").write_text("old")
    with pytest.raises(CheckpointError, match="overwrite=True"):
        save_merged(pm, out)
    assert (out / "keep.txt").read_text() == "old"
    save_merged(pm, out, overwrite=True)
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").exists()


def test_a_failure_mid_write_leaves_the_previous_directory_intact(tmp_path: Path) -> None:
    pm = lora(tiny_llama(), target_modules="all-linear", seed=2)
    out = tmp_path / "m"
    save_merged(pm, out, max_shard_size=20_000)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    sink = SafetensorsSink(out, max_shard_size=20_000, overwrite=True)
    written = []

    def disk_full(name: str) -> None:
        written.append(name)
        if len(written) == 5:
            raise OSError(28, "No space left on device (injected)")

    sink.on_tensor = disk_full
    with pytest.raises(OSError, match="injected"):
        sink.sync(ParamStream(lora(tiny_llama(seed=3), target_modules="all-linear")))
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"], "the temporary directory was not removed"


def test_a_killed_save_leaves_the_previous_directory_intact_and_the_next_save_works(tmp_path: Path) -> None:
    out = tmp_path / "m"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"old checkpoint")
    proc = subprocess.Popen(
        [sys.executable, str(TESTS / "workers" / "checkpoint_kill.py"), str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])},
    )
    assert proc.stdout is not None
    deadline = time.monotonic() + 120
    line = ""
    while time.monotonic() < deadline and "WRITING" not in line:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            break
    assert "WRITING" in line, proc.communicate()[0][-3000:]
    os.kill(proc.pid, signal.SIGKILL)  # in the middle of writing the shards
    proc.wait()
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]
    assert (out / "model.safetensors").read_bytes() == b"old checkpoint"
    pm = lora(tiny_llama(), target_modules=["q_proj"], seed=4)
    save_merged(pm, out, overwrite=True)
    assert_matches(((n, t) for n, t in _load(out).items()), oracle(pm))


def test_vllm_serves_the_saved_checkpoint_like_transformers(tmp_path: Path) -> None:
    from helpers import vllm_engine, vllm_llama
    from transformers import AutoModelForCausalLM

    for k, v in VLLM_ENV.items():
        os.environ.setdefault(k, v)
    pm = lora(vllm_llama(tie=True), target_modules="all-linear", lora_alpha=32)
    out = tmp_path / "merged"
    save_merged(pm, out, max_shard_size="200KB")
    llm = vllm_engine(str(out))
    assert_vllm_serves(vllm_generate(llm), AutoModelForCausalLM.from_pretrained(out))
