"""Element syncs in one process, without an engine: the encodings, the trainer's diff and baseline, and the engine's
copy (rebuild, proof, rollback). The routes run them against real engines in test_vllm_colocated.py,
test_vllm_colocated_dist.py, test_vllm_server.py, test_vllm_fleet.py and test_architectures.py."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
from helpers import lora, tiny_llama

from lora_stream import ParamStream, element_diff
from lora_stream.element_codec import ENCODINGS, bits, decode, encode, encoded_size
from lora_stream.elements import ElementBaseline, check_elements_option, diff_shard, exchange, read_elements
from lora_stream.engine.elements import ElementShadow
from lora_stream.engine.reload import VLLMLoadError
from lora_stream.fingerprint import BLOCK_WORDS
from lora_stream.linear_fingerprint import linear_fingerprint

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [1, 7, 8, 9, 1000])
@pytest.mark.parametrize("fraction", [0.0, 0.01, 0.2, 0.5, 0.97, 1.0])
def test_every_encoding_carries_the_changed_elements_bit_for_bit_and_the_smallest_is_chosen(
    dtype: torch.dtype, n: int, fraction: float
) -> None:
    g = torch.Generator().manual_seed(n)
    new = torch.randn(n, generator=g).to(dtype)
    # Values whose bits must travel as they are: NaN, -0.0, a subnormal, infinity.
    special = torch.tensor([float("nan"), -0.0, torch.finfo(dtype).tiny / 2, float("inf")], dtype=dtype)
    new[: min(n, 4)] = special[: min(n, 4)]
    k = round(n * fraction)
    index = torch.randperm(n, generator=g)[:k].sort().values
    e = encode(new, index)
    s = new.element_size()
    sizes = {enc: encoded_size(enc, k, n, s) for enc in ENCODINGS}
    assert e.blob.numel() == sizes[e.encoding] == min(sizes.values())
    got_index, values = decode(e.encoding, e.blob, e.count, e.numel, e.dtype)
    if got_index is None:
        assert e.encoding == "dense" and torch.equal(bits(values), bits(new))
    else:
        assert torch.equal(got_index, index) and torch.equal(bits(values), bits(new[index]))


def test_a_blob_that_is_not_what_its_descriptor_says_is_refused_never_guessed() -> None:
    new = torch.arange(64, dtype=torch.float32)
    e = encode(new, torch.tensor([3, 9]))
    with pytest.raises(ValueError, match="bytes"):
        decode(e.encoding, e.blob[:-1], e.count, e.numel, e.dtype)
    with pytest.raises(ValueError, match="bytes"):
        decode(e.encoding, e.blob, e.count + 1, e.numel, e.dtype)
    backwards = torch.cat([torch.tensor([9, 3], dtype=torch.int32).view(torch.uint8), e.blob[8:]])
    with pytest.raises(ValueError, match="ascending"):
        decode("indices", backwards, 2, 64, torch.float32)
    mask = encode(torch.arange(12, dtype=torch.float32), torch.arange(0, 12, 2))
    assert mask.encoding == "bitmask"
    past = mask.blob.clone()
    past[1] |= 0x80  # bit 15: element 15 of a tensor of 12
    with pytest.raises(ValueError, match=r"past the tensor's end|names"):
        decode("bitmask", past, mask.count, 12, torch.float32)
    with pytest.raises(ValueError, match="uint8"):
        decode("dense", new, 64, 64, torch.float32)


def _full_ft(seed: int = 0) -> torch.nn.Module:
    model = tiny_llama(tie=False, seed=seed)
    for p in model.parameters():
        p.requires_grad_(True)
    return model


def test_the_diff_finds_every_structured_edit_and_only_those() -> None:
    """Bit for bit: a sign flip, a power of two, a swap, a permutation, 0.0 -> -0.0 are changes; NaN -> the same NaN
    is not; the baseline is what the engine holds only once the sync commits: a read advances it in place, and until
    the commit nothing is known."""
    model = _full_ft()
    stream = ParamStream(model, dtype=torch.bfloat16)
    baseline = ElementBaseline()
    read = read_elements(stream, baseline)
    eligible = [i for i, why in read.why.items() if why is None]
    assert len(eligible) == len(stream.steps())  # every output of a fully fine-tuned dense model
    first = read.diff
    assert all(first.changed.values())  # no baseline: every element
    baseline.stage(stream.plan_digest, first.new)
    assert baseline.shards == {}  # staged only
    baseline.commit()
    assert baseline.valid_for(stream.plan_digest) and baseline.nbytes == first.baseline_bytes
    w = dict(model.named_parameters())["model.layers.0.mlp.down_proj.weight"]
    flat = w.data.view(-1)
    with torch.no_grad():
        flat[0] = float("nan")
        flat[5] = 0.0
    baseline.stage(stream.plan_digest, read_elements(stream, baseline).diff.new)
    baseline.commit()
    with torch.no_grad():
        flat[3].neg_()
        flat[7].mul_(2.0)
        flat[10], flat[11] = flat[11].clone(), flat[10].clone()
        flat[20:23] = flat[20:23][torch.tensor([1, 2, 0])].clone()
        flat[5] = -0.0
        flat[0] = float("nan")  # the same NaN: unchanged
    names = [stream.steps()[i][0] for i in eligible]
    step = eligible[names.index("model.layers.0.mlp.down_proj.weight")]
    held = baseline.shards[step]
    cast_before = held.clone()
    diff = read_elements(stream, baseline).diff
    assert not baseline.valid_for(stream.plan_digest)  # advanced in place: nothing known until the commit
    assert diff.new[step] is held  # no second copy
    seg = diff.segments[step]
    index, _ = decode(seg.encoded.encoding, seg.encoded.blob, seg.encoded.count, seg.encoded.numel, seg.encoded.dtype)
    expected = {3, 7, 10, 11, 20, 21, 22, 5}
    same_bf16 = {i for i in expected if bits(cast_before[i : i + 1]).item() == bits(diff.new[step][i : i + 1]).item()}
    assert index is not None and set(index.tolist()) == expected - same_bf16
    assert diff.changed[step] and sum(diff.changed.values()) == 1
    baseline.forget()
    assert not baseline.valid_for(stream.plan_digest)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("n", [1, 3 * BLOCK_WORDS + 5, 9 * BLOCK_WORDS])
def test_the_diff_reads_a_shard_a_chunk_at_a_time_and_equals_the_whole_read(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, n: int
) -> None:
    """Chunks of one block (and a shard that ends inside one): the changed positions on both sides of every chunk
    boundary, the values written into the baseline in place (only those), and the fingerprint of the whole new
    shard, all as one read of the whole would give them."""
    monkeypatch.setattr(element_diff, "DIFF_CHUNK_BYTES", BLOCK_WORDS * 8)
    g = torch.Generator().manual_seed(n)
    master = torch.randn(n, generator=g)  # the trainer's float32 shard
    first, index, fp, replaced = diff_shard(master, dtype, None)
    assert replaced is None
    assert torch.equal(bits(first), bits(master.to(dtype))) and torch.equal(index, torch.arange(n))
    assert fp == linear_fingerprint(master.to(dtype))
    step = BLOCK_WORDS * 8 // first.element_size()
    edges = sorted({i for b in range(step, n, step) for i in (b - 1, b)} | {0, n - 1})
    master[edges] = -master[edges]
    master[min(5, n - 1)] *= 2.0
    old = first.clone()
    new, index, fp, replaced = diff_shard(master, dtype, first)
    cast = master.to(dtype)
    assert new is first and torch.equal(bits(new), bits(cast)) and fp == linear_fingerprint(cast)
    assert torch.equal(index, (bits(cast) != bits(old)).nonzero().reshape(-1))
    assert replaced is not None and torch.equal(bits(replaced), bits(old[index]))  # what a restore writes back
    assert set(edges) <= set(index.tolist())
    # A baseline of another size or dtype is not compared: every element, into a new tensor.
    other, index, _, _ = diff_shard(master, dtype, first[:-1] if n > 1 else first.to(torch.float64))
    assert other is not first and index.numel() == n


def test_a_read_that_fails_part_way_or_a_sync_refused_in_step_1_leaves_the_baseline_as_it_was(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The read writes the baseline's shards in place. A read that stops half way, in a shard or between two, and a
    sync that fails anywhere in step 1 (no engine touched yet: ``restored_on_failure``) put every element back, and
    the baseline counts again; a sync that fails later leaves none."""
    monkeypatch.setattr(element_diff, "DIFF_CHUNK_BYTES", BLOCK_WORDS * 8)
    model = _full_ft()
    stream = ParamStream(model, dtype=torch.bfloat16)
    baseline = ElementBaseline()
    baseline.stage(stream.plan_digest, read_elements(stream, baseline).diff.new)
    baseline.commit()
    before = {i: t.clone() for i, t in baseline.shards.items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5)  # every element changes
    calls: list[int] = []
    real = element_diff.diff_shard

    def failing(values: torch.Tensor, dtype: torch.dtype, old: torch.Tensor | None, offset: int = 0) -> Any:
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("out of memory")
        return real(values, dtype, old, offset)

    monkeypatch.setattr(element_diff, "diff_shard", failing)
    with pytest.raises(RuntimeError, match="out of memory"), baseline.restored_on_failure():
        read_elements(stream, baseline)
    assert baseline.valid_for(stream.plan_digest)
    assert all(torch.equal(bits(baseline.shards[i]), bits(t)) for i, t in before.items())
    monkeypatch.setattr(element_diff, "diff_shard", real)
    # Part way through a shard: the chunks already written are put back by the shard's own read.
    master = torch.randn(3 * BLOCK_WORDS * 4)  # three chunks of bfloat16
    shard = diff_shard(master, torch.bfloat16, None)[0]
    master.add_(0.5)
    copy = shard.clone()
    seen: list[int] = []

    class Stop(Exception):
        pass

    def partial(piece: torch.Tensor, offset: int = 0) -> int:
        seen.append(1)
        if len(seen) == 2:
            raise Stop
        return 0

    monkeypatch.setattr(element_diff, "linear_fingerprint", partial)
    with pytest.raises(Stop):
        diff_shard(master, torch.bfloat16, shard)
    assert torch.equal(bits(shard), bits(copy))
    monkeypatch.undo()
    # A whole step 1 that fails after the read (the exchange, another rank's refusal): the same.
    with pytest.raises(RuntimeError, match="refused"), baseline.restored_on_failure():
        read_elements(stream, baseline)
        assert not baseline.valid_for(stream.plan_digest)
        raise RuntimeError("refused by another rank")
    assert baseline.valid_for(stream.plan_digest)
    assert all(torch.equal(bits(baseline.shards[i]), bits(t)) for i, t in before.items())
    # Read again and failed after step 1 (the sink forgets): nothing is known.
    read_elements(stream, baseline)
    baseline.forget()
    assert not baseline.valid_for(stream.plan_digest) and all(read_elements(stream, baseline).diff.changed.values())


def test_what_cannot_go_as_elements_says_why() -> None:
    pm = lora(tiny_llama(tie=False), target_modules=["q_proj"], r=4)
    pm.base_model.model.model.norm.weight.requires_grad_(True)
    stream = ParamStream(pm)
    why = {stream.steps()[i][0]: r for i, r in read_elements(stream, ElementBaseline()).why.items()}
    assert "merged LoRA" in why["model.layers.0.self_attn.q_proj.weight"]
    assert "frozen" in why["model.layers.0.mlp.up_proj.weight"]
    assert why["model.norm.weight"] is None  # trainable and as is


def test_the_option_is_checked_at_construction() -> None:
    assert check_elements_option(True, True, "trainer") is True
    with pytest.raises(ValueError, match="skip_unchanged"):
        check_elements_option(True, False, "trainer")
    with pytest.raises(ValueError, match="merge='engine'"):
        check_elements_option(True, True, "engine")
    with pytest.raises(TypeError):
        check_elements_option("yes", True, "trainer")  # type: ignore[arg-type]


# -- the engine's copy -------------------------------------------------------------------------------------------------
def _segments(name: str, old: torch.Tensor, new: torch.Tensor, ranks: int = 2) -> tuple[torch.Tensor, dict]:  # type: ignore[type-arg]
    """What the trainer sends for one output: each rank's range, its changed elements encoded, its fingerprint."""
    from lora_stream.element_diff import Segment

    flat_old, flat_new = old.reshape(-1), new.reshape(-1)
    n = flat_new.numel()
    size = -(-n // ranks)
    segs = []
    for r in range(ranks):
        lo, hi = min(r * size, n), min((r + 1) * size, n)
        index = (bits(flat_old[lo:hi]) != bits(flat_new[lo:hi])).nonzero().reshape(-1)
        segs.append(Segment(lo, hi, encode(flat_new[lo:hi], index), linear_fingerprint(flat_new[lo:hi], lo)))
    blob = torch.cat([s.encoded.blob for s in segs])
    spec = {"shape": list(new.shape), "dtype": str(new.dtype)[6:], "segments": [s.describe() for s in segs]}
    return blob, spec


def _shadow_with(tensors: dict[str, torch.Tensor], token: str = "s1") -> ElementShadow:
    shadow = ElementShadow()
    shadow.begin({"shadow": list(tensors), "payloads": {}, "aliases": {}}, None)
    assert [n for n, _ in shadow.feed(tensors.items())] == list(tensors)
    shadow.commit(token)
    return shadow


def test_the_engine_rebuilds_each_tensor_proves_it_and_rolls_back_only_the_changed_elements() -> None:
    g = torch.Generator().manual_seed(0)
    old = {"w": torch.randn(6, 10, generator=g).bfloat16(), "e": torch.randn(50, 4, generator=g).bfloat16()}
    shadow = _shadow_with(old)
    assert shadow.token == "s1" and shadow.host_bytes == sum(t.numel() * 2 for t in old.values())
    new_w = old["w"].clone()
    new_w.view(-1)[[3, 41, 59]] = torch.tensor([1.0, -2.0, 0.5]).bfloat16()
    blob, spec = _segments("w", old["w"], new_w)
    e_blob, e_spec = _segments("e", old["e"], old["e"])  # joined: nothing changed, rebuilt from the copy
    info = {"shadow": ["w", "e"], "payloads": {"w": spec, "e": e_spec}, "aliases": {"lm": "e"}}
    shadow.begin(info, "s1")
    # A transport may deliver a batch in any order: the alias goes with its primary.
    out = dict(shadow.feed([("lm", e_blob), ("w", blob), ("e", e_blob)]))
    assert torch.equal(out["w"], new_w) and torch.equal(out["e"], old["e"]) and out["lm"] is out["e"]
    assert shadow.kept_bytes == 3 * 2  # the old values of the three changed elements
    shadow.rollback()
    assert torch.equal(shadow.tensors["w"].view(6, 10), old["w"]) and shadow.token == "s1"
    shadow.begin(info, "s1")
    list(shadow.feed([("w", blob), ("e", e_blob), ("lm", e_blob)]))
    shadow.commit("s2")
    assert shadow.token == "s2" and torch.equal(shadow.tensors["w"].view(6, 10), new_w) and shadow.kept_bytes == 0


def test_the_engine_refuses_elements_it_cannot_prove() -> None:
    g = torch.Generator().manual_seed(1)
    old = torch.randn(8, 8, generator=g)
    shadow = _shadow_with({"w": old})
    new = old.clone()
    new[0, 0] = 5.0
    blob, spec = _segments("w", old, new)
    info = {"shadow": ["w"], "payloads": {"w": spec}, "aliases": {}}
    # Computed against another sync: refused before anything is loaded.
    with pytest.raises(VLLMLoadError, match="copy of the checkpoint tensors is of sync"):
        shadow.begin(info, "s0")
    # The copy drifted (a bit flipped in it): the rebuilt tensor is not the trainer's, the proof fails it.
    shadow.tensors["w"][17] = shadow.tensors["w"][17] * 2
    drifted = shadow.tensors["w"].clone()
    shadow.begin(info, "s1")
    with pytest.raises(VLLMLoadError, match=r"'w': elements \[0, 32\) rebuilt|'w': elements \[32, 64\) rebuilt"):
        list(shadow.feed([("w", blob)]))
    shadow.rollback()
    assert torch.equal(shadow.tensors["w"], drifted)  # restored bit for bit, drift and all
    # A tensor the engine holds no copy of, sent as a few elements: refused.
    blob2, spec2 = _segments("v", old, new)
    shadow.begin({"shadow": ["w", "v"], "payloads": {"v": spec2}, "aliases": {}}, "s1")
    with pytest.raises(VLLMLoadError, match="holds no copy"):
        list(shadow.feed([("v", blob2)]))
    shadow.rollback()
    # Segments that do not cover the tensor exactly: a range left out, a payload with no segment, overlapping
    # ranges. Each would load elements nobody proved: refused before anything is written into the copy.
    first, second = spec["segments"]
    size = first["hi"] - first["lo"]
    gap = {**second, "lo": second["lo"] + 1, "hi": second["hi"] + 1}
    for segments, says in (
        ([first], "cover \\[0, 32\\) of its 64"),
        ([], "cover \\[0, 0\\) of its 64"),
        ([first, {**second, "hi": second["hi"] - 1, "numel": size - 1}], "cover \\[0, 63\\) of its 64"),
        ([first, {**gap, "hi": 64, "numel": size - 1}], "leave \\[32, 33\\) uncovered"),
        ([first, {**first, "lo": 16, "hi": 48}], "overlap"),
    ):
        bad = {"shadow": ["w"], "payloads": {"w": {**spec, "segments": segments}}, "aliases": {}}
        shadow.begin(bad, "s1")
        with pytest.raises(VLLMLoadError, match=says):
            list(shadow.feed([("w", blob)]))
        shadow.rollback()
        assert torch.equal(shadow.tensors["w"], drifted)
    # A blob cut short: refused with the reason, never read past.
    shadow.begin(info, "s1")
    with pytest.raises(VLLMLoadError, match="bytes"):
        list(shadow.feed([("w", blob[:-1])]))
    shadow.rollback()
    # A sync without element info (a sink that sends none) drops the copy at its commit.
    shadow.begin(None, None)
    shadow.commit("s3")
    assert shadow.tensors == {} and shadow.token is None


def test_between_full_reads_the_engines_proof_costs_the_change_and_a_full_read_comes_within_the_bound() -> None:
    """The engine reads a whole tensor to prove it at its first element sync and at least every FULL_READ_EVERY-th
    after; in between, its copy's fingerprint moved by the changed elements stands in for the read. A copy that
    drifted where a sync changes elements fails that sync; one that drifted elsewhere fails the next full read,
    within the bound, and every failure leaves the copy as it was."""
    from lora_stream.engine.elements import FULL_READ_EVERY

    g = torch.Generator().manual_seed(5)
    cur = torch.randn(40, 30, generator=g).bfloat16()
    shadow = _shadow_with({"w": cur})
    token = 1

    def sync(change: list[int], served: bool = True) -> float:
        nonlocal cur, token
        new = cur.clone()
        new.view(-1)[change] = torch.randn(len(change), generator=g).bfloat16()
        blob, spec = _segments("w", cur, new)
        shadow.begin({"shadow": ["w"], "payloads": {"w": spec}, "aliases": {}}, f"s{token}")
        list(shadow.feed([("w", blob)]))
        read = shadow.stats["read"]
        shadow.commit(f"s{token + 1}")
        cur, token = new, token + 1
        assert torch.equal(shadow.tensors["w"].view(40, 30), new) == served
        return read

    reads = [sync([3, 77, 1000 + i]) for i in range(2 * FULL_READ_EVERY + 1)]
    full = [i for i, r in enumerate(reads) if r]
    assert full[0] == 0 and all(r in (0.0, 1200.0) for r in reads)
    assert all(b - a <= FULL_READ_EVERY for a, b in itertools.pairwise([*full, len(reads)]))
    assert len(full) < len(reads) // 2  # most syncs proven in O(changed)
    # Drift where the next sync changes elements: the moved fingerprint fails it at once.
    while shadow.fps["w"][1] + 2 >= FULL_READ_EVERY:
        sync([5])
    shadow.tensors["w"][9] = -shadow.tensors["w"][9] - 1
    drifted = shadow.tensors["w"].clone()
    with pytest.raises(VLLMLoadError, match="'w': the elements rebuilt from this engine's copy differ"):
        sync([9, 10])
    shadow.rollback()
    assert torch.equal(shadow.tensors["w"], drifted)
    # Drift where no sync writes: not seen by an update, seen by the next full read, within the bound.
    shadow.tensors["w"][9] = cur.view(-1)[9]
    shadow.tensors["w"][500] = -shadow.tensors["w"][500] - 1
    failed_at = None
    for n in range(FULL_READ_EVERY + 1):
        try:
            sync([7], served=False)
        except VLLMLoadError as exc:
            assert "elements [" in str(exc)  # a full read names the range
            failed_at = n
            break
    assert failed_at is not None and failed_at < FULL_READ_EVERY, "a drift outside the changes outlived the bound"


def test_a_sync_left_open_is_rolled_back_when_the_next_begins_and_a_late_commit_changes_nothing() -> None:
    old = torch.zeros(16)
    shadow = _shadow_with({"w": old})
    new = old.clone()
    new[2] = 1.0
    blob, spec = _segments("w", old, new)
    info = {"shadow": ["w"], "payloads": {"w": spec}, "aliases": {}}
    shadow.begin(info, "s1")
    list(shadow.feed([("w", blob)]))
    shadow.begin({"shadow": ["w"], "payloads": {}, "aliases": {}}, None)  # the trainer vanished; a new sync
    assert torch.equal(shadow.tensors["w"], old)
    shadow.rollback()
    shadow.commit("late")  # nothing open: a no-op
    assert shadow.token == "s1"


def test_one_process_exchange_is_this_ranks_own() -> None:
    from lora_stream.element_diff import Segment

    t = torch.arange(8, dtype=torch.float32)
    seg = Segment(0, 8, encode(t, torch.tensor([1])), linear_fingerprint(t))
    assert exchange(None, False, {4: seg, 5: seg}, [5]) == {5: [seg]}


def test_the_figures_reach_the_line_the_record_and_a_trainers_metrics() -> None:
    """An element sync's figures in its one line, its metrics and TRL's logged metrics (as TRL appends its own); a
    sink without elements adds no element metrics. Credentials in a reason are redacted, as in every record."""
    from collections import defaultdict
    from types import SimpleNamespace

    from lora_stream.integrations.trl.hook import _add_to_trainer_metrics
    from lora_stream.sinks.record import ELEMENT_METRICS, METRICS, SyncRecord

    figures = {
        "tensors": 16,
        "changed": 3_800,
        "elements": 100_000,
        "bytes": 22_800,
        "whole_bytes": 200_000,
        "encodings": {"indices": 15, "bitmask": 1},
        "baseline_bytes": 2**20,
        "refused": None,
        "whole_because": {"frozen (skipped whole when unchanged)": 5},
    }
    record = SyncRecord("vllm-server/gloo", 16, 22_800, 4, 0.5, 10_000, 0, version="step-7", elements=figures)
    assert record.element_fraction == pytest.approx(0.038)
    line = record.summary()
    assert "elements: 16 tensors, 3.80% changed" in line and "(bitmask 1, indices 15), baseline 1.0 MiB" in line
    metrics = record.metrics()
    assert set(metrics) == {f"lora_stream/{m}" for m in METRICS + ELEMENT_METRICS}
    assert metrics["lora_stream/element_fraction"] == pytest.approx(0.038)
    assert metrics["lora_stream/baseline_mib"] == 1.0
    trainer = SimpleNamespace(_metrics={"train": defaultdict(list)}, model=SimpleNamespace(training=True))
    _add_to_trainer_metrics(trainer, record)
    assert trainer._metrics["train"]["lora_stream/element_mib"] == [22_800 / 2**20]
    refused = SyncRecord("x", 1, 1, 1, 0.1, 1, 1, elements={"tensors": 0, "refused": "http://u:secret@h down"})
    assert "no elements: " in refused.summary() and "secret" not in refused.summary()
    assert set(SyncRecord("x", 1, 1, 1, 0.1, 1, 1).metrics()) == {f"lora_stream/{m}" for m in METRICS}


def test_a_cast_between_the_dtypes_sent_and_served_is_named_and_only_then() -> None:
    """The line names a floating dtype sent that the engine does not serve, and what it costs an element sync."""
    from types import SimpleNamespace

    from lora_stream.sinks.conclude import cast_note
    from lora_stream.stream_pass import ParamMeta

    def decision(*dtypes: torch.dtype, elements: bool = False) -> Any:
        meta = [ParamMeta(f"w{i}", d, (2,)) for i, d in enumerate(dtypes)]
        stream = SimpleNamespace(metadata=lambda: meta)
        return SimpleNamespace(source=SimpleNamespace(stream=stream), element_diff=object() if elements else None)

    note = cast_note(decision(torch.float32, torch.int64), torch.bfloat16)
    assert note == "sent float32 into an engine that serves bfloat16, which casts each tensor as it loads it"
    note = cast_note(decision(torch.float32, torch.bfloat16, elements=True), torch.bfloat16)
    assert note is not None and "elements compare the float32 values" in note, note
    assert cast_note(decision(torch.bfloat16, torch.int64), torch.bfloat16) is None
    narrower = cast_note(decision(torch.bfloat16, elements=True), torch.float32)
    assert narrower == "sent bfloat16 into an engine that serves float32: it serves the values sent, widened exactly"
    assert cast_note(decision(torch.float32), None) is None  # the served dtype unknown: nothing said


# ---- a server's element sync, received ahead of its pause (engine/receiver.py, sinks/server_staging.py) ----------
def test_a_staged_update_is_loaded_only_by_the_pass_that_staged_it_and_once() -> None:
    """The update that loads what the workers staged must carry the staging pass's id and name the same tensors;
    anything else is refused before a byte is written, and the staged tensors are taken once."""
    import dataclasses

    from lora_stream.engine.receiver import WorkerTransferEngine, _Staged, _staging_key
    from lora_stream.transfer.protocol import TransferUpdateInfo

    staging = TransferUpdateInfo(["w"], ["float32"], [[4]], [1], [1], stage=True, stage_id="a1")
    worker = object.__new__(WorkerTransferEngine)
    worker._timeout_s = 1.0
    cases = {
        "the same pass": (dataclasses.replace(staging, stage=False, staged=True), True),
        "another pass's id": (dataclasses.replace(staging, stage=False, staged=True, stage_id="b2"), False),
        "other shapes": (dataclasses.replace(staging, stage=False, staged=True, shapes=[[5]]), False),
    }
    for case, (loading, ok) in cases.items():
        worker._staged = _Staged(_staging_key(staging))
        if ok:
            assert worker._take_staged(loading).key == _staging_key(staging), case
        else:
            with pytest.raises(ValueError, match="other tensors than the ones staged"):
                worker._take_staged(loading)
        assert worker._staged is None, case  # taken once, whatever the outcome
    with pytest.raises(RuntimeError, match="no update was staged"):
        worker._take_staged(cases["the same pass"][0])


def test_the_trainer_never_loads_or_awaits_an_update_it_did_not_stage() -> None:
    """``load_staged`` after a pass that loaded as it sent would load nothing, and the sink would commit a server
    that holds the old weights under the new version: refused, as is waiting for it."""
    from lora_stream.transfer.sender import TrainerTransferEngine

    engine = object.__new__(TrainerTransferEngine)
    engine.is_sender = True
    for last in (None, {"names": ["w"], "stage": False, "stage_id": ""}):
        engine.last_update = last
        with pytest.raises(RuntimeError, match="no staged update"):
            engine.load_staged()
        with pytest.raises(RuntimeError, match="no staged update"):
            engine.await_staged(1.0)


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
@pytest.mark.parametrize("pause", ["wait", None])
def test_an_element_sync_is_staged_only_over_gloo_into_servers_it_pauses(backend: str, pause: str | None) -> None:
    """Over NCCL the workers would receive on a second thread beside the model's own collectives (which can
    deadlock): the pause covers the transfer. A sink that does not pause has nothing to shorten. A sync with no
    changed elements carries the model: it pauses first."""
    from types import SimpleNamespace

    from lora_stream.sinks.server_staging import StagedTransfer

    route = object.__new__(StagedTransfer)
    route.sink = SimpleNamespace(backend=backend, pause=pause)  # type: ignore[assignment]
    for elements in ({"w": object()}, {}):
        decision: Any = SimpleNamespace(changes=SimpleNamespace(elements=elements))
        assert route._stages(decision) == (backend == "gloo" and pause is not None and bool(elements))
    assert route._stages(SimpleNamespace(changes=None)) is False  # type: ignore[arg-type]


def test_a_staged_step_says_whether_the_servers_update_session_is_still_open() -> None:
    """What the abort sends after a failed staged step depends on it: an error the server answered (its workers
    raised) ended vLLM's session there; a wait that ran out, or a call never made, left it open, and the abort must
    roll it back and end it, or the server stays held until its lease ends."""
    import concurrent.futures
    from types import SimpleNamespace

    from lora_stream.errors import TransferError
    from lora_stream.sinks.server_client import LeaseExpiredError, ServerError
    from lora_stream.sinks.server_staging import StagedTransfer

    answered = ServerError("vLLM server at http://h:1 answered 500 on POST /update_weights: staged update failed")
    answered.answered = True
    cases: dict[str, tuple[BaseException, bool, type[BaseException]]] = {
        "the workers did not say so in time": (TimeoutError("not within 3 s"), True, TransferError),
        "no time left to ask": (ServerError("no time left for POST /update_weights"), True, TransferError),
        "the workers raised": (answered, False, TransferError),
        "its lease healed it": (LeaseExpiredError("expired"), False, LeaseExpiredError),
    }
    route = object.__new__(StagedTransfer)
    for case, (raised, still_open, surfaced) in cases.items():

        def fail(*_: Any, raised: BaseException = raised) -> None:
            raise raised

        engine = SimpleNamespace(await_staged=fail, load_staged=fail, pending=None)
        client = SimpleNamespace(remaining=lambda: 3.0, spend=lambda s: None)
        replica: Any = SimpleNamespace(engine=engine, client=client, state=SimpleNamespace(written=False))
        for step in ("await_staged", "load_staged"):
            with pytest.raises(surfaced):
                route._staged(replica, step)
            pending: concurrent.futures.Future[Any] = engine.pending
            assert pending.done() and (pending.exception() is None) == still_open, (case, step)
        assert replica.state.written is True  # the load was asked for: the workers may have written
