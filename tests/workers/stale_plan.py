"""Rank worker: a reused stream after the model's adapter state changed, on 2 gloo processes.

Usage: stale_plan.py KIND  (``fsdp2`` or ``zero3``)

One stream is planned. A no-grad forward changes nothing: the stream still yields what it yielded. After each
change -- ``set_adapter("b")``, ``merge_adapter()``, ``disable_adapter()``, ``set_scale`` -- on both ranks, a pass
over the same stream must raise ``StalePlanError`` on both ranks and yield nothing; after the change is undone, the
stream yields bitwise what it yielded before. A change on rank 1 alone raises ``StalePlanError`` there and
``StreamAbortedError`` naming rank 1 on rank 0. A stream planned after ``set_adapter("b")`` yields peft's merge of
``b``. Each outcome is one RESULT {json} line.
"""

from __future__ import annotations

import contextlib
import copy
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from helpers import finish, lora, oracle, perturb_adapters, rel_err, report, tiny_llama
from peft import LoraConfig

from lora_stream import ParamStream, StreamAbortedError
from lora_stream.errors import StalePlanError

LAYERS = 3


def _model() -> Any:
    model = lora(tiny_llama(layers=LAYERS), target_modules=["q_proj", "v_proj", "down_proj"])
    model.add_adapter(
        "b", LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False)
    )
    perturb_adapters(model, seed=3)
    return model


def _shard(model: Any, kind: str) -> tuple[Any, Callable[[], contextlib.AbstractContextManager[Any]]]:
    """The trainer's model under ``kind``, and a context in which peft may write its base weights in place."""
    if kind == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for n, m in model.named_modules():
            if n.endswith(tuple(f"layers.{i}" for i in range(LAYERS))):
                fully_shard(m, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, contextlib.nullcontext
    import deepspeed
    from helpers import zero3_engine

    engine = zero3_engine(model)
    params = list(engine.module.parameters())
    return engine, lambda: deepspeed.zero.GatheredParameters(params, modifier_rank=0)


def _layers(peft_model: Any) -> Iterator[Any]:
    from peft.tuners.lora import LoraLayer

    return (m for m in peft_model.modules() if isinstance(m, LoraLayer))


def _pass(stream: ParamStream) -> tuple[str, dict[str, torch.Tensor], Any]:
    try:
        return "ok", {n: t.clone() for n, t in stream}, None
    except StalePlanError as exc:
        return "stale", {}, exc
    except StreamAbortedError as exc:
        return "aborted", {}, exc


def main() -> None:
    kind = sys.argv[1]
    if kind == "zero3":
        import deepspeed

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        deepspeed.init_distributed(dist_backend="gloo")
    else:
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = _model()
    reference = copy.deepcopy(model)
    target, writable = _shard(model, kind)
    peft_model = target.module if kind == "zero3" else target

    stream = ParamStream(target, layout="memory", timeout=60)
    outcome, first, _ = _pass(stream)
    report(rank=rank, event="first", outcome=outcome, tensors=len(first))
    # A forward without a backward (an eval or logprob pass; the verification's probe) is no change: FSDP2 leaves
    # the root's parameters unsharded then, registered as other objects.
    with torch.no_grad():
        target(input_ids=torch.tensor([[1, 2, 3, 4]]))
    outcome, again, exc = _pass(stream)
    report(
        rank=rank,
        event="after-forward",
        outcome=outcome,
        message=str(exc)[:400] if exc is not None else None,
        same=outcome == "ok" and all(torch.equal(again[n], first[n]) for n in first),
    )

    def set_scale(scale: float) -> None:
        for layer in _layers(peft_model):
            layer.set_scale("default", scale)

    def merge() -> None:
        with writable():
            peft_model.merge_adapter()

    def unmerge() -> None:
        with writable():
            peft_model.unmerge_adapter()

    changes: list[tuple[str, Callable[[], Any], Callable[[], Any]]] = [
        ("set_adapter", lambda: peft_model.set_adapter("b"), lambda: peft_model.set_adapter("default")),
        ("merge_adapter", merge, unmerge),
        ("set_scale", lambda: set_scale(2.0), lambda: set_scale(1.0)),
    ]
    for name, change, undo in changes:
        change()
        outcome, got, exc = _pass(stream)
        undo()
        again, after, _ = _pass(stream)
        report(
            rank=rank,
            event=name,
            outcome=outcome,
            yielded=len(got),
            message=str(exc)[:400] if exc is not None else None,
            again=again,
            same_after_undo=again == "ok" and all(torch.equal(after[n], first[n]) for n in first),
        )
    with peft_model.disable_adapter():
        outcome, got, exc = _pass(stream)
    report(rank=rank, event="disable_adapter", outcome=outcome, yielded=len(got), message=str(exc)[:400])

    # A change on one rank only: that rank refuses, the other learns it at the first exchange.
    if rank == 1:
        peft_model.set_adapter("b")
    outcome, got, exc = _pass(stream)
    failed = list(getattr(exc, "failed_ranks", ()))
    report(rank=rank, event="one-rank", outcome=outcome, yielded=len(got), failed=failed, message=str(exc)[:400])
    if rank == 1:
        peft_model.set_adapter("default")

    # Planned again after set_adapter: the merge of b, as peft computes it.
    peft_model.set_adapter("b")
    reference.set_adapter("b")
    expected = oracle(reference)
    outcome, got, _ = _pass(ParamStream(target, layout="memory", timeout=60))
    errors = [rel_err(got[n], expected[n]) for n in expected] if outcome == "ok" else []
    report(
        rank=rank,
        event="replanned",
        outcome=outcome,
        names_match=list(got) == list(expected),
        max_rel_err=max(errors, default=None),
    )
    finish(0)


if __name__ == "__main__":
    main()
