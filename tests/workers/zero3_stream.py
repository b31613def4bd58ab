"""Rank worker for the DeepSpeed ZeRO-3 tests. Usage: zero3_stream.py SCENARIO [ARGS...]

Scenarios:
  engine      LoRA model (+ plain model) through deepspeed.initialize, one step; stream == oracle on every rank;
              gathered bytes bounded at every yield; metadata() communicates nothing.
  zinit DIR   model built under zero.Init by HfDeepSpeedConfig + from_pretrained(DIR), then LoRA and a step; its
              direct gather equals GatheredParameters bit for bit.
  mixed       bf16 base, float32 LoRA factors, modules_to_save on lm_head, tied embeddings.
  moe DIR     Qwen3-MoE with all-linear LoRA (experts and router through target_parameters), one step: the stream
              equals the merged checkpoint (per-expert names) within the gathered-bytes bound.
  drift       bf16 engine, 100 streams: every rank's partition (ds_tensor) bitwise identical afterwards.
  raise       rank 1's consumer raises at the third group (and catches it after the loop).
  die         rank 1's process exits at the third group.
  direct      the direct gather (owned buffers) against GatheredParameters, bit for bit, group by group, on every
              model these tests use (LoRA + modules_to_save + tied, plain, bf16 base with float32 factors, Qwen3-MoE
              with LoRA on the experts); the path reported in the stats; the fallback chosen where it must be.
  prefetch    prefetch=True: the stream equals the oracle, at most two groups held at every yield; a break releases
              both buffers.
  prefetch-raise  rank 1's consumer raises at the third group with the next group's gather in flight.
  raise-kept  rank 1's consumer raises at the third group inside ``with stream.iter_groups()``, and rank 1 keeps the
              pass and the traceback alive (and its process running) afterwards.
"""

from __future__ import annotations

import copy
import os
import sys
import time

import deepspeed
import torch
import torch.distributed as dist
from helpers import (
    ZERO3_CONFIG,
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
    zero3_engine,
    zero3_whole_into,
)

from lora_stream import ParamStream, StreamAbortedError, ZeroThreeGatherer

# The shm comm op JIT-compiles with g++ for ~45 s on first use; plain gloo is all these tests need.
deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False

DS_CONFIG = ZERO3_CONFIG
engine_for = zero3_engine


def train_step(engine, vocab: int = 128) -> None:  # type: ignore[no-untyped-def]
    ids = torch.randint(0, vocab, (1, 8), generator=torch.Generator().manual_seed(dist.get_rank()))
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()


def unsharded(engine, template: torch.nn.Module) -> torch.nn.Module:  # type: ignore[no-untyped-def]
    """The oracle's input: ``template`` (an unsharded copy) holding the engine's current full weights."""
    return zero3_whole_into(engine, template)


def counter() -> CollectiveCounter:
    import deepspeed.comm as dscomm

    return CollectiveCounter(dist, dscomm)


def check_stream(engine, template, budget: int) -> None:  # type: ignore[no-untyped-def]
    ref = oracle(unsharded(engine, template))
    with counter() as calls:
        stream = ParamStream(engine, group_by="budget", budget_bytes=budget)
        meta = stream.metadata()
        stream.groups()
    assert calls.count == 0, f"planning and metadata() called {calls.count} collectives"
    with counter() as calls:  # the probe does see the gathers iteration makes
        next(iter(stream))
    assert calls.count > 0
    assert isinstance(stream.gatherer, ZeroThreeGatherer)
    assert [m.name for m in meta] == list(ref)
    largest_module = max(ParamStream(engine, group_by="module").group_gathered_bytes)
    bound = max(budget, largest_module)
    total = sum(stream.group_gathered_bytes)
    assert total >= 4 * budget, (total, budget)
    assert stream.gatherer.held_bytes() == 0
    got, peak = stream_within_bound(stream, bound)
    assert stream.gatherer.held_bytes() == 0
    assert_matches(got, ref)
    assert stream.last_stats.complete and stream.last_stats.peak_gathered_bytes == peak
    # The engine's .module streams the same.
    assert_matches(ParamStream(engine.module, group_by="layer"), ref)
    report(rank=dist.get_rank(), event="match", tensors=len(got), peak=peak, total=total, bound=bound)


def scenario_engine() -> None:
    pm = lora(tiny_llama(layers=4, tie=True), target_modules="all-linear", modules_to_save=["lm_head"])
    template = copy.deepcopy(pm)
    engine = engine_for(pm)
    train_step(engine)
    check_stream(engine, template, budget=40_000)
    plain = tiny_llama(layers=4, seed=1)
    template = copy.deepcopy(plain)
    engine = engine_for(plain)
    train_step(engine)
    check_stream(engine, template, budget=40_000)


def scenario_zinit(path: str) -> None:
    from transformers import LlamaForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    targets = ["q_proj", "v_proj", "down_proj"]
    template = lora(LlamaForCausalLM.from_pretrained(path), target_modules=targets)  # before zero.Init is on
    dschf = HfDeepSpeedConfig(DS_CONFIG)  # noqa: F841 - must stay alive while from_pretrained runs
    model = LlamaForCausalLM.from_pretrained(path)
    assert all(hasattr(p, "ds_id") and p.numel() == 0 for p in model.parameters()), "not built under zero.Init"
    pm = lora(model, target_modules=targets)
    engine = engine_for(pm)
    train_step(engine)
    check_stream(engine, template, budget=40_000)
    direct_equals_gathered_parameters(engine, "zinit")


def scenario_mixed() -> None:
    pm = lora(
        tiny_llama(layers=2, tie=True, dtype=torch.bfloat16),
        target_modules="all-linear",
        modules_to_save=["lm_head"],
    )
    assert pm.base_model.model.model.layers[0].self_attn.q_proj.lora_A["default"].weight.dtype == torch.float32
    # ZeRO-3's optimizer wants one dtype among trainable parameters: train the saved lm_head copy in float32 too.
    pm.base_model.model.lm_head.modules_to_save["default"].float()
    template = copy.deepcopy(pm)
    engine = engine_for(pm)  # no training step: a saved float32 lm_head over bf16 activations can't run forward
    dtypes = {p.dtype for p in engine.module.parameters()}
    assert dtypes == {torch.bfloat16, torch.float32}, dtypes
    ref = oracle(unsharded(engine, template))
    stream = ParamStream(engine)
    got = list(stream)
    dtypes = {n: t.dtype for n, t in got}
    assert dtypes.pop("lm_head.weight") == torch.float32, "a saved module keeps its own dtype"
    assert set(dtypes.values()) == {torch.bfloat16}, "merged output keeps the base dtype, not the factors'"
    assert [m.dtype for m in stream.metadata()] == [t.dtype for _, t in got]
    assert "lm_head.weight" in dict(got) and "model.embed_tokens.weight" in dict(got)
    assert_matches(got, ref, tol=4e-3)
    report(rank=dist.get_rank(), event="mixed-match")


def scenario_moe(path: str) -> None:
    from architectures import BY_ID, build
    from helpers import checkpoint_oracle, perturb_adapters, read_checkpoint
    from peft import LoraConfig, get_peft_model

    arch = BY_ID["qwen3_moe"]
    pm = get_peft_model(build(arch), LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, **arch.lora))
    perturb_adapters(pm)
    assert any(type(m).__name__ == "ParamWrapper" for m in pm.modules()), "all-linear should adapt the experts"
    template = copy.deepcopy(pm)
    engine = engine_for(pm)
    train_step(engine, vocab=1000)
    merged = unsharded(engine, template)  # a gather: every rank takes part
    if dist.get_rank() == 0:  # save_pretrained writes on rank 0 only
        checkpoint_oracle(merged, os.path.join(path, "merged"))
    dist.barrier()
    ref = read_checkpoint(os.path.join(path, "merged"))
    budget = 60_000
    stream = ParamStream(engine, group_by="budget", budget_bytes=budget)
    largest_module = max(ParamStream(engine, group_by="module").group_gathered_bytes)
    bound = max(budget, largest_module)
    pairs, peak = stream_within_bound(stream, bound)
    got = dict(pairs)
    assert sorted(got) == sorted(ref), sorted(set(got) ^ set(ref))[:10]
    assert_matches(list(got.items()), {n: ref[n] for n in got})
    experts = sum(1 for n in got if ".mlp.experts." in n)
    report(rank=dist.get_rank(), event="moe-match", tensors=len(got), experts=experts, peak=peak, bound=bound)


def scenario_drift() -> None:
    pm = lora(tiny_llama(layers=2), target_modules="all-linear")
    engine = engine_for(pm, {**DS_CONFIG, "bf16": {"enabled": True}})
    train_step(engine)
    params = list(engine.module.parameters())
    assert all(p.ds_tensor.dtype == torch.bfloat16 for p in params)
    before = [p.ds_tensor.detach().clone() for p in params]
    stream = ParamStream(engine)
    for _ in range(100):
        for _name, _t in stream:
            pass
    assert all(torch.equal(p.ds_tensor, b) for p, b in zip(params, before))
    report(rank=dist.get_rank(), event="bitwise-identical", streams=100)


def _models() -> list[tuple[str, torch.nn.Module]]:
    from architectures import BY_ID, build
    from helpers import perturb_adapters
    from peft import LoraConfig, get_peft_model

    mixed = lora(tiny_llama(layers=2, tie=True, dtype=torch.bfloat16), target_modules="all-linear")
    arch = BY_ID["qwen3_moe"]
    moe = get_peft_model(build(arch), LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, **arch.lora))
    perturb_adapters(moe)
    saved = lora(tiny_llama(layers=4, tie=True), target_modules="all-linear", modules_to_save=["lm_head"])
    return [
        ("lora-mts-tied", saved),
        ("plain", tiny_llama(layers=4, seed=1)),
        ("bf16-base-f32-factors", mixed),
        ("qwen3-moe", moe),
    ]


def direct_equals_gathered_parameters(engine, label: str):  # type: ignore[no-untyped-def]
    """Every group of ``engine``: the direct gather and GatheredParameters give the same bytes."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    direct, fallback = ZeroThreeGatherer(engine), ZeroThreeGatherer(engine, direct=False)
    stream = ParamStream(engine, group_by="module")

    def untouched(params: list) -> None:  # type: ignore[type-arg]
        assert all(p.ds_status == ZeroParamStatus.NOT_AVAILABLE for p in params), "params touched"

    groups = assert_direct_equals_fallback(direct, fallback, stream._groups, label, inside=untouched)
    params = sum(len(g.params) for g in stream._groups)  # path_counts counts parameters
    assert direct.path_counts == {"direct": params, "fallback": 0}, direct.path_counts
    assert fallback.path_counts == {"direct": 0, "fallback": params} and fallback.fallback_reason == "direct=False"
    return stream, direct, groups


def scenario_direct() -> None:
    for label, model in _models():
        engine = engine_for(model)
        stream, _, groups = direct_equals_gathered_parameters(engine, label)
        list(stream)
        params = sum(len(g.params) for g in stream._groups)
        assert stream.last_stats.gather_paths == {"direct": params, "fallback": 0}, stream.last_stats.gather_paths
        assert stream.last_stats.fallback_reason is None
        # A configuration the direct path cannot prove equal (a ZeRO++ secondary partition): the group falls back.
        probe = ZeroThreeGatherer(engine)
        p0 = stream._groups[0].params[0]
        p0.ds_secondary_tensor = p0.ds_tensor
        try:
            assert "ZeRO++" in str(probe.direct_refusal(stream._groups[0].params))
            with probe.gather(stream._groups[0].params) as full:
                full(p0)
            assert probe.path_counts == {"direct": 0, "fallback": len(stream._groups[0].params)}
        finally:
            p0.ds_secondary_tensor = None
        report(rank=dist.get_rank(), event="direct-equal", model=label, groups=groups)


def scenario_prefetch() -> None:
    pm = lora(tiny_llama(layers=4, tie=True), target_modules="all-linear", modules_to_save=["lm_head"])
    template = copy.deepcopy(pm)
    engine = engine_for(pm)
    train_step(engine)
    ref = oracle(unsharded(engine, template))
    stream = ParamStream(engine, group_by="module", prefetch=True)
    sizes = stream.group_gathered_bytes
    bound = max(a + b for a, b in zip(sizes, [*sizes[1:], 0]))
    got, peak = stream_within_bound(stream, bound)
    assert_matches(got, ref)
    assert stream.last_stats.peak_gathered_bytes == bound >= peak > max(sizes), (bound, peak, max(sizes))
    assert stream.gatherer.held_bytes() == 0 and stream.gatherer._buffers == [None, None]
    for i, _ in enumerate(stream.iter_groups()):
        if i == 2:
            break  # the next group's gather is in flight here
    assert stream.gatherer.held_bytes() == 0 and stream.gatherer._buffers == [None, None], "break releases both"
    report(rank=dist.get_rank(), event="prefetch-match", peak=peak, bound=bound, largest=max(sizes))


def scenario_failure(kind: str) -> None:
    pm = lora(tiny_llama(layers=4), target_modules="all-linear")
    engine = engine_for(pm)
    stream = ParamStream(engine, group_by="module", prefetch=kind.startswith("prefetch"))
    rank = dist.get_rank()
    start = time.monotonic()
    try:
        for i, _batch in enumerate(stream.iter_groups()):
            if rank == 1 and i == 2:
                if kind == "die":
                    os._exit(17)
                raise ValueError("consumer on rank 1 failed at the third group")
    except ValueError as exc:
        report(rank=dist.get_rank(), event="consumer-raised", message=str(exc), seconds=time.monotonic() - start)
        finish(0)
    except StreamAbortedError as exc:
        report_aborted(exc, start)
    report(rank=dist.get_rank(), event="completed")  # should not happen
    finish(4)


def scenario_raise_kept() -> None:
    pm = lora(tiny_llama(layers=4), target_modules="all-linear")
    engine = engine_for(pm)
    # A long timeout: if rank 1's stop were only sent when its pass is collected, rank 0 would wait all of it.
    stream = ParamStream(engine, group_by="module", timeout=120)
    rank = dist.get_rank()
    start = time.monotonic()
    kept = []
    try:
        with stream.iter_groups() as groups:
            kept.append(groups)
            for i, _batch in enumerate(groups):
                if rank == 1 and i == 2:
                    raise ValueError("consumer on rank 1 failed at the third group")
    except ValueError as exc:
        kept.append(exc)  # the traceback keeps this frame, and the pass, alive
        report(rank=dist.get_rank(), event="consumer-raised", message=str(exc), seconds=time.monotonic() - start)
        time.sleep(12)  # alive past the 10 s rank 0 has to abort: it cannot learn of the stop from a closed connection
        finish(0)
    except StreamAbortedError as exc:
        report_aborted(exc, start)
    report(rank=dist.get_rank(), event="completed")  # should not happen
    finish(4)


def main() -> None:
    deepspeed.init_distributed(dist_backend="gloo")
    scenario, args = sys.argv[1], sys.argv[2:]
    if scenario in ("raise", "die", "prefetch-raise"):
        scenario_failure(scenario)
    elif scenario == "raise-kept":
        scenario_raise_kept()
    else:
        {
            "engine": scenario_engine,
            "zinit": scenario_zinit,
            "mixed": scenario_mixed,
            "drift": scenario_drift,
            "moe": scenario_moe,
            "direct": scenario_direct,
            "prefetch": scenario_prefetch,
        }[scenario](*args)
    finish()


if __name__ == "__main__":
    main()
