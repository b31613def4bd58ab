"""What a sync that skips unchanged outputs compares (``lora_stream.fingerprint``, ``ParamStream.fingerprints()``):
any change of a frozen source's bytes is seen, however it was written; nothing else moves the fingerprint."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from helpers import lora, missed_structured_edits, perturb_adapters, tiny_llama

from lora_stream import ParamStream
from lora_stream.fingerprint import _NH, BLOCK_WORDS, CHUNK_WORDS, _key, fingerprint, nh_reference


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


DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int8]


@pytest.mark.parametrize("dtype", DTYPES)
def test_no_structured_edit_keeps_the_fingerprint(dtype: torch.dtype) -> None:
    """Sign flips at every parity, powers of two, swapped rows and columns, permutations: in every dtype, none
    leaves the fingerprint (the linear sum this replaced missed every sign flip pair)."""
    assert not missed_structured_edits(fingerprint, dtype), dtype


def test_structured_edits_across_blocks_and_chunks() -> None:
    """The same edits where the bytes span many NH blocks and several chunks: two sign flips in different blocks,
    and the same flip in every block."""
    w = torch.randn(CHUNK_WORDS * 4 + 123)  # float32, two to a word: many blocks, three chunks and a tail
    base = fingerprint(w)
    e = w.clone()
    e[1].neg_()
    e[1 + 2 * BLOCK_WORDS].neg_()  # the same position of another block
    assert fingerprint(e) != base
    e = w.clone()
    e[1 :: 2 * BLOCK_WORDS].neg_()
    assert fingerprint(e) != base
    e = w.clone()
    e[-1].neg_()  # the tail
    assert fingerprint(e) != base


def test_the_fast_form_is_nh_by_its_definition() -> None:
    """What ``fingerprint`` computes per block equals NH written as its definition (modulo 2**64, two lanes)."""
    gen = torch.Generator().manual_seed(3)
    key = _key(torch.device("cpu"))
    for blocks, n in ((1, 1), (1, 77), (3, BLOCK_WORDS)):
        words = torch.randint(-(1 << 63), (1 << 63) - 1, (blocks, n), generator=gen, dtype=torch.int64)
        assert torch.equal(_NH(key, blocks * n)(words).view(blocks, 2), nh_reference(words, key)), (blocks, n)


@pytest.mark.parametrize("half_bits", [4, 6])
def test_the_bound_holds_for_fixed_pairs_of_inputs_on_a_reduced_word(half_bits: int) -> None:
    """The bound is a claim about *any fixed pair* of distinct inputs, over the key: one lane of NH collides with
    probability at most 2**-half_bits. At 32 bits that is too rare to count, so the same construction is checked on
    words of 2 * half_bits bits, where it can be: for structured pairs (one word's sign bit, two sign bits that
    cancel in a weighted sum, swapped words, a word doubled) and random ones, over many keys."""
    words_per_block = 16
    top = 1 << (2 * half_bits - 1)  # the "sign bit" of a reduced word
    gen = torch.Generator().manual_seed(half_bits)
    x = torch.randint(0, 1 << (2 * half_bits), (words_per_block,), generator=gen, dtype=torch.int64)
    pairs = {}
    y = x.clone()
    y[3] ^= top
    pairs["one sign bit"] = y
    y = x.clone()
    y[3] ^= top
    y[5] ^= top
    pairs["two sign bits"] = y
    y = x.clone()
    y[[2, 9]] = y[[9, 2]]
    pairs["two words swapped"] = y if not torch.equal(y, x) else y.roll(1)
    y = x.clone()
    y[4] = (y[4] * 2) % (1 << 2 * half_bits)
    pairs["one word doubled"] = y if not torch.equal(y, x) else y.roll(1)
    pairs["random"] = torch.randint(0, 1 << (2 * half_bits), (words_per_block,), generator=gen, dtype=torch.int64)
    keys = 20000
    key = torch.randint(0, 1 << half_bits, (keys, 2, words_per_block), generator=gen, dtype=torch.int64)
    mask = (1 << half_bits) - 1
    bound = 2.0**-half_bits

    def nh(words: torch.Tensor) -> torch.Tensor:
        """One lane of NH on reduced words, for every key at once."""
        a = ((words & mask) + key[:, 0]) & mask
        b = (((words >> half_bits) & mask) + key[:, 1]) & mask
        return (a * b).sum(-1) & ((1 << 2 * half_bits) - 1)

    for name, y in pairs.items():
        assert not torch.equal(x, y), name
        rate = (nh(x) == nh(y)).double().mean().item()
        # 20000 keys: a rate at the bound has a standard deviation of under 0.2 * bound at these sizes.
        assert rate <= bound * 1.25, (name, rate, bound)


def test_the_same_in_every_process() -> None:
    """Fingerprints recorded at one sync are compared at the next: nothing may depend on the process."""
    program = "import torch; from lora_stream.fingerprint import fingerprint; print(fingerprint(torch.arange(3000.0)))"
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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.uint8], ids=str)
@pytest.mark.parametrize("n_bytes", [0, 5, 8 * BLOCK_WORDS, 24 * BLOCK_WORDS + 12, 8 * (CHUNK_WORDS + BLOCK_WORDS)])
def test_a_running_fingerprint_of_pieces_is_the_fingerprint_of_the_whole(dtype: torch.dtype, n_bytes: int) -> None:
    """Pieces of whole blocks (one, or several), the last one ending anywhere, one of them at an odd offset (read
    through a copy): the value of the whole, read at once; and the misuses refused."""
    from lora_stream.fingerprint import RunningFingerprint

    item = torch.empty((), dtype=dtype).element_size()
    whole = torch.randint(0, 255, (n_bytes - n_bytes % item,), dtype=torch.uint8).view(dtype)
    n = whole.numel()
    for block_multiple in (1, 2, 64):
        running = RunningFingerprint(dtype, (n,))
        step = BLOCK_WORDS * 8 * block_multiple // item
        for a in range(0, n, step):
            piece = whole[a : a + step]
            if a == step:  # the same bytes at an address no int64 view can read
                shifted = torch.empty(piece.numel() * item + 1, dtype=torch.uint8)[1:]
                shifted.copy_(piece.view(torch.uint8))
                piece = shifted.view(dtype) if item == 1 else piece
            running.update(piece)
        assert running.value() == fingerprint(whole)
    running = RunningFingerprint(dtype, (n,))
    with pytest.raises(ValueError, match="a piece of"):
        running.update(torch.zeros(1, dtype=torch.float64))
    if n > BLOCK_WORDS * 8 // item:
        running.update(whole[:1])
        with pytest.raises(ValueError, match="inside a block"):
            running.update(whole[1:2])
    with pytest.raises(ValueError, match="bytes fingerprinted"):
        RunningFingerprint(dtype, (n + 1,)).value()
