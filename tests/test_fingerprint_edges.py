"""The fingerprint's and the state digest's edges: every tensor is read exactly or refused with the reason, never
guessed (issue 53, "The fingerprint of an unaligned view" and "What the fingerprint and the digest must never do
silently").

* a view whose bytes start at an offset ``int64`` cannot view (not a multiple of 8) is fingerprinted by its bytes,
  to the value of its aligned copy (the trainer's shard and the engine's copy of it agree), and an in-place write
  into such a view is seen by the engine's digest;
* a quantized tensor is fingerprinted exactly (trying it used to crash the process: checked in a subprocess);
* running out of memory either gives the exact value (hashed on the host) or a reason that the digest reports, so
  the sync is full and says why -- never an identity under which a write goes unseen;
* the key does not come from torch's random stream, so a trainer and a server on different torch builds agree.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

import lora_stream.engine.state_digest as state_digest
import lora_stream.fingerprint as fp
from lora_stream.engine.state_digest import first_difference, forget, record
from lora_stream.fingerprint import BLOCK_WORDS, CHUNK_WORDS, KEY_ID, FingerprintError, fingerprint

UNALIGNED_DTYPES = [
    torch.bfloat16,
    torch.float16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.int16,
    torch.float32,
    torch.float8_e4m3fn,
]


def _random(numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, (numel,), generator=gen).bool()
    if dtype.is_floating_point:
        return (torch.randn(numel, generator=gen) * 10).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, (numel,), generator=gen, dtype=torch.int64).to(dtype)


@pytest.mark.parametrize("dtype", UNALIGNED_DTYPES, ids=str)
@pytest.mark.parametrize("numel", [1, 5, 1000, BLOCK_WORDS * 3 + 7])
def test_an_unaligned_view_fingerprints_as_its_aligned_copy(dtype: torch.dtype, numel: int) -> None:
    """Every element offset whose byte offset is not a multiple of 8 (int64 cannot view those bytes): the value of
    an aligned copy of the same bytes (what the engine received, what another rank holds), not an error."""
    size = torch.empty((), dtype=dtype).element_size()
    whole = _random(numel + 8, dtype, numel)
    for offset in range(1, 8):
        view = whole[offset : offset + numel]
        assert view.is_contiguous()
        if (offset * size) % 8 == 0:
            continue  # aligned after all (an int64 or a fourth float32 step)
        copy = view.clone()
        assert copy.storage_offset() == 0
        assert fingerprint(view) == fingerprint(copy), (dtype, numel, offset)
        # And it still sees a change of one bit of one element, through the view.
        edited = view.clone()
        edited.view(torch.uint8)[-1] ^= 1
        assert fingerprint(edited) != fingerprint(view), (dtype, numel, offset)


def test_unaligned_two_dimensional_and_transposed_views() -> None:
    base = _random(64 * 33 + 3, torch.bfloat16, 1)
    m = base[3:].view(64, 33)  # rows of 33 bf16 elements, starting 6 bytes into the storage
    assert fingerprint(m) == fingerprint(m.contiguous().clone())
    assert fingerprint(m[:, 1:]) == fingerprint(m[:, 1:].contiguous())  # every row starts unaligned
    assert fingerprint(m.t()) == fingerprint(m.t().contiguous())
    assert fingerprint(m[5]) == fingerprint(m[5].clone())  # a single row at an odd offset


def test_a_pointer_that_is_not_word_aligned() -> None:
    """A storage whose own address is odd (``frombuffer`` at an offset): the view's offset is 0, its pointer not."""
    raw = bytearray(torch.arange(4097, dtype=torch.int32).view(torch.uint8).numpy().tobytes())
    t = torch.frombuffer(raw, dtype=torch.float32, offset=4, count=4096)
    assert t.storage_offset() == 0
    assert fingerprint(t) == fingerprint(t.clone())


def test_the_copying_path_equals_the_in_place_path_across_chunks() -> None:
    """The buffered path (unaligned, non-contiguous, or on the host after an OOM) hashes the same words in the same
    blocks as the in-place one: across chunk boundaries, with a partial block and a partial last word."""
    for n in (1, 7, 8, 9, BLOCK_WORDS * 8 + 3, CHUNK_WORDS * 8, CHUNK_WORDS * 16 + BLOCK_WORDS * 8 + 5):
        buf = torch.randint(0, 256, (n + 1,), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))
        aligned = buf[:n].clone()
        expected = fp._lanes_in_place(aligned)
        assert torch.equal(fp._lanes_copied(aligned, aligned.device), expected), n
        assert fingerprint(buf[1:]) == fingerprint(buf[1:].clone()), n


def test_non_contiguous_tensors_are_read_a_slab_at_a_time() -> None:
    """Rows bigger than a chunk (read row by row), and many small rows (read in slabs): the values in order."""
    wide = torch.randn(2, CHUNK_WORDS * 3, dtype=torch.float64)[:, ::2]  # a row of 1.5 chunks, strided
    assert fingerprint(wide) == fingerprint(wide.contiguous())
    tall = torch.randn(3, CHUNK_WORDS * 3).t()
    assert fingerprint(tall) == fingerprint(tall.contiguous())
    expanded = torch.randn(7, 1).expand(7, 100_000)  # a zero stride
    assert fingerprint(expanded) == fingerprint(expanded.contiguous())


def test_an_in_place_write_into_an_unaligned_view_changes_the_engine_digest() -> None:
    """The engine's digest used to fall back to the view's identity (``int64`` could not view it), so a write into
    it went unseen and a partial sync was allowed over it."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    layer = model[0]
    storage = torch.randn(130).to(torch.bfloat16)
    layer.register_buffer("scales", storage[1:65])  # a buffer 2 bytes into its storage
    layer.packed = storage.view(torch.int8)[3:200]  # a kernel-format attribute 3 bytes in
    record(model)
    try:
        assert first_difference(model) is None
        layer.scales[10] += 1  # in place, through the view: no new tensor, the same identity
        why = first_difference(model)
        assert why is not None and "'0'" in why and "buffer 'scales' has other bytes" in why, why
        record(model)
        layer.packed[-1] ^= 1
        why = first_difference(model)
        assert why is not None and "attribute 'packed'" in why and "other bytes" in why, why
    finally:
        forget(model)


QUANTIZED = textwrap.dedent(
    """
    import warnings
    warnings.simplefilter("ignore")
    import torch
    from lora_stream.fingerprint import fingerprint
    from lora_stream.engine.state_digest import first_difference, record

    x = torch.randn(6, 10, generator=torch.Generator().manual_seed(0))
    for dtype in (torch.qint8, torch.quint8, torch.qint32, torch.quint4x2):
        q = torch.quantize_per_tensor(x, 0.05, 3, dtype)
        base = fingerprint(q)
        assert fingerprint(torch.quantize_per_tensor(x.clone(), 0.05, 3, dtype)) == base, dtype  # another copy
        assert fingerprint(torch.quantize_per_tensor(x, 0.05, 4, dtype)) != base, dtype  # zero point
        assert fingerprint(torch.quantize_per_tensor(x, 0.06, 3, dtype)) != base, dtype  # scale
        assert fingerprint(torch.quantize_per_tensor(x * 1.5, 0.05, 3, dtype)) != base, dtype  # the values
        assert fingerprint(torch.quantize_per_tensor(x.flip(0), 0.05, 3, dtype)) != base, dtype
        if dtype != torch.quint4x2:  # per channel (quint4x2 has only a float-qparams scheme on some builds)
            scales = torch.rand(6, generator=torch.Generator().manual_seed(1)) / 10 + 0.01
            zeros = torch.zeros(6, dtype=torch.long)
            c = torch.quantize_per_channel(x, scales, zeros, 0, dtype)
            assert fingerprint(c) == fingerprint(c.clone()) != fingerprint(
                torch.quantize_per_channel(x, scales * 2, zeros, 0, dtype)
            ), dtype
            assert fingerprint(c) != fingerprint(torch.quantize_per_channel(x, scales, zeros + 1, 0, dtype)), dtype
            assert fingerprint(c[1:]) == fingerprint(c[1:].clone()), dtype
        # The engine's digest of a module holding one: a write into it is seen.
        m = torch.nn.Linear(2, 2)
        m.qweight = torch.quantize_per_tensor(x, 0.05, 3, dtype)
        record(m)
        assert first_difference(m) is None, dtype
        m.qweight = torch.quantize_per_tensor(x * 2, 0.05, 3, dtype)
        assert "other bytes" in first_difference(m), dtype
    print("quantized ok")
    """
)


def test_quantized_tensors_are_fingerprinted_exactly_without_crashing() -> None:
    """``fingerprint`` of a ``torch.qint8`` tensor used to kill the process (viewing a quantized storage as bytes):
    run where a crash fails this test instead of the whole session."""
    done = subprocess.run([sys.executable, "-c", QUANTIZED], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.returncode, done.stdout[-2000:], done.stderr[-4000:])
    assert "quantized ok" in done.stdout


def test_what_has_no_bytes_is_refused_with_the_reason() -> None:
    with pytest.raises(FingerprintError, match=r"'w'.*meta tensor holds no bytes"):
        fingerprint(torch.empty(3, device="meta"), "'w'")
    sparse = torch.eye(3).to_sparse()
    with pytest.raises(FingerprintError, match="sparse_coo layout"):
        fingerprint(sparse, "module 'x' parameter 'weight'")


def _oom(*_: object, **__: object) -> torch.Tensor:
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 12.00 MiB (simulated)")


def test_out_of_memory_where_the_tensor_lives_is_hashed_exactly_on_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """The in-place read runs out of memory: the same words, hashed on the host in bounded slabs, give the same
    value (an exact fallback, not a guess)."""
    t = torch.randn(CHUNK_WORDS + 5)
    expected = fingerprint(t)
    expected_view = fingerprint(t[1:])
    calls: list[str] = []

    def first_fails(flat: torch.Tensor) -> torch.Tensor:
        calls.append("in place")
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    monkeypatch.setattr(fp, "_lanes_in_place", first_fails)
    assert fingerprint(t) == expected
    assert calls == ["in place"]
    # The unaligned path fails on the device the same way: the host retry is the copying path on the CPU.
    real = fp._lanes_copied
    devices: list[str] = []

    def copied(t: torch.Tensor, device: torch.device) -> torch.Tensor:
        devices.append(str(device))
        if len(devices) == 1:
            raise torch.OutOfMemoryError("out of memory (simulated)")
        return real(t, device)

    monkeypatch.setattr(fp, "_lanes_copied", copied)
    assert fingerprint(t[1:]) == expected_view
    assert devices == ["cpu", "cpu"]


def test_out_of_memory_everywhere_is_a_reason_not_an_identity(monkeypatch: pytest.MonkeyPatch) -> None:
    """When even the host cannot hash it, the fingerprint refuses with the reason, and the engine's digest turns
    that into a difference naming the module, the tensor and the reason (the sync is full and says why). It used to
    take the tensor's identity: recorded and checked out of memory, an in-place write went unseen. (The digest reads
    with the linear fingerprint first and falls back to NH when that fails: both run out of memory here.)"""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    try:
        monkeypatch.setattr(state_digest, "linear_fingerprint", _oom)
        monkeypatch.setattr(fp._NH, "__call__", _oom)
        record(model)  # the commit's record, out of memory
        model[1].weight.data.mul_(2)  # in place: the same tensor, so the same identity
        why = first_difference(model)  # checked out of memory too
        assert why is not None and "'0'" in why and "could not be fingerprinted" in why, why
        assert "out of memory" in why and "parameter 'weight'" in why, why
        with pytest.raises(FingerprintError, match=r"'w'.*out of memory.*and on the host"):
            fingerprint(torch.randn(100), "'w'")
        # Recorded out of memory, checked with memory to spare: still not proven (the record proves nothing).
        monkeypatch.undo()
        why = first_difference(model)
        assert why is not None and "at the last commit" in why and "could not be fingerprinted" in why, why
        # Recorded exactly, checked out of memory: not proven either, and not called a foreign write.
        record(model)
        assert first_difference(model) is None
        monkeypatch.setattr(state_digest, "linear_fingerprint", _oom)
        monkeypatch.setattr(fp._NH, "__call__", _oom)
        why = first_difference(model)
        assert why is not None and "cannot be proven" in why and "outside lora_stream" not in why, why
        # The linear read failing once (NH read the bytes instead), at the commit or at the check: the two forms
        # cannot be compared, which proves nothing and is not called a foreign write.
        for failing_at in ("record", "check"):
            monkeypatch.undo()
            if failing_at == "record":
                monkeypatch.setattr(state_digest, "linear_fingerprint", _oom)
            record(model)
            monkeypatch.undo()
            if failing_at == "check":
                monkeypatch.setattr(state_digest, "linear_fingerprint", _oom)
            why = first_difference(model)
            assert why is not None and "another fingerprint" in why and "outside lora_stream" not in why, why
    finally:
        forget(model)


def test_the_key_does_not_come_from_torchs_random_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    """A trainer and a server on different torch builds must hold the same key: it is SHAKE-256 of a fixed label,
    computed here with torch's random functions broken, and pinned to fixed values (a change to the key or the
    hash changes these, and every fingerprint a running engine recorded)."""
    expected = fingerprint(torch.arange(3000.0))

    def broken(*_: object, **__: object) -> None:
        raise AssertionError("the fingerprint key must not come from torch's random stream")

    for name in ("randint", "rand", "randn", "randperm", "manual_seed", "Generator"):
        monkeypatch.setattr(torch, name, broken)  # the old key was torch.randint from a seeded torch.Generator
    monkeypatch.setattr(fp, "_keys", {})
    assert fingerprint(torch.arange(3000.0)) == expected
    assert KEY_ID == "dede658cafb54902"
    assert fp._key(torch.device("cpu"))[0, 0, :4].tolist() == [245298726, 1406144608, 270088771, -1598334801]
    assert expected == 9203470779084950654


def test_the_key_is_the_same_whatever_the_process_drew_before() -> None:
    """Another process that seeds torch differently and draws from its random stream first gets the same key."""
    program = (
        "import torch; torch.manual_seed(12345); torch.randn(1000); "
        "from lora_stream.fingerprint import fingerprint, KEY_ID; print(KEY_ID, fingerprint(torch.arange(3000.0)))"
    )
    other = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120, check=True)
    key_id, value = other.stdout.split()[-2:]
    assert key_id == KEY_ID and int(value) == fingerprint(torch.arange(3000.0))
