"""Rank worker: adapter sync from a ZeRO-3 trainer into an external_launcher vLLM engine (TP=2 across the ranks).

Usage: vllm_lora_dist.py SCENARIO CHECKPOINT_DIR
  steps  LoRA on all linear layers; three optimizer steps, an adapter sync after each: what vLLM serves through the
         returned LoRARequest equals the merged trainer model every time, and changes between steps. While each
         sync runs, no base parameter of the ZeRO-3 model is ever gathered (ds_status probed at every group).
  fail   rank 1's consumer fails in the middle of the second sync: both ranks raise, nobody hangs, and both engines
         keep serving the first version.
"""

from __future__ import annotations

import copy
import os
import sys
import time
from typing import ClassVar

for _k, _v in {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}.items():
    os.environ.setdefault(_k, _v)

import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus  # noqa: E402
from helpers import (  # noqa: E402
    ZERO3_CONFIG,
    assert_vllm_serves,
    lora,
    report,
    vllm_engine,
    vllm_generate,
    zero3_whole_into,
)

from lora_stream import AdapterStream, StreamAbortedError, VLLMLoRASink  # noqa: E402

deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def reference(engine, template: torch.nn.Module) -> torch.nn.Module:  # type: ignore[no-untyped-def]
    return copy.deepcopy(zero3_whole_into(engine, template)).float().merge_and_unload()


class BaseProbe(AdapterStream):
    """Checks at every group that no base parameter is gathered, and counts the groups."""

    base: ClassVar[list[torch.nn.Parameter]] = []
    checked = 0
    fail_at: int | None = None

    def iter_groups(self):  # type: ignore[no-untyped-def,override]
        for i, batch in enumerate(super().iter_groups()):
            gathered = [p for p in self.base if p.ds_status != ZeroParamStatus.NOT_AVAILABLE]
            assert not gathered, f"{len(gathered)} base parameters gathered during an adapter sync"
            BaseProbe.checked += 1
            if self.fail_at is not None and i == self.fail_at:
                raise RuntimeError("injected consumer failure on rank 1")
            yield batch


def main() -> None:
    from transformers import LlamaForCausalLM

    scenario, path = sys.argv[1], sys.argv[2]
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    llm = vllm_engine(
        path,
        tensor_parallel_size=2,
        distributed_executor_backend="external_launcher",
        enable_lora=True,
        max_lora_rank=16,
        max_loras=1,
    )
    pm = lora(LlamaForCausalLM.from_pretrained(path), target_modules="all-linear", lora_alpha=32)
    template = copy.deepcopy(pm)
    opt = torch.optim.SGD([p for p in pm.parameters() if p.requires_grad], lr=0.5)
    engine, *_ = deepspeed.initialize(model=pm, optimizer=opt, config=ZERO3_CONFIG)
    BaseProbe.base = [p for n, p in engine.module.named_parameters() if "lora_" not in n]
    assert BaseProbe.base and all(p.ds_status == ZeroParamStatus.NOT_AVAILABLE for p in BaseProbe.base)
    sink = VLLMLoRASink(llm, lora_name="policy")
    assert sink.in_process
    ids = torch.tensor([[1, 17, 42, 99, 5, 7, 300]])

    def step() -> None:
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()

    if scenario == "fail":
        record = sink.sync(BaseProbe(engine, group_by="module"))
        before = vllm_generate(llm, record.lora_request)
        step()
        start = time.monotonic()
        failing = BaseProbe(engine, group_by="module")
        failing.fail_at = 3 if rank == 1 else None
        try:
            sink.sync(failing, version="2")
        except (RuntimeError, StreamAbortedError) as exc:
            report(
                rank=rank, event="raised", error=type(exc).__name__, message=str(exc), seconds=time.monotonic() - start
            )
            assert vllm_generate(llm, record.lora_request) == before, "the engine must keep the previous adapter"
            assert sink.version is None
            report(rank=rank, event="engine-kept-previous")
            return
        raise AssertionError("the sync should have raised")

    served = []
    for k in range(3):
        step()
        record = sink.sync(BaseProbe(engine, group_by="module"), version=str(k))
        out = vllm_generate(llm, record.lora_request)
        assert_vllm_serves(out, reference(engine, template))
        served.append(out)
    assert served[0] != served[1] != served[2], "every optimizer step should change what vLLM serves"
    assert vllm_generate(llm) != served[-1], "without the LoRARequest vLLM serves the base model"
    report(
        rank=rank,
        event="adapter-serves-merged",
        tensors=record.tensors,
        bytes=record.bytes,
        groups_checked=BaseProbe.checked,
        peak_gathered=record.peak_gathered_bytes,
    )


if __name__ == "__main__":
    main()
