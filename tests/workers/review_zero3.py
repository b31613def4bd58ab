"""Rank worker for tests/test_review_fixes.py (DeepSpeed ZeRO-3, 2 gloo ranks). Usage: review_zero3.py SCENARIO

Scenarios:
  agree   a parameter's ``ds_status`` differs between the ranks (AVAILABLE on rank 0 only; INFLIGHT on rank 1
          only): the direct path's decision is the same on both ranks, the gathered bytes equal
          GatheredParameters', a prefetching stream still equals the oracle, and deciding costs one small
          all_reduce per group; gather paths are counted in parameters.
"""

from __future__ import annotations

import copy
import sys
from typing import Any

import deepspeed
import torch
import torch.distributed as dist
from helpers import (
    assert_matches,
    finish,
    lora,
    oracle,
    perturb_adapters,
    report,
    tiny_llama,
    zero3_engine,
    zero3_whole_into,
)

from lora_stream import ParamStream, ZeroThreeGatherer

deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


class _AllReduces:
    """Counts torch.distributed.all_reduce calls while active."""

    def __enter__(self) -> _AllReduces:
        self.count = 0
        self.saved = dist.all_reduce

        def counting(*a: Any, **k: Any) -> Any:
            self.count += 1
            return self.saved(*a, **k)

        dist.all_reduce = counting  # type: ignore[assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        dist.all_reduce = self.saved  # type: ignore[assignment]


def _whole(gatherer: ZeroThreeGatherer, params: list[Any]) -> list[torch.Tensor]:
    with gatherer.gather(params) as full:
        return [full(p).clone() for p in params]


def scenario_agree() -> None:
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    rank = dist.get_rank()
    pm = lora(tiny_llama(layers=3), target_modules="all-linear")
    perturb_adapters(pm)
    template = copy.deepcopy(pm)
    engine = zero3_engine(pm)
    ref_model = zero3_whole_into(engine, template)
    stream = ParamStream(engine, group_by="module")
    groups = stream._groups
    group = groups[3]
    target = group.params[0]
    assert all(p.ds_status == ZeroParamStatus.NOT_AVAILABLE for p in group.params)
    want = _whole(ZeroThreeGatherer(engine, direct=False), group.params)

    # AVAILABLE on rank 0 only: rank 0 alone would skip its all-gather (and read an empty param.data).
    direct = ZeroThreeGatherer(engine)
    if rank == 0:
        target.ds_status = ZeroParamStatus.AVAILABLE
    try:
        with _AllReduces() as calls:
            got = _whole(direct, group.params)
        assert calls.count == 1, f"{calls.count} all_reduces for one group's decision"
        decision = direct.decide(group.params)
        assert decision.reason is None and not decision.whole, decision
    finally:
        target.ds_status = ZeroParamStatus.NOT_AVAILABLE
    for a, b in zip(got, want):
        assert a.shape == b.shape and torch.equal(a, b)
    assert direct.path_counts == {"direct": len(group.params), "fallback": 0}, direct.path_counts

    # INFLIGHT on rank 1 only: rank 1 alone would fall back to GatheredParameters while rank 0 goes direct.
    if rank == 1:
        target.ds_status = ZeroParamStatus.INFLIGHT
    try:
        decision = direct.decide(group.params)
    finally:
        target.ds_status = ZeroParamStatus.NOT_AVAILABLE
    assert decision.reason is not None, "every rank falls back when one cannot go direct"
    assert ("INFLIGHT" in decision.reason) == (rank == 1), decision.reason

    # A prefetching pass with a parameter of a later group whole on rank 0 only: still the oracle, and one
    # agreement per group (plus the stream's own status exchanges, one per group and one at the end).
    later = groups[5].params[0]
    if rank == 0:
        later.ds_status = ZeroParamStatus.AVAILABLE
    try:
        prefetching = ParamStream(engine, group_by="module", prefetch=True, layout="memory")
        with _AllReduces() as calls:
            got_all = [(n, t.clone()) for n, t in prefetching]
    finally:
        later.ds_status = ZeroParamStatus.NOT_AVAILABLE
    n = len(prefetching._groups)
    assert calls.count == 2 * n + 1, (calls.count, n)
    assert_matches(got_all, oracle(ref_model))
    params = sum(len(g.params) for g in prefetching._groups)
    assert prefetching.last_stats.gather_paths == {"direct": params, "fallback": 0}, prefetching.last_stats
    report(rank=rank, event="agreed", groups=n, params=params)


def main() -> None:
    deepspeed.init_distributed(dist_backend="gloo")
    {"agree": scenario_agree}[sys.argv[1]]()
    finish()


if __name__ == "__main__":
    main()
