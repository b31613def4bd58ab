"""What a sync that skips unchanged outputs compares (``lora_stream.fingerprint``, ``ParamStream.fingerprints()``):
any change of a frozen source's bytes is seen, however it was written; nothing else moves the fingerprint."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from helpers import lora, perturb_adapters, tiny_llama

from lora_stream import ParamStream, fingerprint
from lora_stream.fingerprint import BLOCK_WORDS, _weighted_sum


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8])
@pytest.mark.parametrize("numel", [1, 7, 1000, BLOCK_WORDS * 2 + 3])
def test_every_single_element_change_moves_the_fingerprint(dtype: torch.dtype, numel: int) -> None:
    """Words and tail bytes alike, in the first, a middle and the last block."""
    gen = torch.Generator().manual_seed(numel)
    t = (torch.randn(numel, generator=gen) * 50).to(dtype)
    base = fingerprint(t)
    assert fingerprint(t.clone()) == base
    for i in sorted({0, numel // 2, numel - 1, min(BLOCK_WORDS * 8 // t.element_size(), numel - 1)}):
        edited = t.clone()
        edited.view(torch.uint8)[i * t.element_size()] ^= 1  # one bit of one element
        assert fingerprint(edited) != base, (dtype, numel, i)


def test_dtype_shape_and_layout() -> None:
    t = torch.randn(4, 6)
    assert fingerprint(t) != fingerprint(t.view(6, 4)) != fingerprint(t.view(torch.int32))
    assert fingerprint(t.t()) == fingerprint(t.t().contiguous())  # the values in order, not the memory
    assert fingerprint(torch.empty(0)) != fingerprint(torch.empty(0, 3))


def test_the_cpu_dot_wraps_as_the_product_sum_other_devices_use() -> None:
    gen = torch.Generator().manual_seed(3)
    for n in (1, 9, 4096, BLOCK_WORDS):
        block = torch.randint(-(1 << 62), 1 << 62, (n,), generator=gen, dtype=torch.int64)
        weights = torch.randint(-(1 << 62), 1 << 62, (n,), generator=gen, dtype=torch.int64) | 1
        assert int(_weighted_sum(block, weights, True)) == int(_weighted_sum(block, weights, False))


def test_the_same_in_every_process() -> None:
    """Fingerprints recorded at one sync are compared at the next: nothing may depend on the process."""
    program = "import torch; from lora_stream import fingerprint; print(fingerprint(torch.arange(3000.0)))"
    other = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120, check=True)
    assert int(other.stdout.split()[-1]) == fingerprint(torch.arange(3000.0))


def test_the_streams_fingerprints_see_every_write_to_a_frozen_source_and_skip_trainable_ones() -> None:
    pm = lora(tiny_llama(tie=False), target_modules=["q_proj", "v_proj"])
    perturb_adapters(pm)
    stream = ParamStream(pm, group_by="layer")
    names = [n for step in stream.steps() for n in step]
    before = dict(zip(names, stream.fingerprints(), strict=True))
    # A LoRA-merged output has a trainable source: no fingerprint, sent at every sync.
    assert all(before[n] is None for n in names if n.endswith(("q_proj.weight", "v_proj.weight"))), before
    assert all(before[n] is not None for n in names if "k_proj" in n or "norm" in n or "embed" in n), before
    # Training the adapter moves nothing; a write through .data (no version counter moves) is seen.
    perturb_adapters(pm, seed=2)
    assert dict(zip(names, stream.fingerprints(), strict=True)) == before
    norm = pm.base_model.model.model.norm.weight
    norm.data.mul_(1.5)
    after = dict(zip(names, stream.fingerprints(), strict=True))
    assert [n for n in names if after[n] != before[n]] == ["model.norm.weight"]
    # Made trainable: no fingerprint while it is.
    norm.requires_grad_(True)
    assert dict(zip(names, stream.fingerprints(), strict=True))["model.norm.weight"] is None
