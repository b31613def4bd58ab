"""Rank worker for the verl tests: the REAL verl 0.9.1 FSDP engine, built on 2 gloo ranks on CPU through verl's own
config files, ``model.external_lib`` and ``EngineRegistry``, as verl's ``TrainingWorker`` builds it (without Ray).

Usage: verl_engine.py SCENARIO MODEL_DIR

Scenarios:
  merged   ``lora.merge=True``: a Llama (fp32, bf16, offloaded) and a tied-embedding Qwen2, LoRA r=8 on all
           linear layers, every adapter tensor perturbed before each of 20 syncs. Every sync's stream ``==`` peft's
           ``merge_and_unload()`` of the same weights in float32 (cast to bf16, the actor's dtype), under the names
           of verl's own export; the training shards bitwise unchanged by each sync; the gathered peak bounded by
           the largest layer. Then verl's own in-place export (``merged_lora_context``) 20 times on the same
           engine, for comparison: its values against the same oracle, and its drift. A sync inside verl's
           ``disable_adapter()`` exports the base, the next one the merge. Refusals: FSDP1 and QAT, before anything
           is built.
  adapter  ``lora.merge=False`` (verl's adapter-only sync): lora_A and lora_B (scaled) against verl's own
           ``collect_lora_params``, the peft config's scaling 1, and the base export (verl's own). Each of the 3
           exports is a sync a user sees: its line on rank 0's stderr, its record and figures on the engine.
  raise    rank 1's consumer raises at the fifth tensor of a merged sync: rank 0 raises too, naming rank 1.
"""

from __future__ import annotations

import copy
import os
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))  # tests_verl: the CPU platform
os.environ.setdefault("VERL_PLATFORM", "cpu")
os.environ.setdefault("VERL_ENGINE_DEVICE", "cuda")

import cpu_platform  # noqa: F401  (registers verl's CPU platform before verl picks one)
import torch
import torch.distributed as dist
from helpers import finish, report, report_aborted, save_tokenizer

SYNCS = 20
LORA_RANK = 8
LORA_ALPHA = 16

#: What a user writes on verl's command line (hydra overrides of verl's own trainer config). The first line is the
#: one lora_stream needs; the rest make the tiny model train on CPU (SDPA instead of FlashAttention, no
#: torch.compile), as verl's docs describe those options.
USER_LINES = [
    "actor_rollout_ref.model.external_lib=lora_stream.integrations.verl",
    f"actor_rollout_ref.model.lora_rank={LORA_RANK}",
    f"actor_rollout_ref.model.lora_alpha={LORA_ALPHA}",
    "actor_rollout_ref.model.target_modules=all-linear",
    "actor_rollout_ref.actor.strategy=fsdp2",
    "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
    "actor_rollout_ref.actor.fsdp_config.use_torch_compile=False",
    "actor_rollout_ref.actor.use_torch_compile=False",
    "actor_rollout_ref.actor.ppo_mini_batch_size=2",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
]


def save_model(path: str, kind: str) -> str:
    """A tiny random model saved where verl's ``model.path`` points (rank 0 writes, every rank waits)."""
    out = os.path.join(path, kind)
    if dist.get_rank() == 0 and not os.path.exists(os.path.join(out, "config.json")):
        from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

        torch.manual_seed(0)
        shape = dict(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=6,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
        if kind == "llama":
            model = LlamaForCausalLM(LlamaConfig(**shape, tie_word_embeddings=False))
        else:
            model = Qwen2ForCausalLM(Qwen2Config(**shape, tie_word_embeddings=True))
        model.save_pretrained(out)
        save_tokenizer(out, vocab=256, pad_token="t3")  # verl's model config loads the tokenizer next to the weights
    dist.barrier()
    return out


def build_engine(model_dir: str, *extra: str) -> object:
    """verl's trainer config + the user's lines, converted and built exactly as verl's ``TrainingWorker`` does."""
    import verl
    from omegaconf import OmegaConf
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.engine import EngineRegistry

    base = OmegaConf.load(pathlib.Path(verl.__file__).parent / "trainer" / "config" / "_generated_ppo_trainer.yaml")
    lines = [f"actor_rollout_ref.model.path={model_dir}", *USER_LINES, *extra]
    OmegaConf.set_struct(base, True)
    with_plus = [line[1:] for line in lines if line.startswith("+")]
    plain = [line for line in lines if not line.startswith("+")]
    config = OmegaConf.merge(base, OmegaConf.from_dotlist(plain))
    OmegaConf.set_struct(config, False)
    config = OmegaConf.merge(config, OmegaConf.from_dotlist(with_plus))
    section = config.actor_rollout_ref
    model_config = omega_conf_to_dataclass(section.model)  # imports model.external_lib
    actor = omega_conf_to_dataclass(section.actor)
    engine = EngineRegistry.new(
        model_type="language_model",
        backend=actor.engine.strategy,
        model_config=model_config,
        engine_config=actor.engine,
        optimizer_config=actor.optim,
        checkpoint_config=actor.checkpoint,
    )
    engine.initialize()
    return engine


def local_shards(engine: object) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {
        n: (p.to_local() if isinstance(p, DTensor) else p).detach().clone()
        for n, p in engine.module.named_parameters()  # type: ignore[attr-defined]
    }


def assert_shards_equal(engine: object, before: dict[str, torch.Tensor], what: str) -> None:
    after = local_shards(engine)
    changed = [n for n in before if not torch.equal(before[n], after[n])]
    assert not changed, f"rank {dist.get_rank()}: {what} changed {changed[:5]}"


def perturb_adapters(engine: object, seed: int) -> None:
    """A training step's worth of change to every adapter tensor (peft starts lora_B at zero, which hides a wrong
    merge): each rank writes its own shard of the same whole random tensor."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in engine.module.named_parameters():  # type: ignore[attr-defined]
            if not p.requires_grad:
                continue
            whole = torch.randn(p.shape, generator=gen, dtype=torch.float32).to(p.dtype) * 0.3
            if isinstance(p, DTensor):
                p.to_local().copy_(distribute_tensor(whole, p.device_mesh, p.placements).to_local())
            else:
                p.copy_(whole)


def oracle(engine: object, model_dir: str) -> dict[str, torch.Tensor]:
    """peft's ``merge_and_unload()`` of the engine's current weights, gathered whole (every rank computes it)."""
    from peft import get_peft_model
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM

    module = engine.module  # type: ignore[attr-defined]
    whole = {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in module.named_parameters()
    }
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ref = get_peft_model(ref, copy.deepcopy(module.peft_config["default"]))
    missing, unexpected = ref.load_state_dict(whole, strict=False)
    assert not unexpected and not [m for m in missing if m in dict(ref.named_parameters())], (missing, unexpected)
    return {n: t.detach().clone() for n, t in ref.merge_and_unload().state_dict().items()}


def drain(gen: object) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, tensor in gen:  # type: ignore[attr-defined]
        assert name not in out, f"{name} yielded twice"
        out[name] = tensor.detach().clone()
    return out


def unequal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> tuple[int, float]:
    """How many tensors differ from the oracle (cast to each tensor's dtype), and the largest absolute difference."""
    bad, worst = 0, 0.0
    for name, t in got.items():
        ref = want[name].to(t.dtype)
        if not torch.equal(t, ref):
            bad += 1
            worst = max(worst, (t.float() - ref.float()).abs().max().item())
    return bad, worst


def largest_module_bytes(engine: object) -> tuple[int, int]:
    """Whole bytes of the largest decoder layer (or embedding / head / norm) and of the whole model."""
    per: dict[str, int] = {}
    for n, p in engine.module.named_parameters():  # type: ignore[attr-defined]
        parts = n.split(".")
        key = ".".join(parts[: parts.index("layers") + 2]) if "layers" in parts else parts[-2]
        per[key] = per.get(key, 0) + p.numel() * p.element_size()
    return max(per.values()), sum(per.values())


def scenario_merged(root: str) -> None:
    from verl.workers.engine import EngineRegistry
    from verl.workers.engine.fsdp import FSDPEngineWithLMHead

    from lora_stream.integrations.verl import LoraStreamFSDPEngine, UnsupportedVerlError

    # Refused at build time, before verl builds anything: FSDP1 and QAT.
    llama = save_model(root, "llama")
    for extra, needle in (
        (["actor_rollout_ref.actor.strategy=fsdp"], "strategy is 'fsdp' (verl's default: FSDP1"),
        (["actor_rollout_ref.actor.fsdp_config.qat.enable=True"], "QAT"),
    ):
        try:
            build_engine(llama, "actor_rollout_ref.model.lora.merge=True", *extra)
        except UnsupportedVerlError as exc:
            assert needle in str(exc) and f"rank {dist.get_rank()}" in str(exc), str(exc)
            report(rank=dist.get_rank(), event="refused", what=extra[0], message=str(exc))
        else:
            raise AssertionError(f"{extra} was not refused")

    for label, kind, extra in (
        ("llama", "llama", []),
        ("qwen2-tied", "qwen2-tied", []),
        # Training weights held in bf16 (verl's memory-saving option): the merge still runs in float32 here.
        ("llama-bf16", "llama", ["actor_rollout_ref.actor.fsdp_config.model_dtype=bf16"]),
        # verl offloads the shards between steps: the export stages them as verl's own does.
        ("llama-offload", "llama", ["actor_rollout_ref.actor.fsdp_config.param_offload=True"]),
    ):
        model_dir = save_model(root, kind)
        engine = build_engine(model_dir, "actor_rollout_ref.model.lora.merge=True", *extra)
        assert type(engine) is LoraStreamFSDPEngine, type(engine)
        assert EngineRegistry.get_engine_cls("language_model", "fsdp2") is LoraStreamFSDPEngine
        layer_bytes, model_bytes = largest_module_bytes(engine)

        frozen = {n for n, p in engine.module.named_parameters() if not p.requires_grad}  # type: ignore[attr-defined]
        start_shards = local_shards(engine)
        worst_peak = 0
        names: set[str] = set()
        seconds = 0.0
        for step in range(SYNCS):
            perturb_adapters(engine, seed=100 + step)  # the training step: only the adapter moves
            before = local_shards(engine)
            want = oracle(engine, model_dir)
            t0 = time.perf_counter()
            gen, peft_config = engine.get_per_tensor_param()
            got = drain(gen)
            seconds += time.perf_counter() - t0
            assert peft_config is None
            assert set(got) == set(want), (sorted(set(got) ^ set(want)))[:6]
            assert all(t.dtype == torch.bfloat16 for t in got.values()), {t.dtype for t in got.values()}
            bad, worst = unequal(got, want)
            assert bad == 0, f"rank {dist.get_rank()} step {step}: {bad} tensors differ from the oracle ({worst})"
            assert_shards_equal(engine, before, f"sync {step}")
            worst_peak = max(worst_peak, engine._stream.last_stats.peak_gathered_bytes)  # type: ignore[attr-defined]
            names = set(got)
        frozen_after = local_shards(engine)
        assert all(torch.equal(start_shards[n], frozen_after[n]) for n in frozen)
        if label == "llama":
            check_adapters_disabled_then_enabled(engine, model_dir)
        assert worst_peak <= layer_bytes < model_bytes / 3, (worst_peak, layer_bytes, model_bytes)
        report(
            rank=dist.get_rank(),
            event="merged-exact",
            model=label,
            syncs=SYNCS,
            tensors=len(names),
            peak_gathered_bytes=worst_peak,
            largest_layer_bytes=layer_bytes,
            model_bytes=model_bytes,
            seconds_per_sync=seconds / SYNCS,
        )

        # verl's own merged export on the same engine and weights, for comparison (its in-place merge).
        before = local_shards(engine)
        want = oracle(engine, model_dir)
        verl_bad, verl_worst, verl_names = 0, 0.0, set()
        t0 = time.perf_counter()
        for _ in range(SYNCS):
            gen, _ = FSDPEngineWithLMHead.get_per_tensor_param(engine)
            got = drain(gen)
            bad, worst = unequal(got, want)
            verl_bad, verl_worst, verl_names = max(verl_bad, bad), max(verl_worst, worst), set(got)
        verl_seconds = (time.perf_counter() - t0) / SYNCS
        after = local_shards(engine)
        drifted = [n for n in before if not torch.equal(before[n], after[n])]
        drift = max(((before[n].float() - after[n].float()).abs().max().item() for n in drifted), default=0.0)
        report(
            rank=dist.get_rank(),
            event="verl-own",
            model=label,
            same_names=verl_names == names,
            names_only_ours=sorted(names - verl_names)[:5],
            names_only_verl=sorted(verl_names - names)[:5],
            tensors_unequal_to_oracle=verl_bad,
            max_abs_diff_to_oracle=verl_worst,
            shards_drifted=len(drifted),
            max_drift=drift,
            seconds_per_sync=verl_seconds,
        )
        del engine


def check_adapters_disabled_then_enabled(engine: object, model_dir: str) -> None:
    """The stream is planned once and reused; a sync inside verl's ``disable_adapter()`` (how verl computes the
    reference policy of a LoRA actor) must export the base, and the next sync the merged model again."""
    from torch.distributed.tensor import DTensor
    from verl.utils.fsdp_utils import normalize_peft_param_name

    whole = {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for n, p in engine.module.named_parameters()  # type: ignore[attr-defined]
    }
    base = normalize_peft_param_name(whole)
    with engine.disable_adapter():  # type: ignore[attr-defined]
        gen, _ = engine.get_per_tensor_param()  # type: ignore[attr-defined]
        got = drain(gen)
    assert set(got) == set(base), sorted(set(got) ^ set(base))[:6]
    bad, worst = unequal(got, base)
    assert bad == 0, f"rank {dist.get_rank()}: adapters disabled, {bad} tensors are not the base ({worst})"
    gen, _ = engine.get_per_tensor_param()  # type: ignore[attr-defined]
    bad, worst = unequal(drain(gen), oracle(engine, model_dir))
    assert bad == 0, f"rank {dist.get_rank()}: adapters enabled again, {bad} tensors differ from the merge ({worst})"
    report(rank=dist.get_rank(), event="replanned", tensors=len(got))


def scenario_adapter(root: str) -> None:
    from peft.utils import PeftType, TaskType
    from verl.workers.engine.fsdp import FSDPEngineWithLMHead

    model_dir = save_model(root, "llama")
    engine = build_engine(model_dir, "actor_rollout_ref.model.lora.merge=False")
    for step in range(3):
        perturb_adapters(engine, seed=200 + step)
        before = local_shards(engine)
        gen, config = engine.get_per_tensor_param(layered_summon=True, base_sync_done=True)
        got = drain(gen)
        assert_shards_equal(engine, before, f"adapter sync {step}")
        verl_gen, verl_config = FSDPEngineWithLMHead.get_per_tensor_param(engine, base_sync_done=True)
        theirs = {n: t.detach().clone() for n, t in dict(verl_gen).items()}
        assert set(got) == set(theirs), sorted(set(got) ^ set(theirs))[:6]
        scaling = LORA_ALPHA / LORA_RANK
        for name, t in got.items():
            if ".lora_A." in name:
                assert torch.equal(t, theirs[name]), name
            else:
                assert ".lora_B." in name, name
                assert torch.equal(t, (theirs[name].float() * scaling).to(theirs[name].dtype)), name
        assert config["peft_type"] is PeftType.LORA and config["task_type"] is TaskType.CAUSAL_LM, config
        assert config["r"] == config["lora_alpha"] == LORA_RANK and not config["use_rslora"], config
        assert verl_config["lora_alpha"] == LORA_ALPHA
        assert {k: v for k, v in config.items() if k not in ("lora_alpha",)} == {
            k: v for k, v in verl_config.items() if k not in ("lora_alpha",)
        }
    base_gen, _base_config = engine.get_per_tensor_param(base_sync_done=False)
    base = drain(base_gen)
    assert base and not any("lora_" in n for n in base), sorted(base)[:4]
    # Each of lora_stream's 3 exports logged its line (rank 0) and left its record and its figures for the next
    # training step's metrics; verl's own exports (base, comparison) are not lora_stream's syncs.
    record = engine.last_record  # type: ignore[attr-defined]
    report(
        rank=dist.get_rank(),
        event="adapter-exact",
        tensors=len(got),
        base_tensors=len(base),
        sync_version=record.version if record is not None else None,
        sync_tensors=record.tensors if record is not None else None,
        sync_figures=record.metrics() if record is not None else None,
        pending_figures=engine._unreported,  # type: ignore[attr-defined]
    )


def scenario_raise(root: str) -> None:
    from lora_stream import StreamAbortedError

    model_dir = save_model(root, "llama")
    engine = build_engine(model_dir, "actor_rollout_ref.model.lora.merge=True")
    perturb_adapters(engine, seed=7)

    def send_weights() -> None:  # what verl's CheckpointEngine.send_weights does with the generator
        gen, _ = engine.get_per_tensor_param()
        for i, (_name, _tensor) in enumerate(gen):
            if dist.get_rank() == 1 and i == 4:
                raise ValueError("the consumer on rank 1 failed at the fifth tensor")

    start = time.monotonic()
    failure = None
    try:
        send_weights()
    except ValueError as exc:
        failure = str(exc)
    except StreamAbortedError as exc:
        report_aborted(exc, start)
    if failure is None:
        finish(4)
    # The exception has been handled, as verl's worker handles a failed update_weights, and this rank stays up:
    # rank 0 must learn of the failure from the stream itself, not from this process dying.
    report(rank=dist.get_rank(), event="consumer-raised", message=failure)
    time.sleep(8)
    finish(0)


def main() -> None:
    scenario, root = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    {"merged": scenario_merged, "adapter": scenario_adapter, "raise": scenario_raise}[scenario](root)
    dist.barrier()
    finish(0)


if __name__ == "__main__":
    main()
