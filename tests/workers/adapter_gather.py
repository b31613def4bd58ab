"""Rank worker: a group's small parameters (an adapter's LoRA factors) are all-gathered in one collective.

Usage: adapter_gather.py zero3|fsdp2

On every rank: the same perturbed peft models (every LoRA tensor moved off peft's initialisation, ``lora_B`` included),
an unsharded copy kept as the reference, then the model sharded (a DeepSpeed ZeRO-3 engine, or ``fully_shard``).

* ``AdapterStream`` by default (one group) and with a small budget (several groups): exactly one
  ``all_gather_into_tensor`` per group, counted by wrapping ``torch.distributed``; every tensor equal, bit for bit, to
  the unsharded model's adapter stream, to the per-parameter collectives (``coalesce_bytes=0``: one all-gather per
  factor, counted too) and to the fallback (``direct=False``: ``GatheredParameters`` / ``full_tensor()``).
* factors of two dtypes in one group (bf16 pieces of 2 mod 4 bytes a rank next to float32 ones), and shards of
  uneven length (r=3 under FSDP2): the same.
* the merged stream (``ParamStream``): one all-gather per group for its small parameters plus one per parameter
  above ``coalesce_bytes``, equal bit for bit to the per-parameter path.

Prints ``RESULT {json}`` lines: one ``adapter-gather`` record per model and one ``merged-gather``.
"""

from __future__ import annotations

import copy
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from helpers import finish, lora, perturb_adapters, report, tiny_llama, zero3_engine

from lora_stream import AdapterStream, Fsdp2Gatherer, ParamStream, ZeroThreeGatherer


@contextmanager
def counting() -> Iterator[dict[str, int]]:
    """Counts the calls of the collectives a gatherer or the stream issues, by name, while active."""
    names = ("all_gather_into_tensor", "all_gather", "all_reduce", "broadcast")
    counts = dict.fromkeys(names, 0)
    saved = {n: getattr(dist, n) for n in names}

    def wrap(name: str) -> Any:
        fn = saved[name]

        def counted(*a: Any, **k: Any) -> Any:
            counts[name] += 1
            return fn(*a, **k)

        return counted

    for n in names:
        setattr(dist, n, wrap(n))
    try:
        yield counts
    finally:
        for n, fn in saved.items():
            setattr(dist, n, fn)


def models() -> list[tuple[str, torch.nn.Module]]:
    plain = lora(tiny_llama(layers=3), target_modules="all-linear", r=4)
    uneven = lora(tiny_llama(layers=2, seed=1), target_modules="all-linear", r=3)
    # hidden 66, 3 heads of 22, one KV head: k_proj's and v_proj's lora_B are [22, 3], 11 rows a rank under FSDP2.
    mixed = lora(tiny_llama(layers=2, seed=2, hidden=66, heads=3, inter=98), target_modules="all-linear", r=3)
    out = [("lora-r4", plain), ("lora-r3-uneven", uneven), ("lora-bf16-f32", mixed)]
    for _, m in out:
        perturb_adapters(m)
        # peft initialises lora_B to zero: every one must have moved.
        assert all(float(p.detach().abs().min()) > 0 for n, p in m.named_parameters() if "lora_B" in n)
    # Half the LoRA modules in bf16 (frozen: DeepSpeed's optimizer takes one dtype): a group's flat buffer then holds
    # factors of two dtypes, bf16 pieces of 2 mod 4 bytes a rank among float32 ones.
    for i, (_, module) in enumerate((n, m) for n, m in mixed.named_modules() if n.endswith(("lora_A", "lora_B"))):
        if (i // 2) % 2:
            module.to(torch.bfloat16).requires_grad_(False)
    assert {p.dtype for n, p in mixed.named_parameters() if "lora_" in n} == {torch.float32, torch.bfloat16}
    return out


def shard(model: torch.nn.Module, how: str) -> torch.nn.Module:
    if how == "zero3":
        return zero3_engine(model)  # type: ignore[no-any-return]
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.base_model.model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def gatherer(how: str, model: torch.nn.Module, **kw: Any) -> Any:
    return ZeroThreeGatherer(model, **kw) if how == "zero3" else Fsdp2Gatherer(model, **kw)


def one_pass(stream: ParamStream) -> tuple[list[tuple[str, torch.Tensor]], list[int]]:
    """Every ``(name, tensor)`` of one pass (cloned) and the all-gathers each group issued."""
    got: list[tuple[str, torch.Tensor]] = []
    per_group: list[int] = []
    with counting() as calls, stream.iter_groups() as groups:
        before = 0
        for names, tensors in groups:
            per_group.append(calls["all_gather_into_tensor"] - before)
            got += [(n, t.clone()) for n, t in zip(names, tensors)]
            before = calls["all_gather_into_tensor"]
    return got, per_group


def assert_equal(got: list[tuple[str, torch.Tensor]], want: list[tuple[str, torch.Tensor]], label: str) -> None:
    assert [n for n, _ in got] == [n for n, _ in want], label
    for (n, a), (_, b) in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), f"{label}: {n} differs"


def check_adapter(how: str, label: str, model: torch.nn.Module) -> None:
    want = [(n, t.clone()) for n, t in AdapterStream(copy.deepcopy(model))]  # unsharded, plain gatherer
    sharded = shard(model, how)
    factors = len(want)
    start = time.perf_counter()
    stream = AdapterStream(sharded, gatherer=gatherer(how, sharded))
    assert len(stream.groups()) == 1, stream.groups()  # the default budget holds the whole adapter
    got, per_group = one_pass(stream)
    assert per_group == [1], per_group  # one all-gather for every factor of the group
    assert_equal(got, want, f"{label} default")
    assert stream.last_stats.gather_paths == {"direct": factors, "fallback": 0}, stream.last_stats.gather_paths
    # Several groups: still one all-gather each.
    budget = max(stream.group_gathered_bytes) // 3
    small = AdapterStream(sharded, gatherer=gatherer(how, sharded), budget_bytes=budget)
    assert len(small.groups()) >= 3, small.groups()
    got, per_group_small = one_pass(small)
    assert per_group_small == [1] * len(small.groups()), per_group_small
    assert_equal(got, want, f"{label} budget")
    # The per-parameter collectives (the previous behaviour) and the fallback give the same bytes.
    per_param = AdapterStream(sharded, gatherer=gatherer(how, sharded, coalesce_bytes=0))
    got, per_group_param = one_pass(per_param)
    assert per_group_param == [factors], per_group_param
    assert_equal(got, want, f"{label} per-parameter")
    got, _ = one_pass(AdapterStream(sharded, gatherer=gatherer(how, sharded, direct=False)))
    assert_equal(got, want, f"{label} fallback")
    kept_passes = check_kept(how, label, sharded, want)
    if how == "zero3":
        check_agreement_in_lockstep(label, sharded, want)
    world = dist.get_world_size()
    if how == "zero3":
        piece_bytes = [p.ds_tensor.ds_numel * p.element_size() for p in stream._groups[0].params]
    else:
        piece_bytes = [
            -(-p.shape[0] // world) * (p.numel() // p.shape[0]) * p.element_size() for p in stream._groups[0].params
        ]
    report(
        rank=dist.get_rank(),
        event="adapter-gather",
        piece_bytes_mod_4=sorted({n % 4 for n in piece_bytes}),
        model=label,
        factors=factors,
        all_gathers=per_group,
        all_gathers_budget=per_group_small,
        all_gathers_per_parameter=per_group_param,
        kept_passes=kept_passes,
        seconds=time.perf_counter() - start,
    )


def shards(how: str, model: torch.nn.Module) -> list[torch.Tensor]:
    """This rank's shards of the LoRA factors (ZeRO-3 partitions or FSDP2 local shards), to change in place."""
    lora_params = [p for n, p in model.named_parameters() if "lora_" in n]
    return [p.ds_tensor if how == "zero3" else p.to_local() for p in lora_params]


def check_kept(how: str, label: str, sharded: torch.nn.Module, want: list[tuple[str, torch.Tensor]]) -> int:
    """The stream's own gatherer keeps its buffers (and their layout) between passes, from its second pass on:
    every pass still equals the unsharded stream, a change of the trainer's shards in place is seen by the next
    pass, what is kept is counted by ``held_bytes()`` and the record between passes and stays under
    ``KEEP_BYTES``, and ``close()`` frees it."""
    from lora_stream.gatherers.base import KEEP_BYTES

    kept = AdapterStream(sharded)  # builds its own gatherer: keep_bytes=KEEP_BYTES
    g = kept.gatherer
    assert g.keep_bytes == KEEP_BYTES and g.held_bytes() == 0
    passes = 0
    for i in range(3):
        got, per_group = one_pass(kept)
        passes += 1
        assert per_group == [1], per_group
        assert_equal(got, want, f"{label} kept pass {i}")
        if i == 0:  # a stream used once (built per sync) frees its buffers as before
            assert g.held_bytes() == kept.last_stats.kept_bytes == 0, (g.held_bytes(), kept.last_stats)
        else:
            assert 0 < g.held_bytes() == kept.last_stats.kept_bytes <= KEEP_BYTES, (g.held_bytes(), kept.last_stats)
    # The trainer's shards change in place (an optimizer step): the kept layout reads the new bytes.
    with torch.no_grad():
        for t in shards(how, sharded):
            t.mul_(2)
    try:
        fresh, _ = one_pass(AdapterStream(sharded, gatherer=gatherer(how, sharded)))
        got, _ = one_pass(kept)
        passes += 1
        assert_equal(got, fresh, f"{label} kept after a step")
        assert any(not torch.equal(a, b) for (_, a), (_, b) in zip(got, want)), "the step changed nothing"
    finally:
        with torch.no_grad():
            for t in shards(how, sharded):
                t.div_(2)
    kept.close()
    assert g.held_bytes() == 0 and kept.last_stats.kept_bytes > 0
    assert (g._buffers == [None, None]) if how == "zero3" else (g._buffer is None)
    got, _ = one_pass(kept)  # usable again after close(): the buffer is allocated anew
    passes += 1
    assert_equal(got, want, f"{label} kept after close")
    kept.close()
    return passes


def check_agreement_in_lockstep(label: str, sharded: torch.nn.Module, want: list[tuple[str, torch.Tensor]]) -> None:
    """ZeRO-3's path agreement rides along the stream's status exchange: a pass issues one ``all_reduce`` per group
    plus one at the end (no agreement of its own), and still agrees where the ranks differ: a factor whole
    (``AVAILABLE``) on rank 0 only is all-gathered on both ranks, and the values stay bit-equal."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    stream = AdapterStream(sharded, gatherer=gatherer("zero3", sharded), budget_bytes=1)  # one module a group
    n = len(stream.groups())
    assert n > 2, n
    with counting() as calls:
        got = [(name, t.clone()) for name, t in stream]
    assert calls["all_reduce"] == n + 1 and calls["all_gather_into_tensor"] == n, (calls, n)
    assert_equal(got, want, f"{label} agreement in lockstep")
    target = stream._groups[1].params[0]
    if dist.get_rank() == 0:
        target.ds_status = ZeroParamStatus.AVAILABLE  # rank 0 alone would skip its all-gather
    try:
        with counting() as calls:
            got = [(name, t.clone()) for name, t in stream]
    finally:
        target.ds_status = ZeroParamStatus.NOT_AVAILABLE
    assert calls["all_reduce"] == n + 1, (calls, n)
    assert_equal(got, want, f"{label} whole on rank 0 only")
    assert stream.last_stats.gather_paths == {"direct": len(want), "fallback": 0}, stream.last_stats.gather_paths


def check_merged(how: str) -> None:
    """The merged stream keeps its values; its small parameters share one all-gather per group, the large ones
    (here: above a 4 KiB threshold) keep one each."""
    model = lora(tiny_llama(layers=3, tie=True), target_modules="all-linear", r=3)
    perturb_adapters(model)
    sharded = shard(model, how)
    ref, ref_counts = one_pass(ParamStream(sharded, gatherer=gatherer(how, sharded, coalesce_bytes=0)))
    threshold = 4096
    stream = ParamStream(sharded, gatherer=gatherer(how, sharded, coalesce_bytes=threshold))
    got, per_group = one_pass(stream)
    assert_equal(got, ref, "merged")
    g = stream.gatherer
    world = dist.get_world_size()
    expected = []
    for group in stream._groups:
        params = list({id(p): p for p in group.params}.values())
        if how == "zero3":
            sizes = [p.ds_tensor.ds_numel * world * p.element_size() for p in params]
        else:
            sizes = [-(-p.shape[0] // world) * (p.numel() // p.shape[0]) * world * p.element_size() for p in params]
        large = sum(n > threshold for n in sizes)
        small = len(sizes) - large
        expected.append(large + (1 if small >= 2 else small))
    assert per_group == expected, (per_group, expected)
    assert any(n > 1 for n in expected) and sum(per_group) < sum(ref_counts), (per_group, ref_counts)
    assert g.held_bytes() == 0
    report(rank=dist.get_rank(), event="merged-gather", all_gathers=per_group, per_parameter=ref_counts)


def main() -> None:
    how = sys.argv[1]
    dist.init_process_group("gloo")
    for label, model in models():
        check_adapter(how, label, model)
    check_merged(how)
    finish()


if __name__ == "__main__":
    main()
