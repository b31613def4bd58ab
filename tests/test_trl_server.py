"""The TRL hook in server mode, at install, in this process: against a stand-in of TRL's ``VLLMGeneration`` and
answers of a server stood in for at the client (nothing starts; tests/test_trl.py runs the real trainer against a
real server started with the documented command).

- the server must run lora_stream's weight-transfer engine: anything else is refused naming the exact command;
- the trainer must be built inside ``without_trl_transfer_group()``: otherwise refused naming the block;
- the sink's transport, store address and port come from TRL's own arguments (``sink_options`` override them).
"""

from __future__ import annotations

import shlex
import socket
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from helpers import require
from test_trl import _Generation, _peft, _trainer, _untouched

from lora_stream.integrations.trl import UnsupportedTrlError, server_command, trainer_address, use_lora_stream


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
    assert shlex.split(command)[:3] == ["VLLM_SERVER_DEV_MODE=1", "vllm", "serve"]
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
    source = (Path(__file__).resolve().parent.parent / "src/lora_stream/integrations/trl.py").read_text()
    assert "lora-stream[" not in source and "pip install lora-stream" not in source
    assert "pip install 'trl>=" in source
