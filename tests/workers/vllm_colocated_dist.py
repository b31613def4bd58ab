"""Rank worker: a ZeRO-3 trainer and an external_launcher vLLM engine (TP=2 across the ranks) in every rank.

Usage: vllm_colocated_dist.py SCENARIO CHECKPOINT_DIR
  lora   LoRA on all linear layers: sync, check; one optimizer step; sync, check the new weights are served.
  tied   tied-embedding checkpoint, LoRA on q_proj and o_proj (lm_head served as the embedding's alias).
  mts    modules_to_save=["lm_head"] on an untied checkpoint.
  fail   rank 1's consumer fails in the middle of the sync: both ranks raise, nobody hangs.
  faults after a verified sync at v1, a failure on rank 1 only at each transaction point: both ranks raise, rank 0
         naming rank 1 and its reason; the engine's outputs equal v1's exactly and the version stays v1; then a
         sync at v2 succeeds and serves the merged model.
  faults-ddp  the same with a replicated (DDP-style) trainer: the stream's gatherer does not communicate, yet the
         ranks share one tensor-parallel engine, so the transaction agrees over the default group.
  early  verified syncs (stream timeout 60 s), a failure on rank 1 only before or in the pass: the pre-flight, the
         engine's snapshot (before rank 1's pass starts, while rank 0's is in it), the first and the second group;
         as "faults", and every rank ran as many status exchanges.
  early-ddp  the same with the replicated trainer.
"""

from __future__ import annotations

import copy
import os
import sys
import time

for _k, _v in {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}.items():
    os.environ.setdefault(_k, _v)

import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from helpers import (  # noqa: E402
    ZERO3_CONFIG,
    assert_vllm_serves,
    count_exchanges,
    fail_on_rank_1,
    lora,
    oracle,
    report,
    vllm_engine,
    vllm_generate,
    zero3_whole_into,
)

from lora_stream import ParamStream, StreamAbortedError, VLLMColocatedSink  # noqa: E402

deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
DS_CONFIG = ZERO3_CONFIG


def reference(engine, template: torch.nn.Module) -> torch.nn.Module:  # type: ignore[no-untyped-def]
    """An unsharded transformers model holding merge_and_unload() of the engine's current weights."""
    merged = copy.deepcopy(zero3_whole_into(engine, template)).float().merge_and_unload()
    assert list(dict(merged.named_parameters())) == list(oracle(template))
    return merged


def main() -> None:
    from transformers import LlamaForCausalLM

    scenario, path = sys.argv[1], sys.argv[2]
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    llm = vllm_engine(path, tensor_parallel_size=2, distributed_executor_backend="external_launcher")
    kw = {
        "lora": dict(target_modules="all-linear", lora_alpha=32),
        "tied": dict(target_modules=["q_proj", "o_proj"], lora_alpha=4),
        "mts": dict(target_modules=["q_proj"], modules_to_save=["lm_head"]),
        "fail": dict(target_modules="all-linear"),
        "faults": dict(target_modules="all-linear", lora_alpha=32),
        "faults-ddp": dict(target_modules="all-linear", lora_alpha=32),
        "early": dict(target_modules="all-linear", lora_alpha=32),
        "early-ddp": dict(target_modules="all-linear", lora_alpha=32),
    }[scenario]
    pm = lora(LlamaForCausalLM.from_pretrained(path), **kw)
    if scenario == "mts":
        with torch.no_grad():
            pm.base_model.model.lm_head.modules_to_save["default"].weight.mul_(-1.0)
    template = copy.deepcopy(pm)
    opt = torch.optim.SGD([p for p in pm.parameters() if p.requires_grad], lr=0.5)
    if scenario in ("faults-ddp", "early-ddp"):  # every rank a whole replica, stepped on the same data
        sink = VLLMColocatedSink(llm, verify=True)

        def ddp_step() -> None:
            ids = torch.tensor([[1, 17, 42, 99, 5, 7, 300]])
            pm(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()

        points = EARLY if scenario == "early-ddp" else POINTS
        faults(rank, pm, sink, llm, ddp_step, lambda: copy.deepcopy(pm).float().merge_and_unload(), points)
        return
    engine, *_ = deepspeed.initialize(model=pm, optimizer=opt, config=DS_CONFIG)
    sink = VLLMColocatedSink(llm, verify=scenario in ("faults", "early"))
    assert sink.in_process
    if scenario in ("faults", "early"):

        def zero3_step() -> None:
            ids = torch.tensor([[1, 17, 42, 99, 5, 7, 300]])
            engine.backward(engine(input_ids=ids, labels=ids).loss)
            engine.step()

        points = EARLY if scenario == "early" else POINTS
        faults(rank, engine, sink, llm, zero3_step, lambda: reference(engine, template), points)
        return

    if scenario == "fail":
        start = time.monotonic()

        class Failing(ParamStream):
            def iter_groups(self):  # type: ignore[no-untyped-def,override]
                for i, batch in enumerate(super().iter_groups()):
                    if rank == 1 and i == 2:
                        raise RuntimeError("injected consumer failure on rank 1")
                    yield batch

        try:
            sink.sync(Failing(engine, group_by="layer"))
        except (RuntimeError, StreamAbortedError) as exc:
            report(
                rank=rank, event="raised", error=type(exc).__name__, message=str(exc), seconds=time.monotonic() - start
            )
            vllm_generate(llm)  # the engine still runs
            report(rank=rank, event="engine-alive")
            return
        raise AssertionError("the sync should have raised")

    record = sink.sync(ParamStream(engine, group_by="layer"))
    first = vllm_generate(llm)
    assert any(lp < -1e-3 for _, lps in first for lp in lps), f"degenerate test model: {first}"
    assert_vllm_serves(first, reference(engine, template))
    ids = torch.tensor([[1, 17, 42, 99, 5, 7, 300]])
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    sink.sync(ParamStream(engine, group_by="layer"))
    second = vllm_generate(llm)
    assert second != first, "the optimizer step should change what vLLM serves"
    assert_vllm_serves(second, reference(engine, template))
    report(
        rank=rank,
        event="serves-merged",
        tensors=record.tensors,
        seconds=record.seconds,
        peak_gathered=record.peak_gathered_bytes,
    )


#: The transaction's fault points (one group for group:<k>).
POINTS = ("prepare", "group:1", "reload-check", "verify", "prefix-cache", "commit")
#: Before and in the pass: "snapshot" is the engine's snapshot, when the sync begins the reload (rank 1's pass has
#: not started, rank 0's has: rank 0 learns of the failure in its first group's exchange).
EARLY = ("prepare", "snapshot", "group:0", "group:1")


def faults(rank: int, engine, sink, llm, step, expected, points) -> None:  # type: ignore[no-untyped-def]
    from lora_stream.testing import fault_point, set_fault_hook

    exchanges = count_exchanges()
    begin = sink._begin

    def snapshot_then_begin(*args: object) -> None:  # a failure taking the engine's snapshot, before this rank's pass
        fault_point("snapshot")
        begin(*args)

    sink._begin = snapshot_then_begin
    # A short timeout: a rank left waiting for a peer that will not exchange would show as a wait of 60 s.
    timeout = 60 if points == EARLY else 300
    record = sink.sync(ParamStream(engine, group_by="layer", timeout=timeout), version="v1")
    assert record.verification is not None and record.verification.passed, record.verification
    before = vllm_generate(llm)
    step()
    for point in points:
        set_fault_hook(fail_on_rank_1(point, rank))
        start, ran = time.monotonic(), exchanges[0]
        try:
            sink.sync(ParamStream(engine, group_by="layer", timeout=timeout), version="v2")
            raise AssertionError(f"the sync should have raised at {point}")
        except (RuntimeError, StreamAbortedError) as exc:
            error = exc
        finally:
            set_fault_hook(None)
        seconds = time.monotonic() - start
        after = vllm_generate(llm)
        report(
            rank=rank,
            event="fault",
            point=point,
            error=type(error).__name__,
            message=str(error)[:300],
            failed_ranks=list(getattr(error, "failed_ranks", ())),
            equal=after == before,
            version=sink.version,
            seconds=seconds,
            exchanges=exchanges[0] - ran,
        )
    record = sink.sync(ParamStream(engine, group_by="layer", timeout=timeout), version="v2")
    served = vllm_generate(llm)
    assert served != before, "the optimizer step should change what vLLM serves"
    assert_vllm_serves(served, expected())
    report(rank=rank, event="recovered", version=sink.version, max_abs_diff=record.verification.max_abs_diff)


if __name__ == "__main__":
    # A normal exit, unlike the other workers: vLLM's CPU tensor-parallel shared memory is unlinked at exit, and a
    # segment left behind makes the next engine fail ("create shm in SHMManager failed. errno: 17").
    main()
