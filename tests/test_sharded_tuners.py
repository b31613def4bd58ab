"""LoHa, LoKr and LoRA/DoRA on convolutions under ZeRO-3 and FSDP2 (2 real gloo ranks) equal peft's merge.

These merges read every factor through the gatherer's accessor; reading the layer's own attributes instead (what
peft's ``get_delta_weight`` does) computes on DTensor shards under FSDP2.
"""

from __future__ import annotations

import json

import pytest
from helpers import require
from launch import describe, launch


def _results(output: str) -> dict[str, object]:
    lines = [ln for ln in output.splitlines() if ln.startswith("RESULT ")]
    assert lines, output[-3000:]
    return json.loads(lines[-1][len("RESULT ") :])  # type: ignore[no-any-return]


@pytest.mark.distributed
@pytest.mark.parametrize("gatherer", ["zero3", "fsdp2"])
def test_lycoris_and_conv_adapters_under_a_sharded_gatherer_equal_the_oracle(gatherer: str) -> None:
    if gatherer == "zero3":
        require("deepspeed")
    results = launch("sharded_tuners", gatherer, timeout=240)
    for r in results:
        cases = _results(r.output)["cases"]
        assert cases and all(v == "match" for v in cases.values()), f"rank {r.rank}: {cases}\n{describe(results)}"
        assert r.returncode == 0, describe(results)
