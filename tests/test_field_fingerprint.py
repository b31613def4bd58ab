"""The field fingerprint (lora_stream.field_fingerprint): its definition, its sums over partitions, its updates, the
structured edits it must see, its refusals, and its bound's construction on a small prime."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from lora_stream.field_fingerprint import (
    BLOCK,
    KEY_ID,
    MAX_POSITIONS,
    P,
    element_words,
    field_add,
    field_delta,
    field_fingerprint,
    field_reference,
)
from lora_stream.fingerprint import FingerprintError

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.uint8]


def _tensor(n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.uint8:
        return torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8)
    return torch.randn(n, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("n", "offset"), [(0, 0), (1, 0), (7, 3), (300, (1 << 35) + 1)])
def test_the_fingerprint_is_its_definition(dtype: torch.dtype, n: int, offset: int) -> None:
    t = _tensor(n, dtype)
    assert field_fingerprint(t, offset) == tuple(field_reference(element_words(t).tolist(), offset))


def test_across_blocks_too() -> None:
    """Blocks of BLOCK positions, a part block, and a start that is not a block's."""
    t = _tensor(2 * BLOCK + 5, torch.bfloat16)
    assert field_fingerprint(t, 12345) == tuple(field_reference(element_words(t).tolist(), 12345))


def test_the_words_are_the_unsigned_bits_plus_one() -> None:
    t = torch.tensor([0.0, -0.0, 1.0, float("nan")], dtype=torch.bfloat16)
    assert element_words(t).tolist() == [1, 0x8000 + 1, 0x3F80 + 1, int(t.view(torch.int16)[3]) % 65536 + 1]
    f = torch.tensor([-1.0], dtype=torch.float32)
    assert element_words(f).tolist() == [0xBF800000 + 1]


def test_the_key_and_a_value_are_pinned() -> None:
    """The same in every process and build: a trainer and an engine compare values computed apart."""
    assert KEY_ID == "329a20e01ac39856"
    t = torch.arange(10, dtype=torch.float32)
    assert field_fingerprint(t, 3) == tuple(field_reference(element_words(t).tolist(), 3))
    assert field_fingerprint(t, 3) == (805672583882265090, 408633383699752093)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_any_partition_of_the_positions_adds_up_to_the_whole(dtype: torch.dtype) -> None:
    """Ranks' ranges, tensor-parallel slices, row blocks: cut anywhere, the parts' sum is the whole's."""
    t = _tensor(3 * BLOCK + 17, dtype, seed=1)
    whole = field_fingerprint(t)
    rng = random.Random(0)
    for _ in range(5):
        cuts = sorted(rng.sample(range(1, t.numel()), 4))
        bounds = [0, *cuts, t.numel()]
        parts = [field_fingerprint(t[lo:hi], lo) for lo, hi in itertools.pairwise(bounds)]
        assert field_add(*parts) == whole
    rows = t[: 3 * BLOCK].view(3, BLOCK)  # the row blocks of a fused tensor, each fingerprinted where it lands
    assert (
        field_add(
            *(field_fingerprint(rows[i], i * BLOCK) for i in range(3)), field_fingerprint(t[3 * BLOCK :], 3 * BLOCK)
        )
        == whole
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_an_update_is_the_new_value_in_the_changed_positions_only(dtype: torch.dtype) -> None:
    t = _tensor(BLOCK + 999, dtype, seed=2)
    new = t.clone()
    idx = torch.tensor([0, 1, 5, BLOCK - 1, BLOCK, BLOCK + 998])
    new[idx] = _tensor(idx.numel(), dtype, seed=3)
    offset = (1 << 33) + 7  # positions far into a large tensor use every table
    update = field_delta(idx + offset, t[idx], new[idx])
    assert field_add(field_fingerprint(t, offset), update) == field_fingerprint(new, offset)
    assert field_delta(torch.empty(0, dtype=torch.int64), t[:0], t[:0]) == (0, 0)


def _edits(t: torch.Tensor) -> dict[str, torch.Tensor]:
    """The structured edits no fixed-weight sum may be trusted with: each a pair with ``t``."""
    out = {}
    e = t.clone()
    e[3] = -e[3]
    out["one sign flip"] = e
    e = t.clone()
    e[3], e[9] = -e[3], -e[9]
    out["two sign flips"] = e
    e = t.clone()
    e[4] = e[4] * 2
    out["a power of two"] = e
    e = t.clone()
    e[5], e[6] = e[6].clone(), e[5].clone()
    out["a swap"] = e
    e = t.clone()
    e[10:20] = e[10:20].flip(0)
    out["a permutation"] = e
    e = t.clone()
    e[0] = 0.0
    f = e.clone()
    f[0] = -0.0
    out["-0.0 for 0.0"] = f
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_every_structured_edit_changes_the_fingerprint_and_the_same_nan_does_not(dtype: torch.dtype) -> None:
    t = _tensor(64, dtype, seed=4)
    t[0] = 0.0
    base = field_fingerprint(t)
    for name, edited in _edits(t).items():
        if name == "-0.0 for 0.0":
            assert field_fingerprint(edited) != base, name
            continue
        assert not torch.equal(edited.view(torch.uint8), t.view(torch.uint8)), name
        assert field_fingerprint(edited) != base, name
    nan = t.clone()
    nan[1] = float("nan")
    assert field_fingerprint(nan) == field_fingerprint(nan.clone())


def test_the_bound_holds_for_every_pair_on_a_small_prime() -> None:
    """The construction, counted: for a fixed pair of distinct inputs of n positions, at most n - 1 of the p keys
    make them collide (a nonzero polynomial of degree below n), on random and structured pairs alike."""
    p, n = 257, 12
    rng = random.Random(1)
    pairs = []
    for _ in range(200):
        a = [rng.randrange(1, 1 << 16) for _ in range(n)]
        b = list(a)
        kind = rng.randrange(4)
        if kind == 0:
            b[rng.randrange(n)] ^= 0x8000  # a sign flip of a 16-bit float
        elif kind == 1:
            i, j = rng.sample(range(n), 2)
            b[i], b[j] = b[j], b[i]
        elif kind == 2:
            rng.shuffle(b)
        else:
            b[rng.randrange(n)] = rng.randrange(1, 1 << 16)
        if a != b:
            pairs.append((a, b))
    # Coefficients equal modulo this small p where the words differ by a multiple of p: the bound's condition
    # (every difference nonzero mod p, as below 2**32 < 2**61 - 1) is kept by dropping those pairs.
    pairs = [(a, b) for a, b in pairs if all((x - y) % p != 0 or x == y for x, y in zip(a, b))]
    assert len(pairs) > 100
    for a, b in pairs:
        keys = list(range(p))
        fa = field_reference(a, 0, keys, p)
        fb = field_reference(b, 0, keys, p)
        assert sum(x == y for x, y in zip(fa, fb)) <= n - 1


@pytest.mark.parametrize(
    "t",
    [
        torch.zeros(3, dtype=torch.float64),
        torch.zeros(3, dtype=torch.int64),
        torch.zeros(3, device="meta"),
        torch.quantize_per_tensor(torch.zeros(3), 0.1, 0, torch.qint8),
    ],
)
def test_what_has_no_element_bits_is_refused(t: torch.Tensor) -> None:
    with pytest.raises(FingerprintError):
        field_fingerprint(t)


def test_positions_beyond_the_bound_are_refused() -> None:
    with pytest.raises(FingerprintError, match="beyond"):
        field_fingerprint(torch.zeros(4), MAX_POSITIONS - 2)
    with pytest.raises(FingerprintError, match="beyond"):
        field_delta(torch.tensor([MAX_POSITIONS]), torch.zeros(1), torch.ones(1))


def test_values_are_field_elements() -> None:
    v = field_fingerprint(_tensor(1000, torch.float32))
    assert all(0 <= x < P for x in v)
