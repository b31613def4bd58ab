"""Rank worker: save a merged checkpoint from a 2-rank sharded LoRA trainer. Usage: checkpoint_save.py SCENARIO OUT

Scenarios:
  zero3       ZeRO-3 engine (tied embeddings, modules_to_save on lm_head off / on), one step, save_merged; rank 0
              checks from_pretrained(OUT) against peft's merge of an unsharded copy; every rank checks the bound.
  fsdp2       the same with fully_shard per decoder layer and on the root.
  zero3-fail  rank 0's disk fills up in the middle (injected): every rank raises, no checkpoint appears.

Prints one RESULT {json} line per rank.
"""

from __future__ import annotations

import copy
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from helpers import assert_matches, finish, lora, oracle, report, tiny_llama, zero3_engine, zero3_whole_into

from lora_stream import LoraStreamError, ParamStream, SafetensorsSink

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
    stream = ParamStream(model, budget_bytes=BUDGET)
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


def main() -> None:
    scenario, out = sys.argv[1], Path(sys.argv[2])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
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
        sink.sync(ParamStream(engine, budget_bytes=BUDGET, timeout=60))
    except (OSError, LoraStreamError) as exc:
        report(
            rank=rank, outcome="raised", error=type(exc).__name__, message=str(exc), seconds=time.monotonic() - start
        )
        finish()
    report(rank=rank, outcome="ok")
    finish(5)


if __name__ == "__main__":
    main()
