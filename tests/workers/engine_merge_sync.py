"""Rank worker: 2 ZeRO-3 ranks keep vLLM servers serving the exact merged policy while the merges run in the
servers (``VLLMServerSink(merge="engine")``).

Usage: engine_merge_sync.py CONFIG CHECKPOINT URLS [faults]
  CONFIG  lora | rslora | patterns | dora | loha | lokr | modules_to_save | lora_bias
  URLS    one server URL, or several joined by ","  (a fleet: each gets its own copy of the inputs)

Reports {"event": "sync", "label", "tensors", "sent_bytes", "adapter_bytes", "full_because", "kept", "stages"} per
sync and {"event": "equal", "label", "equal"} where what the engine-side merge serves is compared (==, greedy tokens
and logprobs) with what a trainer-side merged sync of the same weights serves, on every server. With ``faults``:
a failure on rank 1 only at every fault point ({"event": "fault", "point", "equal", "error"}), a base whose
fingerprint the trainer does not recognise ({"event": "refused", ...}), and a frozen base weight edited on rank 1.
"""

from __future__ import annotations

import sys
import time

import deepspeed
import torch
import torch.distributed as dist
from helpers import ZERO3_CONFIG, fail_on_rank_1, finish, perturb_adapters, report, report_sync, server_generate

from lora_stream import LoraStreamError, ParamStream, StreamAbortedError, VLLMServerSink
from lora_stream.testing import FAULT_POINTS, set_fault_hook

deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False

CONFIGS = {
    "lora": dict(target_modules="all-linear"),
    "rslora": dict(target_modules=["q_proj", "v_proj", "down_proj"], use_rslora=True),
    "patterns": dict(
        target_modules=["q_proj", "o_proj", "gate_proj"], rank_pattern={"o_proj": 2}, alpha_pattern={"q_proj": 3}
    ),
    "dora": dict(target_modules=["q_proj", "down_proj", "up_proj"], use_dora=True),
    "modules_to_save": dict(target_modules=["q_proj"], modules_to_save=["lm_head"]),
    "lora_bias": dict(target_modules=["o_proj", "down_proj"], lora_bias=True),
}


def build(config: str, ckpt: str):  # type: ignore[no-untyped-def]
    from peft import LoHaConfig, LoKrConfig, LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(ckpt)
    if config in ("loha", "lokr"):
        cls = LoHaConfig if config == "loha" else LoKrConfig
        cfg = cls(r=4, target_modules=["q_proj", "v_proj", "gate_proj"], init_weights=False)
    else:
        cfg = LoraConfig(r=4, lora_alpha=16, init_lora_weights=False, **CONFIGS[config])
    pm = get_peft_model(model, cfg)
    perturb_adapters(pm)  # random factors everywhere: peft's initial B = 0 would make a wrong merge look right
    opt = torch.optim.SGD([p for p in pm.parameters() if p.requires_grad], lr=0.5)
    engine, *_ = deepspeed.initialize(model=pm, optimizer=opt, config=ZERO3_CONFIG)
    adapter_bytes = sum(
        p.ds_numel * 4 if hasattr(p, "ds_numel") else p.numel() * 4 for p in pm.parameters() if p.requires_grad
    )
    return engine, adapter_bytes


def main() -> None:
    config, ckpt, urls_arg = sys.argv[1:4]
    faults = "faults" in sys.argv[4:]
    urls = urls_arg.split(",")
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    engine, adapter_bytes = build(config, ckpt)
    sink = VLLMServerSink(urls, rank=rank, timeout=30, merge="engine")
    trainer_side = VLLMServerSink(urls, rank=rank, timeout=30, skip_unchanged=False)

    def step() -> None:
        ids = torch.tensor([[1, 17, 42, 99, 5, 7, 300]])
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()

    def sync(label: str, into: VLLMServerSink = sink) -> None:
        r = into.sync(ParamStream(engine, group_by="layer"), version=label)
        worker = dict(r.stages.get("worker") or {})
        extra = {"merge_s": worker.get("merge_s"), "base_bytes": worker.get("base_bytes")}
        report_sync(rank, label, r, adapter_bytes=adapter_bytes, **extra)

    def served() -> list | None:  # type: ignore[type-arg]
        return [server_generate(u) for u in urls] if rank == 0 else None

    def same_as_trainer_side(label: str) -> None:
        """What the engine-side merge serves, against a trainer-side merged sync of the same weights."""
        mine = served()
        sync(f"{label}-trainer", trainer_side)
        if rank == 0:
            theirs = served()
            report(rank=rank, event="equal", label=label, equal=theirs == mine, changed=mine != before_any)

    before_any = served()
    sync("v1")  # a fresh server: the base and the inputs
    step()
    sync("v2")  # only the inputs; the servers merge onto the base they keep
    same_as_trainer_side("v2")
    sync("v3")  # another sink wrote the servers: the base again
    step()
    sync("v4")
    step()
    sync("v5")
    same_as_trainer_side("v5")  # three training steps, perturbed adapters
    if not faults:
        finish()
        return
    sync("f0")

    def failing(label: str, point: str) -> None:
        before = served()

        set_fault_hook(fail_on_rank_1(point, rank))
        t = time.monotonic()
        error = ""
        try:
            sync(label)
            raise AssertionError(f"the sync should have raised at {point}")
        except (RuntimeError, StreamAbortedError, LoraStreamError) as exc:
            error = type(exc).__name__
        finally:
            set_fault_hook(None)
        report(
            rank=rank,
            event="fault",
            point=point,
            label=label,
            error=error,
            seconds=time.monotonic() - t,
            equal=served() == before if rank == 0 else None,
        )

    points = [p.replace("<k>", "1") for p in FAULT_POINTS if p != "verify"]
    for i, point in enumerate(points):
        step()
        failing(f"fail-{i}", point)  # a partial sync: rolled back by recomputing from the base
        sync(f"after-{i}")  # the next one sends the base again, and works
    step()
    failing("fail-full", "reload-check")  # a full sync (after a failure): rolled back from the copy
    sync("after-full")
    step()
    sync("pre-refuse")
    # The trainer's record of the servers' base no longer matches what they hold: refused before any load.
    before = served()
    if rank == 0:
        record = sink._base
        assert record.sent is not None and record.synced is not None
        key = next(iter(record.synced))  # the base under an adapter: every partial sync reads it
        record.sent[key] ^= 1
    step()
    try:
        sync("refused")
        message = ""
    except (LoraStreamError, StreamAbortedError) as exc:
        message = str(exc)
    report(rank=rank, event="refused", message=message[:400], equal=served() == before if rank == 0 else None)
    sync("after-refused")
    # A frozen base weight under an adapter edited on rank 1's shard only, by a structured edit (every odd element
    # negated: sign bits in pairs, which a linear fingerprint cancels): both ranks send the base again.
    params = dict(engine.module.named_parameters())
    p = params["base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"]
    if rank == 1:
        with torch.no_grad():
            p.ds_tensor.data[1::2].neg_()
    step()
    sync("edited")
    same_as_trainer_side("edited")
    # A base weight unfrozen after the first sync (requires_grad_(True)), then written: the recipes are built again
    # (it is a trained input now, sent at every sync) and the base travels once more.
    sync("pre-unfreeze")  # the trainer-side sink wrote the servers: this one's full sync first
    norm = params["base_model.model.model.norm.weight"]
    norm.requires_grad_(True)
    with torch.no_grad():
        norm.ds_tensor.data.mul_(1.25)
    sync("unfrozen")
    same_as_trainer_side("unfrozen")
    sync("unfrozen-1")
    with torch.no_grad():
        norm.ds_tensor.data.mul_(1.25)
    sync("unfrozen-2")  # partial: the norm is a trained input now, sent with the adapter
    same_as_trainer_side("unfrozen-2")
    finish()


if __name__ == "__main__":
    main()
