"""Merge temporaries stay bounded by the merge block, whatever the weight's size (tracked allocation by allocation)."""

from __future__ import annotations

import weakref

import pytest
import torch
from helpers import assert_matches, lora, oracle
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from lora_stream import ParamStream


class AllocationTracker(TorchDispatchMode):
    """Counts every tensor an op allocates (not views, not in-place results) while it is alive; keeps the peak."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self.largest = 0

    def _free(self, n: int) -> None:
        self.live -= n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        inputs = {
            a.untyped_storage().data_ptr() for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)
        }
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t._is_view():
                continue
            storage = t.untyped_storage()
            if storage.data_ptr() in inputs or storage.nbytes() == 0:
                continue
            n = storage.nbytes()
            self.live += n
            self.largest = max(self.largest, n)
            self.peak = max(self.peak, self.live)
            weakref.finalize(t, self._free, n)
        return out


class Tall(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(1024, 4096)  # 16 MiB in float32: 64x the merge block below
        self.emb = nn.Embedding(4096, 512)


@pytest.mark.parametrize("use_dora", [False, True])
def test_merge_temporaries_stay_under_the_block_bound(use_dora: bool) -> None:
    torch.manual_seed(0)
    pm = lora(Tall(), target_modules=["proj", "emb"], r=8, use_dora=use_dora)
    block = 256 * 1024
    weight_bytes = 4096 * 1024 * 4
    stream = ParamStream(pm, merge_block_bytes=block, group_by="module")
    with AllocationTracker() as tracker:
        for _name, tensor in stream:
            del tensor  # a consumer that copies and lets go
    # Alive at once: one output tensor plus the merge's temporaries. The temporaries are a few blocks and the float32
    # copies of the (rank-8) factors; a full float32 copy of the weight (what peft's get_delta_weight makes) would
    # add 16 MiB and fail this.
    temp_bound = stream.last_stats.peak_temp_bytes
    assert temp_bound <= (4 if use_dora else 2) * block + 8 * (4096 + 1024) * 4 * 2
    assert tracker.peak <= weight_bytes + temp_bound + 64 * 1024, (tracker.peak, temp_bound)
    assert tracker.peak < weight_bytes + weight_bytes // 4
    assert stream.last_stats.workspace_bytes <= (3 if use_dora else 1) * block
    # ... and the values are still peft's merge.
    assert_matches(stream, oracle(pm))


def test_reused_outputs_allocate_once_per_shape() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(6)])
    pm = lora(model, target_modules=[str(i) for i in range(6)], r=4)
    ref = oracle(pm)
    fresh, reused = AllocationTracker(), AllocationTracker()
    with fresh:
        got_fresh = [(n, t.clone()) for n, t in ParamStream(pm, group_by="module")]
    with reused:
        got_reused = [(n, t.clone()) for n, t in ParamStream(pm, group_by="module", reuse_outputs=True)]
    assert_matches(got_fresh, ref)
    assert_matches(got_reused, ref)
    stream = ParamStream(pm, group_by="module", reuse_outputs=True)
    ptrs = {t.data_ptr() for n, t in stream if n.endswith("weight")}
    assert len(ptrs) <= 2  # outputs of group g are handed out again in group g + 1


class FakeLibc:
    def __init__(self) -> None:
        self.trims = 0

    def malloc_trim(self, pad: int) -> int:
        self.trims += 1
        return 1


def test_the_heap_is_trimmed_only_once_the_pass_has_grown_past_its_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    from lora_stream import buffers

    libc, rss = FakeLibc(), [1000]
    monkeypatch.setattr(buffers, "_LIBC", libc)
    monkeypatch.setattr(buffers, "_resident_bytes", lambda: rss[0])
    trimmer = buffers.HeapTrimmer(bound_bytes=500, every_bytes=1)
    for grown in (0, 200, 500):  # up to and including the bound: a trim would only cost page faults later
        rss[0] = 1000 + grown
        trimmer.after_group(released_bytes=10**9)
    assert libc.trims == 0
    rss[0] = 1501
    trimmer.after_group(released_bytes=0)
    assert libc.trims == trimmer.trims == 1


def test_where_the_resident_set_cannot_be_read_the_heap_is_trimmed_per_released_bytes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from lora_stream import buffers

    libc = FakeLibc()
    monkeypatch.setattr(buffers, "_LIBC", libc)
    monkeypatch.setattr(buffers, "_resident_bytes", lambda: None)
    trimmer = buffers.HeapTrimmer(bound_bytes=0, every_bytes=100)
    trimmer.after_group(60)
    assert libc.trims == 0
    trimmer.after_group(60)
    assert libc.trims == 1
    trimmer.after_group(60)
    assert libc.trims == 1


@pytest.mark.parametrize("release_memory", [True, False])
def test_a_pass_trims_when_it_grows_past_its_largest_groups_and_not_otherwise(
    monkeypatch: pytest.MonkeyPatch, release_memory: bool
) -> None:
    from lora_stream import buffers

    torch.manual_seed(0)
    pm = lora(nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)]), target_modules=[str(i) for i in range(4)], r=4)
    stream = ParamStream(pm, group_by="module", release_memory=release_memory)
    largest = max(stream.group_gathered_bytes)
    libc, rss = FakeLibc(), [10**9]
    monkeypatch.setattr(buffers, "_LIBC", libc)
    monkeypatch.setattr(buffers, "_resident_bytes", lambda: rss[0])
    got = [(n, t.clone()) for n, t in stream]  # the resident set never moves: nothing to give back
    assert libc.trims == stream.last_stats.heap_trims == 0
    assert_matches(got, oracle(pm))

    def growing() -> int:
        rss[0] += 2 * largest  # every group leaves twice the largest group behind
        return rss[0]

    monkeypatch.setattr(buffers, "_resident_bytes", growing)
    assert_matches([(n, t.clone()) for n, t in stream], oracle(pm))
    assert libc.trims == stream.last_stats.heap_trims == (len(stream.groups()) if release_memory else 0)
