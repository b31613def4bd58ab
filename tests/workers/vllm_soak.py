"""Rank worker of the soak (tests/soak.py): a 2-rank ZeRO-3 trainer syncs a fleet of two vLLM servers round after
round, with the round's fault injected, and reports each round's outcome to the driver.

Usage: vllm_soak.py PLAN_JSON URL_A URL_B CHECKPOINT MARKER_DIR
PLAN_JSON: {"rounds": [{"k", "fault", "rank", "point", "server"}...], "timeouts": {...}, "seed": int, "merge": where
the merge runs, "elements": element syncs}, the rounds this launch runs (after a trainer death the driver launches
the rest again). Server A is fed by rank 0, B by rank 1.

The trainer: a LoRA on every linear layer, an SGD step before each sync; with ``elements`` the whole model instead
(full fine-tuning, every parameter trainable, ZeRO-3 with no persistent parameter), whose ranks each edit a few
elements of their own partition before each sync (:func:`edit_own_elements`) and sync with
``VLLMServerSink(elements=True)``.

Faults (``fault``):
  none          a plain sync.
  raise         the fault hook raises on ``rank`` at ``point``.
  slow          the fault hook sleeps on ``rank`` at ``point``, longer than the sink's agreement wait.
  die           the fault hook ends ``rank``'s process at ``point`` (os._exit, as a crash).
  kill-server   the rank feeding ``server`` signals ``fault<k>`` at group 2 and waits for ``faulted<k>`` (the driver
                SIGKILLs the server meanwhile).
  stop-server   the same, the driver SIGSTOPs the server (and SIGCONTs it after the round).
  stall-server  the same, the driver SIGSTOPs the server for longer than the lease but shorter than the sink's
                timeout, then SIGCONTs it: every rank is alive and renewing meanwhile.
  stop-rank     ``rank`` signals ``fault<k>`` (with its pid) at ``point`` and waits for ``faulted<k>``: the driver
                SIGSTOPs it for longer than the lease, then SIGCONTs it (a GC pause or a preemption, not a death).
After each round every rank writes ``round<k>.rank<r>`` (JSON: committed or not, error, seconds, and, after a commit,
whether its server serves the trainer's merged weights -- its own weights with ``elements`` -- and whether the sync
went as elements) and waits for ``go<k>`` (or ``exit``).
"""

from __future__ import annotations

import copy
import json
import os
import sys
import time

import deepspeed
import torch
import torch.distributed as dist
from helpers import (
    ZERO3_CONFIG,
    assert_vllm_serves,
    edit_a_few,
    finish,
    lora,
    own_elements,
    server_generate,
    zero3_whole_into,
)

from lora_stream import ParamStream, VLLMServerSink
from lora_stream.testing import set_fault_hook

deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
IDS = torch.tensor([[1, 17, 42, 99, 5, 7, 300]])
MARKERS = ""


def marker(name: str) -> str:
    return os.path.join(MARKERS, name)


def signal(name: str, data: dict | None = None) -> None:  # type: ignore[type-arg]
    tmp = marker(name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(data or {}, f)
    os.replace(tmp, marker(name))


def wait_for(*names: str, timeout: float = 900.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for n in names:
            if os.path.exists(marker(n)):
                return n
        time.sleep(0.05)
    raise TimeoutError(f"the driver never wrote any of {names}")


def hook_for(fault: dict, rank: int, slow_s: float):  # type: ignore[no-untyped-def,type-arg]
    kind, point = fault["fault"], fault.get("point")
    feeding = fault.get("server") == rank  # server i is fed by rank i

    def hook(p: str) -> None:
        if kind in ("kill-server", "stop-server", "stall-server"):
            if feeding and p == "group:2":
                signal(f"fault{fault['k']}")
                wait_for(f"faulted{fault['k']}")
            return
        if rank != fault.get("rank") or p != point:
            return
        if kind == "stop-rank":
            signal(f"fault{fault['k']}", {"pid": os.getpid()})
            wait_for(f"faulted{fault['k']}")  # stopped meanwhile, then continued
            return
        if kind == "raise":
            raise RuntimeError(f"injected failure at {p} on rank {rank}")
        if kind == "slow":
            time.sleep(slow_s)
        if kind == "die":
            sys.stdout.flush()
            os._exit(9)

    return hook


def edit_own_elements(module: torch.nn.Module, seed: int) -> None:
    """Structured edits of a few elements of this rank's own ZeRO-3 partition of every weight matrix, exact in float32
    (``helpers.edit_a_few``): a sign flip, a scaling by 2 or 1/2, two elements swapped, four permuted.
    A few elements in thousands: the sync after a committed one sends them as elements; and they change what the
    model generates, so that versions differ."""
    g = torch.Generator().manual_seed(seed * 10 + dist.get_rank())
    with torch.no_grad():
        for p in module.parameters():
            if len(p.ds_shape) < 2:  # the whole shape: a partitioned parameter's own is empty
                continue
            edit_a_few(own_elements(p), g, halve_sometimes=True)


def main() -> None:
    global MARKERS
    from transformers import AutoModelForCausalLM

    plan = json.loads(open(sys.argv[1]).read())
    url_a, url_b, ckpt, MARKERS = sys.argv[2:6]
    urls = [url_a, url_b]
    t = plan["timeouts"]
    if "margin" in t:  # the sink's slack on its computed waits (10 s): shorter, so that a slow rank sleeps less
        import lora_stream.sinks.vllm_server as server_sink

        server_sink._MARGIN_S = t["margin"]
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    signal(f"pid.rank{rank}", {"pid": os.getpid()})
    elements = bool(plan.get("elements", False))
    if elements:  # full fine-tuning: every parameter trainable, each partitioned (stage3_param_persistence_threshold 0)
        pm = AutoModelForCausalLM.from_pretrained(ckpt)
    else:
        pm = lora(
            AutoModelForCausalLM.from_pretrained(ckpt), target_modules="all-linear", lora_alpha=16, seed=plan["seed"]
        )
    template = copy.deepcopy(pm)
    opt = torch.optim.SGD([p for p in pm.parameters() if p.requires_grad], lr=0.5)
    engine, *_ = deepspeed.initialize(model=pm, optimizer=opt, config=ZERO3_CONFIG)
    sink = VLLMServerSink(
        urls,
        rank=rank,
        timeout=t["sink"],
        prefix_cache_timeout=t["prefix_cache"],
        lease=t["lease"],
        merge=plan.get("merge", "trainer"),
        elements=elements,
    )
    for fault in plan["rounds"]:
        k = fault["k"]
        if elements:
            # A step of SGD would move every float32 element (the sync would go whole): a few elements instead.
            edit_own_elements(engine.module, plan["seed"] * 1000 + k)
        else:
            engine.backward(engine(input_ids=IDS, labels=IDS).loss)
            engine.step()
        stream = ParamStream(engine, group_by="layer", timeout=t["stream"])
        wait_s, deadline_s = sink.wait_s(stream), sink.deadline_s(stream)
        set_fault_hook(hook_for(fault, rank, wait_s + t["slow_extra"]))
        start = time.monotonic()
        out: dict = {"k": k, "rank": rank, "fault": fault, "wait_s": wait_s, "deadline_s": deadline_s}  # type: ignore[type-arg]
        try:
            record = sink.sync(stream, version=f"v{k}-{plan['seed']}")
            out.update(committed=True, replicas=list(record.replicas), resume_failure=record.resume_failure)
            if elements:
                out.update(
                    elements=record.elements.get("tensors", 0) > 0,
                    element_tensors=record.elements.get("tensors", 0),
                    changed=record.elements.get("changed", 0),
                    full_because=record.full_because,
                    elements_refused=record.elements.get("refused"),
                    tensors=record.tensors,
                    skipped=record.skipped_tensors,
                )
        except Exception as exc:  # every failure must be a raise on every rank, never a hang
            out.update(committed=False, error=type(exc).__name__, message=str(exc)[:600])
        finally:
            set_fault_hook(None)
        out["seconds"] = time.monotonic() - start
        if out["committed"]:
            # The served policy is the trainer's: every rank builds the merged reference (a collective), each checks
            # the server it feeds (after the driver had no chance to touch it). Full fine-tuning: its own weights.
            expected = zero3_whole_into(engine, template)
            if not elements:
                expected = copy.deepcopy(expected).float().merge_and_unload()
            try:
                assert_vllm_serves(server_generate(urls[rank]), expected)
                out["serves_trainer"] = True
            except AssertionError as exc:
                out["serves_trainer"] = False
                out["mismatch"] = str(exc)[:300]
        signal(f"round{k}.rank{rank}", out)
        if wait_for(f"go{k}", "exit") == "exit":
            break
    finish(0)


if __name__ == "__main__":
    main()
