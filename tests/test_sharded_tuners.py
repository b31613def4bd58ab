"""LoHa, LoKr and LoRA/DoRA on convolutions under ZeRO-3 and FSDP2 (2 real gloo ranks) equal peft's merge.

These merges read every factor through the gatherer's accessor; reading the layer's own attributes instead (what
peft's ``get_delta_weight`` does) computes on DTensor shards under FSDP2.
"""

from __future__ import annotations

import pytest
from helpers import require, results_of
from launch import describe, launch


@pytest.mark.distributed
@pytest.mark.parametrize("gatherer", ["zero3", "fsdp2"])
def test_lycoris_and_conv_adapters_under_a_sharded_gatherer_equal_the_oracle(gatherer: str) -> None:
    if gatherer == "zero3":
        require("deepspeed")
    results = launch("sharded_tuners", gatherer, timeout=240)
    for r in results:
        records = results_of(r.output)
        assert records, describe(results)
        cases = records[-1]["cases"]
        assert cases and all(v == "match" for v in cases.values()), f"rank {r.rank}: {cases}\n{describe(results)}"
        assert r.returncode == 0, describe(results)
