"""The weight digests the server sink's ``verify=`` compares across a model's replicas, on every supported vLLM.

Why: vLLM 0.32 and later digest every served parameter themselves
(``vllm.model_executor.model_loader.weight_checksum.compute_tensor_digests``); vLLM 0.31 has no such module, so
lora_stream computes them itself there (``lora_stream.engine.probe._compute_tensor_digests``). The fallback must be
the same function byte for byte -- same names, same bytes hashed -- so that replicas are compared the same way on
every release. Where vLLM has its own, the fallback is checked against it on a served model (an engine's real
parameters, as vLLM loaded and repacked them) and on a transformers model in bfloat16; where it has none, what
``weight_digests`` answers is checked to be the fallback's, over every parameter.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from pathlib import Path

import pytest
import torch
from helpers import VLLM_ENV, require, save_for_vllm, vllm_engine, vllm_llama

from lora_stream.engine.probe import _compute_tensor_digests, weight_digests
from lora_stream.sinks.local_engine import local_model_runner

for _k, _v in VLLM_ENV.items():
    os.environ.setdefault(_k, _v)

CHECKSUM = "vllm.model_executor.model_loader.weight_checksum"


def _vllm_has_checksum() -> bool:
    return importlib.util.find_spec(CHECKSUM) is not None


def test_the_fallback_hashes_each_parameters_bytes_under_its_name() -> None:
    """Independent of vLLM: each digest is the SHA-256 of the parameter's contiguous bytes, keyed by its name."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3)).to(torch.bfloat16)
    with torch.no_grad():
        model[0].weight.copy_(torch.arange(12, dtype=torch.bfloat16).view(3, 4).t().contiguous().t())
    digests = _compute_tensor_digests(model)
    assert list(digests) == [n for n, _ in model.named_parameters()]
    for name, param in model.named_parameters():
        raw = param.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        assert digests[name] == hashlib.sha256(raw).hexdigest(), name


def test_weight_digests_equal_vllms_own_on_a_served_model(tmp_path: Path) -> None:
    """On a release with ``compute_tensor_digests`` the fallback equals it for an engine's parameters and for a
    bfloat16 transformers model; on one without (0.31), ``weight_digests`` answers the fallback's digests."""
    require("vllm")
    path = save_for_vllm(vllm_llama(), str(tmp_path / "model"))
    llm = vllm_engine(path)
    runner = local_model_runner(llm.llm_engine)
    assert runner is not None, "the test engine runs in this process"
    served = runner.model
    names = [n for n, _ in served.named_parameters()]
    ours = _compute_tensor_digests(served)
    assert set(ours) == set(names) and len(names) > 5, names
    answered = weight_digests(served, "pp0/tp0/")
    assert answered == {f"pp0/tp0/{k}": v for k, v in ours.items()}
    if not _vllm_has_checksum():
        # vLLM 0.31: no function of vLLM's to compare with; weight_digests must have taken the fallback (above).
        import vllm

        assert vllm.__version__.startswith("0.31"), f"vLLM {vllm.__version__} lacks {CHECKSUM}"
        return
    from vllm.model_executor.model_loader.weight_checksum import compute_tensor_digests

    assert ours == compute_tensor_digests(served)
    hf = vllm_llama(seed=1).to(torch.bfloat16)
    before = _compute_tensor_digests(hf)
    assert before == compute_tensor_digests(hf)
    # One changed element changes exactly its parameter's digest, in both.
    with torch.no_grad():
        hf.model.norm.weight[0] += 1
    after = _compute_tensor_digests(hf)
    assert after == compute_tensor_digests(hf)
    assert [k for k in before if before[k] != after[k]] == ["model.norm.weight"]


def test_weight_digests_do_not_hide_a_broken_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only a missing ``weight_checksum`` module takes the fallback: a vLLM that fails to import raises."""
    import sys

    monkeypatch.setitem(sys.modules, "vllm", None)  # "import vllm" now raises ModuleNotFoundError for "vllm"
    monkeypatch.delitem(sys.modules, CHECKSUM, raising=False)
    monkeypatch.delitem(sys.modules, "vllm.model_executor", raising=False)
    monkeypatch.delitem(sys.modules, "vllm.model_executor.model_loader", raising=False)
    with pytest.raises(ModuleNotFoundError):
        weight_digests(torch.nn.Linear(2, 2), "")
