"""A reused stream re-checks what its plan read from the model: it raises before yielding a stale merge."""

from __future__ import annotations

import copy
import time

import pytest
import torch
from helpers import assert_matches, find_event, lora, oracle, perturb_adapters, require, results_of, tiny_llama
from launch import assert_all_ok, describe, launch
from peft import LoraConfig
from torch import nn

from lora_stream import AdapterStream, ParamStream
from lora_stream.errors import StalePlanError

TARGETS = ["q_proj", "v_proj", "down_proj"]


def _two_adapters(**kw: object) -> nn.Module:
    model = lora(tiny_llama(layers=2), target_modules=TARGETS, **kw)
    model.add_adapter("b", LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False))
    perturb_adapters(model, seed=5)
    return model


def _lora_layers(model: nn.Module) -> list[nn.Module]:
    from peft.tuners.lora import LoraLayer

    return [m for m in model.modules() if isinstance(m, LoraLayer)]


def _set_scale(model: nn.Module, scale: float) -> None:
    for layer in _lora_layers(model):
        layer.set_scale("default", scale)


def _forward_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The weights the model's forward applies now: peft's merge of the active adapters, or, with adapters
    disabled, the base weights (merge_and_unload would merge them anyway)."""
    if any(layer.disable_adapters for layer in _lora_layers(model)):
        base = copy.deepcopy(model).unload()
        return {n: p.detach() for n, p in base.named_parameters()}
    return oracle(model)


CHANGES = {
    "set_adapter": (lambda m: m.set_adapter("b"), lambda m: m.set_adapter("default"), "active_adapters"),
    "merge_adapter": (lambda m: m.merge_adapter(), lambda m: m.unmerge_adapter(), "merged_adapters"),
    "disable_adapter": (
        lambda m: m.base_model.disable_adapter_layers(),
        lambda m: m.base_model.enable_adapter_layers(),
        "disable_adapters",
    ),
    "set_scale": (lambda m: _set_scale(m, 3.0), lambda m: _set_scale(m, 1.0), "scaling['default'] 2.0 -> 6.0"),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_reused_stream_raises_after_the_adapter_state_changed_and_yields_nothing(change: str) -> None:
    model = _two_adapters()
    stream = ParamStream(model, layout="memory")
    first = {n: t.clone() for n, t in stream}
    apply, undo, named = CHANGES[change]
    apply(model)
    yielded = []
    with pytest.raises(StalePlanError) as info:
        for item in stream:
            yielded.append(item)
    assert yielded == []
    assert named in str(info.value) and info.value.changes, str(info.value)
    assert "base_model.model.model.layers.0.self_attn.q_proj" in str(info.value)
    # A fresh stream follows the model as it is now (merge_adapter is refused, as at construction).
    if change == "merge_adapter":
        with pytest.raises(Exception, match="merged into its base weight in place"):
            ParamStream(model, layout="memory")
    else:
        assert_matches(ParamStream(model, layout="memory"), _forward_weights(model), tol=1e-6)
    undo(model)
    assert stream.plan_changes() == []
    assert all(torch.equal(t, first[n]) for n, t in stream)


def test_the_disable_adapter_context_and_modules_to_save_are_rechecked() -> None:
    model = _two_adapters(modules_to_save=["lm_head"])
    stream = ParamStream(model, layout="memory")
    with model.disable_adapter():
        with pytest.raises(StalePlanError, match="disable_adapters False -> True"):
            list(stream)
        # Forward uses the original lm_head while adapters are disabled, and so does a new stream.
        fresh = dict(ParamStream(model, layout="memory"))
        assert torch.equal(fresh["lm_head.weight"], model.base_model.model.lm_head.original_module.weight)
    model.set_adapter("b")  # b saves no lm_head: forward uses the original module again
    with pytest.raises(StalePlanError, match="modules_to_save state"):
        list(stream)


def test_a_replaced_or_reshaped_parameter_is_refused() -> None:
    model = _two_adapters()
    stream = ParamStream(model, layout="memory")
    head = model.base_model.model.lm_head
    old = head.weight
    head.weight = nn.Parameter(old.detach().clone())
    with pytest.raises(StalePlanError, match="'weight' replaced by another parameter object"):
        list(stream)
    head.weight = old
    assert stream.plan_changes() == []
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    factor = layer.lora_A["default"]
    factor.weight = nn.Parameter(torch.randn(8, factor.weight.shape[1]))
    with pytest.raises(StalePlanError, match=r"Linear\.weight"):
        list(stream)


def test_an_adapter_stream_is_rechecked_too() -> None:
    model = _two_adapters()
    stream = AdapterStream(model)
    list(stream)
    model.set_adapter("b")
    with pytest.raises(StalePlanError, match="active_adapters"):
        list(stream)


def test_a_sink_refuses_a_stale_stream_in_its_preflight_before_touching_the_engine() -> None:
    from lora_stream.transaction import Transaction

    model = _two_adapters()
    stream = ParamStream(model, layout="memory")
    model.set_adapter("b")
    touched = []
    tx = Transaction.for_stream(stream, "test")
    with pytest.raises(StalePlanError):
        tx.prepare(lambda: touched.append(1))
    assert touched == []


def test_the_recheck_costs_microseconds_per_module() -> None:
    model = lora(tiny_llama(layers=8), target_modules="all-linear")
    stream = ParamStream(model)
    facts = len(stream._witness)
    start = time.perf_counter()
    for _ in range(20):
        stream.check_plan()
    per_pass = (time.perf_counter() - start) / 20
    # Generous: it measured ~3 us per fact on this machine; a regression to reading tensors would be far above.
    assert per_pass < facts * 50e-6, (per_pass, facts)


@pytest.mark.parametrize("kind", ["fsdp2", "zero3"])
def test_a_reused_sharded_stream_raises_on_every_rank_after_each_change(kind: str) -> None:
    if kind == "zero3":
        require("deepspeed")
    results = launch("stale_plan", kind, timeout=240)
    assert_all_ok(results)
    ranks = [results_of(r.output) for r in results]
    for events in ranks:
        assert find_event(events, "first", describe(results))["outcome"] == "ok"
        e = find_event(events, "after-forward", describe(results))
        assert e["outcome"] == "ok" and e["same"], e
        for change in ("set_adapter", "merge_adapter", "set_scale"):
            e = find_event(events, change, describe(results))
            assert e["outcome"] == "stale" and e["yielded"] == 0, (change, e)
            assert e["again"] == "ok" and e["same_after_undo"], (change, e)
        e = find_event(events, "disable_adapter", describe(results))
        assert e["outcome"] == "stale" and e["yielded"] == 0, e
        e = find_event(events, "replanned", describe(results))
        assert e["outcome"] == "ok" and e["names_match"] and e["max_rel_err"] < 1e-6, e
    one = [find_event(events, "one-rank", describe(results)) for events in ranks]
    assert one[1]["outcome"] == "stale", one
    assert one[0]["outcome"] == "aborted" and one[0]["failed"] == [1] and "StalePlanError" in one[0]["message"], one


def test_the_trl_hook_plans_again_when_the_adapter_state_changed_and_says_so_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    import logging
    from types import SimpleNamespace

    from lora_stream.integrations.trl import TrlSyncHook

    model = _two_adapters()
    hook = TrlSyncHook(SimpleNamespace(model_wrapped=None, model=model), {"layout": "memory"}, {})
    first = hook._stream()
    assert hook._stream() is first  # reused while nothing changed
    model.set_adapter("b")
    with caplog.at_level(logging.INFO, logger="lora_stream"):
        second = hook._stream()
        assert hook._stream() is second
    replans = [r for r in caplog.records if "planning it again" in r.getMessage()]
    assert len(replans) == 1 and "active_adapters" in replans[0].getMessage(), caplog.records
    assert second is not first
    assert_matches(second, _forward_weights(model), tol=1e-6)  # b's merge, not a's


def test_an_adapter_deleted_and_added_again_under_its_name_is_refused() -> None:
    model = _two_adapters()
    model.set_adapter("b")
    stream = ParamStream(model, layout="memory")
    model.add_adapter("c", LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False))
    model.set_adapter("c")
    model.delete_adapter("b")
    model.add_adapter("b", LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False))
    model.set_adapter("b")
    with pytest.raises(StalePlanError, match="lora_A"):
        list(stream)
