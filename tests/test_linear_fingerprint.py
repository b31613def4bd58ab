"""What an element sync proves with (``lora_stream.linear_fingerprint``): its definition, that it decomposes over any
partition of positions and updates in O(changed), that no structured edit keeps it, and its bound as a claim about
any fixed pair of inputs."""

from __future__ import annotations

import itertools
import subprocess
import sys

import pytest
import torch
from helpers import missed_structured_edits

from lora_stream import linear_fingerprint as lf
from lora_stream.linear_fingerprint import BLOCK_LIMBS, P, combine, limbs_per_element, linear_fingerprint, linear_update

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int8, torch.uint8]


def _reference(t: torch.Tensor, offset: int = 0) -> int:
    """The form as its docstring writes it, in Python integers."""
    per = limbs_per_element(t.dtype)
    flat = t.reshape(-1).contiguous()
    limbs = flat.view(torch.uint8).tolist() if t.element_size() == 1 else flat.view(torch.int16).tolist()
    lift = 1 if t.element_size() == 1 else 2**15 + 1
    a = lf._field(b"|A", BLOCK_LIMBS)
    c = lf._field(b"|C", (offset * per + len(limbs)) // BLOCK_LIMBS + 1)
    total = 0
    for k, v in enumerate(limbs):
        q = offset * per + k
        total += a[q % BLOCK_LIMBS] * c[q // BLOCK_LIMBS] * (v + lift)
    return total % P


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("n", "offset"), [(1, 0), (9, 5), (BLOCK_LIMBS + 7, 3), (1000, BLOCK_LIMBS - 2)])
def test_the_fast_form_is_the_definition(dtype: torch.dtype, n: int, offset: int) -> None:
    """Blocks whole and partial, ranges that start inside a block and cross into the next: the float64 matrix
    product and the int64 reductions equal the form computed in Python integers."""
    gen = torch.Generator().manual_seed(n)
    t = (torch.randn(n, generator=gen) * 100).to(dtype)
    assert linear_fingerprint(t, offset) == _reference(t, offset)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_any_partition_adds_up_to_the_whole(dtype: torch.dtype) -> None:
    """Ranks' ranges, tensor-parallel slices, fused row blocks: the fingerprints of the parts of any partition of the
    positions sum to the whole's; a non-contiguous view fingerprints as its values in logical order."""
    gen = torch.Generator().manual_seed(1)
    t = (torch.randn(3 * BLOCK_LIMBS + 11, generator=gen) * 8).to(dtype)
    whole = linear_fingerprint(t)
    for parts in (2, 3, 7):
        cuts = sorted(torch.randint(0, t.numel(), (parts - 1,), generator=gen).tolist())
        edges = [0, *cuts, t.numel()]
        assert combine([linear_fingerprint(t[a:b], a) for a, b in itertools.pairwise(edges)]) == whole
    m = t[: 40 * 30].view(40, 30)
    assert linear_fingerprint(m.t()) == linear_fingerprint(m.t().contiguous())
    # Rows 10-19 and the rest of a matrix: a fused module's row block and its complement.
    rows = linear_fingerprint(m[10:20], 10 * 30)
    assert combine([linear_fingerprint(m[:10]), rows, linear_fingerprint(m[20:], 20 * 30)]) == linear_fingerprint(m)


def test_a_range_of_many_blocks_is_reduced_with_tensors_to_the_same_value() -> None:
    """Past the few blocks reduced with Python's integers, the same form, reduced with tensors."""
    long = (torch.randn(300 * BLOCK_LIMBS + 5, generator=torch.Generator().manual_seed(4)) * 8).to(torch.bfloat16)
    assert linear_fingerprint(long) == combine([linear_fingerprint(long[:7]), linear_fingerprint(long[7:], 7)])
    assert linear_fingerprint(long, 3) == _reference(long, 3)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_an_update_of_the_changed_elements_equals_a_full_read(dtype: torch.dtype) -> None:
    """O(changed): moving a range's fingerprint by its changed elements' old and new values gives what reading the
    changed range again gives, at any offset (NaN, -0.0 and subnormals are bits like any others)."""
    gen = torch.Generator().manual_seed(2)
    t = (torch.randn(2 * BLOCK_LIMBS + 5, generator=gen) * 4).to(dtype)
    for offset in (0, 17, BLOCK_LIMBS - 1):
        fp = linear_fingerprint(t, offset)
        index = torch.randperm(t.numel(), generator=gen)[:50].sort().values
        new = t.clone()
        new[index] = (torch.randn(50, generator=gen) * 4).to(dtype)
        if dtype.is_floating_point:
            new[index[:3]] = torch.tensor([float("nan"), -0.0, 1e-40]).to(dtype)
        assert linear_update(fp, index, t[index], new[index], offset) == linear_fingerprint(new, offset)
    assert linear_update(fp, index[:0], t[:0], t[:0]) == fp


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int8])
def test_no_structured_edit_keeps_the_fingerprint(dtype: torch.dtype) -> None:
    """Sign flips at every parity, powers of two, swapped rows and columns, permutations: none leaves the
    fingerprint, nor do two sign-flip edits composed (a weighted sum with fixed weights misses such pairs)."""
    assert not missed_structured_edits(linear_fingerprint, dtype), dtype


def test_the_same_edit_in_every_block_and_a_range_shifted_are_seen() -> None:
    """The same sign flip at the same position of every block (``A`` repeats per block; ``C`` tells blocks apart),
    and one range's values read at another offset."""
    w = torch.randn(4 * BLOCK_LIMBS + 3)
    e = w.clone()
    e.view(torch.int16)[1::BLOCK_LIMBS] ^= -(2**15)
    assert linear_fingerprint(e) != linear_fingerprint(w)
    assert linear_fingerprint(w[:100], 0) != linear_fingerprint(w[:100], 1)
    assert linear_fingerprint(torch.zeros(5)) != 0  # zeros count: no limb lifts to 0


@pytest.mark.parametrize("p", [257, 263])
def test_the_bound_holds_for_fixed_pairs_of_inputs_on_a_small_prime(p: int) -> None:
    """The bound, ``2 / P`` for any fixed pair of distinct inputs over the key, is too small to count at
    ``P = 2**61 - 1``; the same construction (inner tables per block, outer per block index, uniform keys) is
    checked over a prime near ``2**8`` with byte limbs, where collisions are frequent enough to count: structured
    pairs (a sign bit, two that cancel in a fixed weighted sum, swapped limbs, the same change in two blocks, a
    limb doubled) and a random one, over 20000 keys."""
    block, blocks = 8, 4
    gen = torch.Generator().manual_seed(p)
    x = torch.randint(0, 256, (blocks, block), generator=gen, dtype=torch.int64)
    pairs: dict[str, torch.Tensor] = {}
    y = x.clone()
    y[1, 3] ^= 0x80
    pairs["one sign bit"] = y
    y = x.clone()
    y[1, 3] ^= 0x80
    y[1, 5] ^= 0x80
    pairs["two sign bits"] = y
    y = x.clone()
    y[0, 2], y[2, 6] = int(x[2, 6]), int(x[0, 2])
    pairs["two limbs swapped"] = y if not torch.equal(y, x) else y.roll(1)
    y = x.clone()
    y[:, 4] ^= 0x80
    pairs["the same change in every block"] = y
    y = x.clone()
    y[3, 1] = (y[3, 1] * 2) % 256
    pairs["one limb doubled"] = y if not torch.equal(y, x) else y.roll(1)
    pairs["random"] = torch.randint(0, 256, (blocks, block), generator=gen, dtype=torch.int64)
    keys = 20000
    a = torch.randint(0, p, (keys, 1, block), generator=gen, dtype=torch.int64)
    c = torch.randint(0, p, (keys, blocks), generator=gen, dtype=torch.int64)

    def form(v: torch.Tensor) -> torch.Tensor:
        inner = ((v + 1) * a).sum(-1) % p  # [keys, blocks]
        return (inner * c).sum(-1) % p

    bound = 2 / p
    for name, y in pairs.items():
        assert not torch.equal(x, y), name
        rate = (form(x) == form(y)).double().mean().item()
        # 20000 keys at a rate near 2/p: a standard deviation of about 0.1 * bound.
        assert rate <= bound * 1.4, (name, rate, bound)


def test_the_same_in_every_process_and_pinned() -> None:
    """An engine's fingerprints are compared with a trainer's: nothing may depend on the process or torch's random
    stream, and the value of a fixed tensor is pinned (a change of the key or the form changes it)."""
    program = (
        "import torch; torch.manual_seed(123); from lora_stream.linear_fingerprint import linear_fingerprint; "
        "print(linear_fingerprint(torch.arange(3000.0), 7))"
    )
    other = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120, check=True)
    value = linear_fingerprint(torch.arange(3000.0), 7)
    assert int(other.stdout) == value == _reference(torch.arange(3000.0), 7)
    assert value == PINNED


#: linear_fingerprint(torch.arange(3000.0), 7) with this release's key.
PINNED = 2131201146128251229


def test_what_it_cannot_read_is_refused() -> None:
    with pytest.raises(ValueError, match="plain strided"):
        linear_fingerprint(torch.empty(3, device="meta"))
    with pytest.raises(ValueError, match="starts at element"):
        linear_fingerprint(torch.zeros(3), -1)
    with pytest.raises(ValueError, match="one old and one new"):
        linear_update(0, torch.tensor([0]), torch.zeros(1), torch.zeros(2))
