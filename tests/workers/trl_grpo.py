"""Rank worker: a real TRL GRPOTrainer (colocated vLLM, LoRA) whose weight sync goes through lora_stream's hook.

Usage: trl_grpo.py SCENARIO WORKDIR

  hook      GRPO with the hook for 3 steps. After every sync, the logprobs vLLM assigns to a fixed probe equal the
            trainer's merged model's (transformers, merge_and_unload() of a copy), and they change between syncs.
            One process, or every rank of a 2-process run: DDP, or ZeRO-3 with LORA_STREAM_TEST_ZERO3=1 (vLLM
            external_launcher, one engine per rank).
  trl-own   the same trainer with TRL's own sync: reports how it ends.
  removed   the hook installed, then removed: TRL's own sync is back (reports how it ends).
  server    server mode against the vLLM server at LORA_STREAM_TEST_SERVER (lora_stream's gloo backend), the trainer
            built inside without_trl_transfer_group(); after every sync rank 0 compares the server's prompt logprobs
            of the probe (/v1/completions, echo) with the merged model's.
  adapter   the hook with adapter=True: only the LoRA factors go into vLLM's LoRA manager (colocate: the trainer built
            inside trl_vllm_with_lora; server mode when LORA_STREAM_TEST_SERVER is set, against a server started
            with --enable-lora); the same checks as hook/server, through the adapter.
  measure   ZeRO-3, at the first sync: the most bytes held gathered during TRL's own gather-and-merge (its
            _iter_named_params, without the load that fails on this vLLM) and during the hooked sync, every rank.

The model is saved by rank 0 into WORKDIR/model before the trainer is built (TRL's colocated LLM loads it by path).
"""

from __future__ import annotations

import copy
import json
import os
import sys
import time
import warnings

import torch

warnings.filterwarnings("ignore")
PROBE = [1, 17, 42, 99, 5, 7, 300, 12, 64, 8]
# TRL starts vLLM without a dtype, so vLLM on CPU runs the float32 checkpoint in bfloat16 (its "auto" downcast):
# against the float32 reference that is ~0.05 nats of noise, while one GRPO step here moves the probe by ~1 nat.
TOL = 0.1
SERVER_TOL = 2e-3


def reward(completions: list[str], **_: object) -> list[float]:
    """A reward that differs between completions, so GRPO's advantages (and the updates) are not zero."""
    return [float(sum(int(t[1:]) for t in c.split() if t[1:].isdigit()) % 97) / 97 for c in completions]


LORA = {"r": 4, "lora_alpha": 16, "target_modules": "all-linear"}


def build_trainer(workdir: str, zero3: bool, adapter: bool = False) -> tuple[object, object]:
    """The trainer, and an unsharded peft model of the same structure to hold its weights for the reference (built
    before the DeepSpeed config exists: transformers would build it under zero.Init afterwards)."""
    from datasets import Dataset
    from helpers import ZERO3_CONFIG, save_for_vllm, vllm_llama
    from peft import LoraConfig
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    path = os.path.join(workdir, "model")
    rank = int(os.environ.get("RANK", "0"))
    if rank == 0 and not os.path.exists(os.path.join(path, "config.json")):
        save_for_vllm(vllm_llama(), path, tokenizer=True)
    while not os.path.exists(os.path.join(path, "tokenizer_config.json")):
        time.sleep(0.1)
    time.sleep(0.5)
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    template = get_peft_model(AutoModelForCausalLM.from_pretrained(path), LoraConfig(**LORA))  # type: ignore[arg-type]
    extra: dict[str, object] = {}
    server = os.environ.get("LORA_STREAM_TEST_SERVER")
    if server:
        extra.update(vllm_mode="server", vllm_server_base_url=server, vllm_server_timeout=60)
    else:
        extra.update(vllm_mode="colocate", vllm_gpu_memory_utilization=0.5, vllm_max_model_length=128)
    if zero3:
        import deepspeed

        # The shm comm op JIT-compiles with g++ for ~45 s on first use; plain gloo is all the tests need.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        extra["deepspeed"] = {
            **ZERO3_CONFIG,
            "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto",
        }
    args = GRPOConfig(
        output_dir=os.path.join(workdir, f"out{rank}"),
        use_cpu=True,
        use_vllm=True,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        max_steps=3,
        learning_rate=0.05,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        seed=0,
        **extra,
    )
    prompts = [f"t{i} t{i + 7} t{i + 3}" for i in range(3, 43)]
    from contextlib import nullcontext

    from lora_stream.integrations.trl import trl_vllm_with_lora, without_trl_transfer_group

    if server:
        context = without_trl_transfer_group()
    elif adapter:
        context = trl_vllm_with_lora(max_lora_rank=8)
    else:
        context = nullcontext()
    with context:
        trainer = GRPOTrainer(
            model=path,
            reward_funcs=reward,
            args=args,
            train_dataset=Dataset.from_dict({"prompt": prompts}),
            processing_class=AutoTokenizer.from_pretrained(path),
            peft_config=LoraConfig(**LORA),  # type: ignore[arg-type]
        )
    return trainer, template


def merged_logprobs(trainer: object, template: object, zero3: bool) -> list[float]:
    """The trainer's model, merged by peft on an unsharded float32 copy: logprobs of PROBE[1:]."""
    from helpers import zero3_whole_into

    model = trainer.model  # type: ignore[attr-defined]
    if zero3:  # a gather: every rank takes part
        model = zero3_whole_into(trainer.model_wrapped, template)  # type: ignore[arg-type,attr-defined]
    merged = copy.deepcopy(model).float().merge_and_unload().eval()
    with torch.no_grad():
        lp = torch.log_softmax(merged(torch.tensor([PROBE])).logits[0].float(), -1)
    return [float(lp[i - 1, PROBE[i]]) for i in range(1, len(PROBE))]


def server_logprobs(url: str, model: str | None = None) -> list[float]:
    """The server's logprobs of PROBE[1:], through /v1/completions (echo: the prompt's own logprobs); ``model``
    names a LoRA adapter (default: the base model)."""
    import requests

    model = model or requests.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
    payload = {"model": model, "prompt": PROBE, "max_tokens": 1, "echo": True, "logprobs": 0, "temperature": 0}
    choice = requests.post(f"{url}/v1/completions", json=payload, timeout=60).json()["choices"][0]
    return [float(x) for x in choice["logprobs"]["token_logprobs"][1 : len(PROBE)]]


def vllm_logprobs(llm: object) -> list[float]:
    from vllm import SamplingParams

    (out,) = llm.generate(  # type: ignore[attr-defined]
        [{"prompt_token_ids": PROBE}], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False
    )
    return [float(out.prompt_logprobs[i][PROBE[i]].logprob) for i in range(1, len(PROBE))]


def report(**fields: object) -> None:
    # On a line of its own: the trainer's progress bar leaves the cursor mid-line.
    print("\nRESULT " + json.dumps(fields, default=str), flush=True)


def main(scenario: str, workdir: str) -> None:
    from helpers import VLLM_ENV, finish

    for k, v in VLLM_ENV.items():
        os.environ.setdefault(k, v)
    zero3 = os.environ.get("LORA_STREAM_TEST_ZERO3") == "1"
    server_url = os.environ.get("LORA_STREAM_TEST_SERVER")
    trainer, template = build_trainer(workdir, zero3, adapter=scenario == "adapter")
    rank = int(os.environ.get("RANK", "0"))
    gen = trainer.vllm_generation  # type: ignore[attr-defined]
    from lora_stream.integrations.trl import use_lora_stream

    params = list(trainer.model.parameters())  # type: ignore[attr-defined]
    report(
        rank=rank,
        event="built",
        deepspeed=bool(getattr(trainer, "is_deepspeed_enabled", False)),
        partitioned=all(hasattr(p, "ds_id") for p in params),
    )
    if scenario in ("hook", "removed", "measure", "server", "adapter"):
        hook = use_lora_stream(trainer, adapter=scenario == "adapter", lora_name="policy")
        assert use_lora_stream(trainer) is hook, "a second call returns the installed hook"
        if scenario == "removed":
            hook.remove()
            assert "sync_weights" not in vars(gen) and not hook.active
    checks: list[dict[str, object]] = []
    if scenario == "measure":
        synced = gen.sync_weights

        def measured() -> None:
            if not checks:
                checks.append(measure(trainer, gen, synced))
            else:
                synced()

        gen.sync_weights = measured
    via_server = scenario == "server" or (scenario == "adapter" and server_url is not None)
    if scenario in ("hook", "server", "adapter"):
        synced = gen.sync_weights

        def checked() -> None:
            synced()
            expected = merged_logprobs(trainer, template, zero3)
            if via_server and rank != 0:
                return
            adapter_name = "policy" if scenario == "adapter" else None
            # Colocated, the hook's generate adds the adapter's LoRARequest itself.
            got = server_logprobs(str(server_url), adapter_name) if via_server else vllm_logprobs(gen.llm)
            err = max(abs(a - b) for a, b in zip(got, expected))
            wrapped = type(trainer.model_wrapped).__name__  # type: ignore[attr-defined]
            step = trainer.state.global_step  # type: ignore[attr-defined]
            checks.append({"step": step, "max_err": err, "logprobs": got, "wrapped": wrapped})

        gen.sync_weights = checked
    try:
        trainer.train()  # type: ignore[attr-defined]
    except Exception as exc:
        import traceback

        trace = traceback.format_exc()[-6000:]
        error, message = type(exc).__name__, str(exc)[:500]
        report(rank=rank, scenario=scenario, outcome="raised", error=error, message=message, trace=trace)
        finish(0)
    records = [r.tensors for r in hook.records] if scenario in ("hook", "measure", "server", "adapter") else []
    # The server runs float32 (--dtype float32): there the colocated tests' tolerance applies.
    tol = SERVER_TOL if via_server else TOL
    report(rank=rank, scenario=scenario, outcome="trained", checks=checks, records=records, tol=tol)
    finish(0)


def measure(trainer: object, gen: object, hooked_sync: object) -> dict[str, object]:
    """Peak bytes ZeRO-3 holds gathered during TRL's own gather-and-merge (its ``_iter_named_params``, without the
    ``load_weights`` that fails on this vLLM) and during the hooked sync, sampled at every tensor either yields."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    from lora_stream.integrations.trl import TrlSyncHook

    params = list(trainer.model.parameters())  # type: ignore[attr-defined]

    def gathered() -> int:
        return sum(p.ds_numel * p.element_size() for p in params if p.ds_status == ZeroParamStatus.AVAILABLE)

    total = sum(p.ds_numel * p.element_size() for p in params)
    peak_trl = 0
    for _name, _tensor in gen._iter_named_params():  # type: ignore[attr-defined]
        peak_trl = max(peak_trl, gathered())
    hook = gen._lora_stream_hook  # type: ignore[attr-defined]
    assert isinstance(hook, TrlSyncHook)
    from lora_stream import ParamStream

    stream = ParamStream(hook._model(), group_by="layer")
    peak_hook = 0
    for _name, _tensor in stream:
        peak_hook = max(peak_hook, gathered())
    hooked_sync()  # type: ignore[operator]
    return {
        "total_bytes": total,
        "trl_peak_gathered": peak_trl,
        "hook_peak_gathered": peak_hook,
        "hook_bound": max(stream.group_gathered_bytes),
        "record_peak_gathered": hook.records[-1].peak_gathered_bytes,
    }


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
