"""Property tests: random tiny Llama-like and GPT-2-like models x random LoRA configs against peft's merge."""

from __future__ import annotations

import torch
from helpers import assert_matches, lora, oracle, tiny_gpt2, tiny_llama
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lora_stream import ParamStream

LLAMA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "embed_tokens"]
GPT2_TARGETS = ["c_attn", "c_proj", "c_fc"]


@st.composite
def model_and_config(draw: st.DrawFn) -> tuple[str, dict, dict]:
    arch = draw(st.sampled_from(["llama", "gpt2"]))
    tie = draw(st.booleans())
    layers = draw(st.integers(1, 3))
    hidden = draw(st.sampled_from([32, 64]))
    lora_kw: dict = {
        "r": draw(st.integers(1, 8)),
        "lora_alpha": draw(st.sampled_from([1, 4, 16, 32])),
        "use_rslora": draw(st.booleans()),
        "use_dora": draw(st.booleans()),
    }
    if arch == "llama":
        targets = draw(st.lists(st.sampled_from(LLAMA_TARGETS), min_size=1, max_size=5, unique=True))
        save = draw(st.sampled_from([None, ["lm_head"], ["lm_head", "embed_tokens"], ["norm"]]))
        if save and "embed_tokens" in targets and "embed_tokens" in save:
            save = ["lm_head"]
        if tie and "embed_tokens" in targets:  # refused: the trainer's tied lm_head keeps the base weight
            targets = [t for t in targets if t != "embed_tokens"] or ["q_proj"]
        model_kw = dict(tie=tie, layers=layers, hidden=hidden, inter=draw(st.sampled_from([48, 96])))
    else:
        targets = draw(st.lists(st.sampled_from(GPT2_TARGETS), min_size=1, max_size=3, unique=True))
        save = draw(st.sampled_from([None, ["lm_head"], ["ln_f"]]))
        lora_kw["fan_in_fan_out"] = True
        model_kw = dict(tie=tie, layers=layers, hidden=hidden)
    lora_kw["target_modules"] = targets
    if save:
        lora_kw["modules_to_save"] = save
    if draw(st.booleans()) and len(targets) > 1:
        lora_kw["rank_pattern"] = {targets[0]: draw(st.integers(1, 6))}
        lora_kw["alpha_pattern"] = {targets[-1]: draw(st.integers(1, 40))}
    return arch, model_kw, lora_kw


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    spec=model_and_config(),
    seed=st.integers(0, 2**16),
    group_by=st.sampled_from(["budget", "layer", "module"]),
)
def test_random_models_stream_like_peft_merges(spec: tuple[str, dict, dict], seed: int, group_by: str) -> None:
    arch, model_kw, lora_kw = spec
    model = (tiny_llama if arch == "llama" else tiny_gpt2)(seed=seed, **model_kw)
    pm = lora(model, seed=seed, **lora_kw)
    expected = oracle(pm)
    stream = ParamStream(pm, group_by=group_by, budget_bytes=30_000)  # type: ignore[arg-type]
    got = list(stream)
    # Contract points 1-3 and 5: the names, values, coverage and order of peft's merged model.
    assert_matches(got, expected)
    assert [m.name for m in stream.metadata()] == list(expected)
    assert all(t.dtype == torch.float32 for _, t in got)
