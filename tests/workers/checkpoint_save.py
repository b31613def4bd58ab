"""Rank worker: save a merged checkpoint from a 2-rank sharded LoRA trainer. Usage: checkpoint_save.py SCENARIO OUT

Scenarios:
  zero3       ZeRO-3 engine (tied embeddings, modules_to_save on lm_head off / on), one step, save_merged; rank 0
              checks from_pretrained(OUT) against peft's merge of an unsharded copy; every rank checks the bound.
  fsdp2       the same with fully_shard per decoder layer and on the root.
  zero3-fail  rank 0's disk fills up in the middle (injected): every rank raises, no checkpoint appears.
  faults-ddp  over an old checkpoint, replicated (DDP) ranks: a failure on rank 1 only (its pass, just before the
              vote) and a failure of rank 0's publish (before the rename; between the fallback's renames): every
              rank raises, rank 0 leaves the old checkpoint byte for byte and nothing beside it; then a save works.
  faults-fsdp2  the same with FSDP2 (the ranks' passes in lockstep).

Prints one RESULT {json} line per rank.
"""

from __future__ import annotations

import copy
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from helpers import (
    assert_matches,
    count_exchanges,
    finish,
    lora,
    oracle,
    report,
    tiny_llama,
    zero3_engine,
    zero3_whole_into,
)

from lora_stream import LoraStreamError, ParamStream, SafetensorsSink, StreamAbortedError
from lora_stream.sinks.durable_files import NO_RENAME_EXCHANGE_ENV
from lora_stream.testing import set_fault_hook

BUDGET = 40_000


def zero3(pm: torch.nn.Module):  # type: ignore[no-untyped-def]
    engine = zero3_engine(pm)
    ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(dist.get_rank()))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    return engine, lambda template: zero3_whole_into(engine, template)


def fsdp2(pm: torch.nn.Module):  # type: ignore[no-untyped-def]
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in pm.base_model.model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(pm, mesh=mesh)
    opt = torch.optim.AdamW([p for p in pm.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(dist.get_rank()))
    pm(input_ids=ids, labels=ids).loss.backward()
    opt.step()

    def whole(template: torch.nn.Module) -> torch.nn.Module:
        src = dict(pm.named_parameters())
        with torch.no_grad():
            for n, p in template.named_parameters():
                t = src[n]
                p.copy_(t.full_tensor() if isinstance(t, DTensor) else t)
        return template

    return pm, whole


def save_and_check(how: str, out: Path, saved: list[str] | None) -> dict[str, object]:
    from transformers import AutoModelForCausalLM

    pm = lora(tiny_llama(layers=4, tie=True), target_modules="all-linear", modules_to_save=saved)
    template = copy.deepcopy(pm)
    model, whole = (zero3 if how == "zero3" else fsdp2)(pm)
    stream = ParamStream(model, group_by="budget", budget_bytes=BUDGET)
    bound = max(BUDGET, max(ParamStream(model, group_by="module").group_gathered_bytes))
    record = SafetensorsSink(out, max_shard_size=30_000).sync(stream)
    ref = oracle(whole(template))  # a gather: every rank takes part
    result: dict[str, object] = {"peak_gathered": record.peak_gathered_bytes, "bound": bound}
    assert 0 < record.peak_gathered_bytes <= bound, result
    if dist.get_rank() == 0:
        loaded = {n: p.detach() for n, p in AutoModelForCausalLM.from_pretrained(out).named_parameters()}
        assert set(loaded) == set(ref), set(loaded) ^ set(ref)
        assert_matches(((n, loaded[n]) for n in ref), ref)
        result["shards"] = len(list(out.glob("model-*.safetensors")))
    return result


def replicated(how: str, pm: torch.nn.Module):  # type: ignore[no-untyped-def]
    """``pm`` under DDP or FSDP2, an optimizer step, and an unsharded copy of the trainer's current weights (a
    collective under FSDP2: every rank calls it)."""
    if how == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model, whole = DistributedDataParallel(pm), lambda: pm
    else:
        template = copy.deepcopy(pm)
        model, into = fsdp2(pm)  # one step already
        whole = lambda: into(template)  # noqa: E731
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)

    def step() -> None:
        ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(dist.get_rank()))
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()

    return model, step, whole


def files_of(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


#: (case, failing rank, how): "hook" raises at that fault point; "publish" raises from rank 0's on_publish at that
#: step ("renamed" with the fallback's two renames, so that the old copy is moved back).
FAULTS = [
    ("group:1", 1, "hook"),
    ("commit", 1, "hook"),
    ("synced", 0, "publish"),
    ("renamed", 0, "publish"),
]


def faults(how: str, out: Path) -> None:
    """Save v1, step, then fail each case of :data:`FAULTS` over it; then save v2. One ``fault`` record per case,
    with the exchanges this rank ran in that save (every rank must run as many)."""
    rank = dist.get_rank()
    exchanges = count_exchanges()
    pm = lora(tiny_llama(layers=2), target_modules="all-linear")
    model, step, whole = replicated(how, pm)
    target = out / "m"

    def sink() -> SafetensorsSink:
        return SafetensorsSink(target, max_shard_size=30_000, overwrite=True, progress=False)

    def stream() -> ParamStream:
        return ParamStream(model, group_by="budget", budget_bytes=BUDGET, timeout=60)

    sink().sync(stream(), version="v1")
    old = files_of(target) if rank == 0 else {}
    step()
    for point, failing, kind in FAULTS:
        injected = f"injected failure at {point} on rank {failing}"

        def hook(p: str, point: str = point, failing: int = failing, injected: str = injected) -> None:
            if rank == failing and p == point:
                raise RuntimeError(injected)

        s = sink()
        if kind == "hook":
            set_fault_hook(hook)
        else:
            s.on_publish = hook
            if point == "renamed" and rank == 0:
                os.environ[NO_RENAME_EXCHANGE_ENV] = "1"
        start, before = time.monotonic(), exchanges[0]
        try:
            s.sync(stream(), version="v2")
            raise AssertionError(f"the save should have raised at {point}")
        except (RuntimeError, StreamAbortedError) as exc:
            error = exc
        finally:
            set_fault_hook(None)
            os.environ.pop(NO_RENAME_EXCHANGE_ENV, None)
        seconds = time.monotonic() - start
        intact = files_of(target) == old if rank == 0 else None
        beside = sorted(p.name for p in out.iterdir() if p.name != "m") if rank == 0 else []
        report(
            rank=rank,
            event="fault",
            point=point,
            failing=failing,
            error=type(error).__name__,
            message=str(error)[:400],
            failed_ranks=list(getattr(error, "failed_ranks", ())),
            intact=intact,
            beside=beside,
            seconds=seconds,
            exchanges=exchanges[0] - before,
        )
    sink().sync(stream(), version="v2")
    ref = oracle(whole())
    if rank == 0:
        from safetensors.torch import load_file

        got = {}
        for f in sorted(target.glob("*.safetensors")):
            got.update(load_file(str(f)))
        assert set(got) == set(ref), set(got) ^ set(ref)
        assert_matches(((n, got[n]) for n in ref), ref)
        assert files_of(target) != old
    report(rank=rank, event="saved")
    finish()


def main() -> None:
    scenario, out = sys.argv[1], Path(sys.argv[2])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if scenario.startswith("faults-"):
        faults(scenario.removeprefix("faults-"), out)
    if scenario in ("zero3", "fsdp2"):
        results = {}
        for saved in (None, ["lm_head"]):
            target = out / f"{scenario}-{'saved' if saved else 'tied'}"
            results["saved" if saved else "tied"] = save_and_check(scenario, target, saved)
        report(rank=rank, outcome="ok", **results)
        finish()
    pm = lora(tiny_llama(layers=4), target_modules="all-linear")
    engine, _ = zero3(pm)
    sink = SafetensorsSink(out / "never", max_shard_size=30_000)
    count = []

    def disk_full(name: str) -> None:
        count.append(name)
        if len(count) == 6:
            raise OSError(28, "No space left on device (injected)")

    sink.on_tensor = disk_full
    start = time.monotonic()
    try:
        sink.sync(ParamStream(engine, group_by="budget", budget_bytes=BUDGET, timeout=60))
    except (OSError, LoraStreamError) as exc:
        report(
            rank=rank, outcome="raised", error=type(exc).__name__, message=str(exc), seconds=time.monotonic() - start
        )
        finish()
    report(rank=rank, outcome="ok")
    finish(5)


if __name__ == "__main__":
    main()
