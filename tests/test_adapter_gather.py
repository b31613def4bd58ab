"""One all-gather per group for a group's small parameters (an adapter's LoRA factors), under ZeRO-3 and FSDP2:
2 real ranks over gloo (see workers/adapter_gather.py)."""

from __future__ import annotations

import pytest
from helpers import event, require, results_of
from launch import assert_all_ok, describe, launch

MODELS = ["lora-r4", "lora-r3-uneven", "lora-bf16-f32"]


@pytest.mark.parametrize("how", ["zero3", "fsdp2"])
def test_a_groups_lora_factors_are_one_all_gather_and_equal_the_per_parameter_gathers_bit_for_bit(how: str) -> None:
    if how == "zero3":
        require("deepspeed")
    results = launch("adapter_gather", how, timeout=300)
    assert_all_ok(results)
    for r in results:
        records = [e for e in results_of(r.output) if e.get("event") == "adapter-gather"]
        assert [e["model"] for e in records] == MODELS, describe(results)
        for e in records:
            assert e["all_gathers"] == [1] and set(e["all_gathers_budget"]) == {1}, e
            assert e["all_gathers_per_parameter"] == [e["factors"]], e
            assert e["kept_passes"] == 5, e  # buffers kept between passes: every pass bit-equal
        assert 2 in records[-1]["piece_bytes_mod_4"], records[-1]  # bf16 pieces not a multiple of 4 bytes
        merged = event(r.output, "merged-gather")
        assert sum(merged["all_gathers"]) < sum(merged["per_parameter"]), merged
