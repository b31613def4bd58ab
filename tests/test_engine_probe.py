"""The server-side probe's pieces that need no engine: its attention against torch's, its refusals."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from lora_stream.engine.probe import _causal_attention, _window, probe_refusal


def _impl(**kw: object) -> SimpleNamespace:
    base = {"num_heads": 4, "num_kv_heads": 2, "scale": 0.125, "alibi_slopes": None, "sinks": None}
    return SimpleNamespace(**{**base, **kw})


@pytest.mark.parametrize("sliding", [None, -1, (-1, -1), 5, (4, 0)])
def test_the_probe_attention_is_torchs_causal_attention_with_gqa_and_every_window_form(sliding: object) -> None:
    torch.manual_seed(0)
    t, heads, kv, d = 12, 4, 2, 8
    q, k, v = torch.randn(t, heads, d), torch.randn(t, kv, d), torch.randn(t, kv, d)
    out = torch.empty(t, heads, d)
    _causal_attention(_impl(sliding_window=sliding), None, q, k, v, None, None, output=out)
    window = _window(sliding)
    assert window == (5 if sliding in (5, (4, 0)) else -1)
    i = torch.arange(t)
    visible = (i[None, :] <= i[:, None]) & ((i[:, None] - i[None, :] < window) if window > 0 else True)
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.repeat_interleave(2, dim=1).transpose(0, 1),
        v.repeat_interleave(2, dim=1).transpose(0, 1),
        attn_mask=visible,
        scale=0.125,
    ).transpose(0, 1)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


class _Attention(nn.Module):
    def __init__(self, **kw: object) -> None:
        super().__init__()
        self.impl = _impl(**kw)
        self.layer_name = "model.layers.0.self_attn.attn"


def test_the_probe_refuses_what_it_cannot_reproduce() -> None:
    assert probe_refusal(nn.Sequential(_Attention(attn_type="decoder"))) is None
    assert "ALiBi" in str(probe_refusal(nn.Sequential(_Attention(alibi_slopes=[1.0]))))
    assert "sinks" in str(probe_refusal(nn.Sequential(_Attention(sinks=torch.zeros(4)))))
    cross = SimpleNamespace(value="encoder_decoder")
    assert "encoder_decoder attention" in str(probe_refusal(nn.Sequential(_Attention(attn_type=cross))))
    assert "no vLLM attention" in str(probe_refusal(nn.Linear(2, 2)))
    pp = SimpleNamespace(parallel_config=SimpleNamespace(pipeline_parallel_size=2), model_config=None)
    assert "pipeline" in str(probe_refusal(nn.Sequential(_Attention()), pp))
    mrope = SimpleNamespace(parallel_config=None, model_config=SimpleNamespace(uses_mrope=True))
    assert "M-RoPE" in str(probe_refusal(nn.Sequential(_Attention()), mrope))

    class MambaMixer2(nn.Module):
        pass

    assert "state-space" in str(probe_refusal(nn.Sequential(_Attention(), MambaMixer2())))
