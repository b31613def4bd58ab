"""Rank worker: verification's probe forward leaves a sharded trainer as it found it.

Usage: probe_as_found.py GATHERER (zero3 or fsdp2), on 2 ranks.

A tiny Llama is sharded for training (:func:`helpers.train_sharded`), one of its decoder layers held in eval mode by
the trainer. Before each of 3 optimiser steps the probe (:func:`lora_stream.sinks.verify.trainer_logprobs`) runs.
Reported: whether the state the trainer depends on was the same after each probe as before it (every module's
training flag; under ZeRO-3 DeepSpeed's parameter coordinator, its trace mode and every parameter's status; under
FSDP2 every parameter's type and local shape), and the probe after the 3 steps, which the test compares with a run
without probes.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist


def snapshot(trainer: object, module: torch.nn.Module, gatherer: str) -> list[object]:
    state: list[object] = [(n, m.training) for n, m in module.named_modules()]
    state.append(getattr(trainer, "training", None))
    if gatherer == "zero3":
        offload = trainer.optimizer.parameter_offload  # type: ignore[attr-defined]
        coordinator = offload.param_coordinator
        state += [id(coordinator), coordinator.is_complete_trace(), coordinator.is_record_trace()]
        state += [str(p.ds_status) for p in module.parameters()]
    else:
        from torch.distributed.tensor import DTensor

        state += [
            (n, isinstance(p, DTensor), tuple(p.to_local().shape if isinstance(p, DTensor) else p.shape))
            for n, p in module.named_parameters()
        ]
    return state


def main(gatherer: str) -> None:
    from helpers import finish, report, train_sharded, vllm_llama

    from lora_stream.sinks.verify import trainer_logprobs

    dist.init_process_group("gloo")
    probe = os.environ.get("LORA_STREAM_TEST_PROBE", "1") == "1"
    model = vllm_llama()
    trainer, module, step = train_sharded(
        model, gatherer, lambda ps: torch.optim.AdamW(ps, lr=1e-3), shard=("layers.0", "layers.1")
    )
    module.model.layers[1].eval()  # the trainer's own choice, which the probe must keep
    same = []
    for _ in range(3):
        if probe:
            before = snapshot(trainer, module, gatherer)
            trainer_logprobs(trainer, [1, 5, 9, 200, 300])
            same.append(before == snapshot(trainer, module, gatherer))
        step()
    # What the 3 steps trained, the same with and without the probes between them.
    after, _ = trainer_logprobs(trainer, [1, 5, 9, 200, 300])
    report(rank=dist.get_rank(), same=same, trained=after.tolist(), layer1_eval=not module.model.layers[1].training)
    finish(0)


if __name__ == "__main__":
    main(sys.argv[1])
