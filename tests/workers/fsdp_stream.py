"""Rank worker for the FSDP tests. Usage: fsdp_stream.py SCENARIO

Scenarios:
  fsdp2       fully_shard per decoder layer and root; a LoRA model and a plain model, one training step each;
              every rank's stream == oracle; unsharded bytes bounded at every yield; metadata() communicates nothing.
  fsdp2-drift 100 streams in bf16: local shards bitwise identical afterwards.
  fsdp2-raise rank 1's consumer raises at the third group.
  fsdp2-direct the direct gather (owned buffer) against full_tensor(), bit for bit, group by group: LoRA r=3 (shards
              of different lengths on the two ranks), modules_to_save, a plain model, a bf16 model; the path counts.
  fsdp1       FullyShardedDataParallel per decoder layer, use_orig_params True and False, LoRA (peft's FSDP wrap
              policy) and plain models, after a training step: stream == oracle, bound at every yield.
  fsdp1-drift 100 streams: local flat shards bitwise identical.
  fsdp1-raise rank 1's consumer raises at the third group.
  fsdp1-noforward streaming before the first forward raises a clear error.
"""

from __future__ import annotations

import copy
import sys
import time

import torch
import torch.distributed as dist
from helpers import (
    CollectiveCounter,
    assert_direct_equals_fallback,
    assert_matches,
    finish,
    lora,
    oracle,
    report,
    report_aborted,
    stream_within_bound,
    tiny_llama,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from lora_stream import Fsdp2Gatherer, ParamStream, StreamAbortedError


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for n, m in model.named_modules() if n.endswith(tuple(f"layers.{i}" for i in range(64)))]


def shard(model: torch.nn.Module) -> torch.nn.Module:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def train_step(model: torch.nn.Module) -> None:
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(dist.get_rank()))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()


def unsharded(model: torch.nn.Module, template: torch.nn.Module) -> torch.nn.Module:
    src = dict(model.named_parameters())
    with torch.no_grad():
        for n, p in template.named_parameters():
            t = src[n]
            p.copy_(t.full_tensor() if isinstance(t, DTensor) else t)
    return template


def counter() -> CollectiveCounter:
    from torch.distributed import distributed_c10d as c10d

    return CollectiveCounter(dist, c10d, torch.ops._c10d_functional)


def check(model: torch.nn.Module, template: torch.nn.Module, budget: int) -> None:
    ref = oracle(unsharded(model, template))
    with counter() as calls:
        stream = ParamStream(model, group_by="budget", budget_bytes=budget)
        meta = stream.metadata()
    assert calls.count == 0, calls.count
    with counter() as calls:  # the probe does see the gathers iteration makes
        next(iter(stream))
    assert calls.count > 0
    assert isinstance(stream.gatherer, Fsdp2Gatherer)
    assert [m.name for m in meta] == list(ref)
    bound = max(budget, max(ParamStream(model, group_by="module").group_gathered_bytes))
    total = sum(stream.group_gathered_bytes)
    assert total >= 4 * budget
    got, peak = [], 0
    for name, t in stream:
        held = stream.gatherer.held_bytes()
        assert held <= bound, (name, held, bound)
        peak = max(peak, held)
        got.append((name, t.clone()))
    assert peak > 0 and stream.gatherer.held_bytes() == 0
    assert_matches(got, ref)
    report(rank=dist.get_rank(), event="match", tensors=len(got), peak=peak, total=total, bound=bound)


def scenario_fsdp2() -> None:
    pm = lora(tiny_llama(layers=4, tie=False), target_modules="all-linear", modules_to_save=["lm_head"])
    template = copy.deepcopy(pm)
    shard(pm)
    train_step(pm)
    check(pm, template, budget=40_000)
    plain = tiny_llama(layers=4, seed=1)
    template = copy.deepcopy(plain)
    shard(plain)
    train_step(plain)
    check(plain, template, budget=40_000)


def scenario_drift() -> None:
    pm = shard(lora(tiny_llama(layers=2, dtype=torch.bfloat16), target_modules="all-linear"))
    locals_before = [p.to_local().clone() for p in pm.parameters()]
    stream = ParamStream(pm)
    for _ in range(100):
        for _name, _t in stream:
            pass
    assert all(torch.equal(p.to_local(), b) for p, b in zip(pm.parameters(), locals_before))
    report(rank=dist.get_rank(), event="bitwise-identical", streams=100)


def scenario_fsdp2_direct() -> None:
    from lora_stream import Fsdp2Gatherer

    models = [
        ("lora-r3-mts", lora(tiny_llama(layers=2), target_modules="all-linear", r=3, modules_to_save=["lm_head"])),
        ("plain", tiny_llama(layers=2, seed=1)),
        ("bf16", lora(tiny_llama(layers=2, dtype=torch.bfloat16), target_modules="all-linear")),
    ]
    for label, model in models:
        shard(model)
        direct, fallback = Fsdp2Gatherer(model), Fsdp2Gatherer(model, direct=False)
        stream = ParamStream(model, group_by="module")
        assert_direct_equals_fallback(direct, fallback, stream._groups, label)
        uneven = sum(int(p.shape[0] % dist.get_world_size() != 0) for g in stream._groups for p in g.params)
        dtensors = sum(len(g.params) for g in stream._groups)
        assert direct.path_counts == {"direct": dtensors, "fallback": 0}, direct.path_counts
        assert fallback.path_counts["direct"] == 0 and fallback.fallback_reason == "direct=False"
        assert label != "lora-r3-mts" or uneven > 0, "r=3 should give shards of different lengths"
        report(rank=dist.get_rank(), event="direct-equal", model=label, uneven=uneven)


def scenario_raise() -> None:
    run_failure(shard(lora(tiny_llama(layers=4), target_modules="all-linear")))


def run_failure(model: torch.nn.Module) -> None:
    stream = ParamStream(model, group_by="module")
    start = time.monotonic()
    try:
        for i, _batch in enumerate(stream.iter_groups()):
            if dist.get_rank() == 1 and i == 2:
                raise ValueError("consumer on rank 1 failed at the third group")
    except ValueError as exc:
        report(rank=dist.get_rank(), event="consumer-raised", message=str(exc))
        finish(0)
    except StreamAbortedError as exc:
        report_aborted(exc, start)
    finish(4)


def wrap_fsdp1(model: torch.nn.Module, use_orig_params: bool, forward: bool = True) -> torch.nn.Module:
    from peft.utils.other import fsdp_auto_wrap_policy
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    # For a LoRA model, peft's policy wraps each decoder layer and each LoRA factor on its own (FSDP1 refuses a unit
    # mixing frozen and trainable parameters with use_orig_params=False). A plain model: one unit per layer.
    is_peft = hasattr(model, "peft_config")
    policy = fsdp_auto_wrap_policy(model) if is_peft else ModuleWrapPolicy({LlamaDecoderLayer})
    wrapped = FSDP(model, auto_wrap_policy=policy, device_id=torch.device("cpu"), use_orig_params=use_orig_params)
    if forward:
        ids = torch.randint(0, 128, (1, 8))
        wrapped(input_ids=ids)
    return wrapped


def unsharded_fsdp1(model: torch.nn.Module, template: torch.nn.Module) -> torch.nn.Module:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    with FSDP.summon_full_params(model, writeback=False):
        src = {n.replace("_fsdp_wrapped_module.", ""): p for n, p in model.named_parameters()}
        with torch.no_grad():
            for n, p in template.named_parameters():
                p.copy_(src[n])
    return template


def check_fsdp1(model: torch.nn.Module, template: torch.nn.Module, budget: int) -> None:
    from lora_stream import Fsdp1Gatherer

    ref = oracle(unsharded_fsdp1(model, template))
    stream = ParamStream(model, group_by="budget", budget_bytes=budget)
    assert isinstance(stream.gatherer, Fsdp1Gatherer)
    assert [m.name for m in stream.metadata()] == list(ref)
    bound = max(budget, max(ParamStream(model, group_by="module").group_gathered_bytes))
    # Not cloned, on purpose: FSDP1 frees unsharded storage in place, so the tensors must be copies that stay valid.
    got, peak = stream_within_bound(stream, bound, clone=False)
    assert_matches(got, ref)
    assert stream.gatherer.held_bytes() == 0
    report(rank=dist.get_rank(), event="match", tensors=len(got), peak=peak, bound=bound)


def scenario_fsdp1() -> None:
    for use_orig_params in (True, False):
        pm = lora(tiny_llama(layers=4), target_modules="all-linear")
        template = copy.deepcopy(pm)
        model = wrap_fsdp1(pm, use_orig_params)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(dist.get_rank()))
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        check_fsdp1(model, template, budget=40_000)
        plain = tiny_llama(layers=4, seed=1, tie=True)
        template = copy.deepcopy(plain)
        check_fsdp1(wrap_fsdp1(plain, use_orig_params), template, budget=40_000)


def scenario_fsdp1_drift() -> None:
    model = wrap_fsdp1(lora(tiny_llama(layers=2, dtype=torch.bfloat16), target_modules="all-linear"), False)
    flats = [p for p in model.parameters()]
    before = [p.detach().clone() for p in flats]
    stream = ParamStream(model)
    for _ in range(100):
        for _name, _t in stream:
            pass
    assert all(torch.equal(p, b) for p, b in zip(flats, before))
    report(rank=dist.get_rank(), event="bitwise-identical", streams=100)


def scenario_fsdp1_raise() -> None:
    run_failure(wrap_fsdp1(lora(tiny_llama(layers=4), target_modules="all-linear"), True))


def scenario_fsdp1_noforward() -> None:
    from lora_stream import UnsupportedModelError

    model = wrap_fsdp1(tiny_llama(layers=2), True, forward=False)
    try:
        next(iter(ParamStream(model)))
    except UnsupportedModelError as exc:
        report(rank=dist.get_rank(), event="clear-error", message=str(exc))
        return
    raise AssertionError("expected UnsupportedModelError")


def main() -> None:
    dist.init_process_group("gloo")
    {
        "fsdp2": scenario_fsdp2,
        "fsdp2-drift": scenario_drift,
        "fsdp2-raise": scenario_raise,
        "fsdp2-direct": scenario_fsdp2_direct,
        "fsdp1": scenario_fsdp1,
        "fsdp1-drift": scenario_fsdp1_drift,
        "fsdp1-raise": scenario_fsdp1_raise,
        "fsdp1-noforward": scenario_fsdp1_noforward,
    }[sys.argv[1]]()
    finish()


if __name__ == "__main__":
    main()
