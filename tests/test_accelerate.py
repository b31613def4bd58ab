"""Models returned by accelerator.prepare(...) are streamed with the right gatherer, chosen automatically.

See workers/accelerate_stream.py for what Accelerate 1.15 does with DeepSpeed / FSDP plugins on a CPU-only machine
and the closest real path these tests take.
"""

from __future__ import annotations

import pytest
from helpers import event, require
from launch import assert_all_ok, describe, launch


@pytest.mark.parametrize("setup", ["zero3", "fsdp2", "fsdp1", "ddp"])
def test_accelerate_prepared_model_streams_the_oracle(setup: str) -> None:
    require("accelerate")
    require("deepspeed")
    results = launch("accelerate_stream", setup)
    assert_all_ok(results)
    assert all(event(r.output, "match")["setup"] == setup for r in results), describe(results)
