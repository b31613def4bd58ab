"""TRL in one line: route a TRL trainer's vLLM weight sync through lora_stream.

>>> hook = use_lora_stream(trainer)  # doctest: +SKIP
>>> trainer.train()

after ``trainer = GRPOTrainer(...)`` with ``use_vllm=True`` (examples/grpo_trl.py runs it).

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

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from ..adapter import AdapterStream
from ..errors import LoraStreamError
from ..sinks.record import SyncRecord
from ..stream import ParamStream

__all__ = [
    "TESTED_TRL",
    "TrlSyncHook",
    "UnsupportedTrlError",
    "trl_vllm_with_lora",
    "without_trl_transfer_group",
    "use_lora_stream",
]

#: The TRL releases whose ``VLLMGeneration`` this hook was written against and tested with: ``[low, high)``.
TESTED_TRL = ("1.16.0", "1.17.0")


class UnsupportedTrlError(LoraStreamError):
    """The trainer's TRL is not one whose weight sync this hook knows how to replace (nothing was changed)."""


@dataclass
class TrlSyncHook:
    """The installed hook: ``records`` holds one :class:`~lora_stream.SyncRecord` per sync (this rank's view);
    :meth:`remove` restores TRL's own sync."""

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

    @property
    def generation(self) -> Any:
        return self.trainer.vllm_generation

    @property
    def active(self) -> bool:
        return getattr(self.generation, "_lora_stream_hook", None) is self

    def remove(self) -> None:
        """Restore TRL's own ``sync_weights`` (a no-op once removed)."""
        gen = self.generation
        if getattr(gen, "_lora_stream_hook", None) is self:
            del gen.sync_weights  # the instance attribute: the class's method shows through again
            del gen._lora_stream_hook
            llm = getattr(gen, "llm", None)
            if llm is not None and "generate" in vars(llm):
                del llm.generate
            if self._served_model is not None:
                gen.vllm_client.model = self._served_model
        if self._sink is not None and hasattr(self._sink, "close"):
            self._sink.close()
        self._sink = None

    def sync_weights(self) -> None:
        """What ``trainer.vllm_generation.sync_weights()`` does while the hook is installed."""
        gen = self.generation
        if gen.mode == "colocate" and getattr(gen, "enable_sleep_mode", False):
            # As TRL does: map the weights' memory again before loading into it.
            from trl.generation.vllm_generation import empty_cache

            empty_cache()
            gen.llm.wake_up(tags=["weights"])
            gen._llm_weights_sleeping = False
        if self.adapter:
            stream: ParamStream = AdapterStream(self._model(), **self.stream_options)
        else:
            stream = ParamStream(self._model(), **{"group_by": "layer", **self.stream_options})
        # The sink logs the record as one line; the version names the trainer's step. Every sink resets vLLM's
        # prefix cache after loading, as TRL's own sync does.
        record = self._get_sink().sync(stream, version=f"step-{self.trainer.state.global_step}")
        self.records.append(record)
        if self.adapter and gen.mode == "server" and self._served_model is None:
            # TRL's client names the model in every request; the adapter's name selects it on the server.
            self._served_model = gen.vllm_client.model
            gen.vllm_client.model = self.lora_name

    @property
    def lora_request(self) -> Any:
        """The ``LoRARequest`` TRL's colocated generation passes while the hook syncs the adapter (``None`` before
        the first sync, and when syncing the merged model)."""
        return getattr(self._sink, "lora_request", None) if self.adapter else None

    def _model(self) -> Any:
        # The trainer's model as accelerate prepared it (a DeepSpeed engine, an FSDP- or DDP-wrapped module, or the
        # model itself): the gatherer is chosen from the wrapper, and the names are found through it.
        return self.trainer.model_wrapped if self.trainer.model_wrapped is not None else self.trainer.model

    def _get_sink(self) -> Any:
        if self._sink is None:
            gen = self.generation
            if gen.mode == "colocate" and self.adapter:
                from ..sinks.vllm_lora import VLLMLoRASink

                self._sink = VLLMLoRASink(gen.llm, **{"lora_name": self.lora_name, **self.sink_options})
            elif gen.mode == "colocate":
                from ..sinks.vllm_colocated import VLLMColocatedSink

                self._sink = VLLMColocatedSink(gen.llm, **self.sink_options)
            else:
                from ..sinks.vllm_server import VLLMServerSink

                base_url = gen.server_base_url or f"http://{gen.server_host}:{gen.server_port}"
                options = {"timeout": gen.server_timeout, **self.sink_options}
                if self.adapter:
                    options.setdefault("lora_name", self.lora_name)
                self._sink = VLLMServerSink(base_url, rank=gen.accelerator.process_index, **options)
        return self._sink


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
    """Build a server-mode TRL trainer inside this block so that TRL does not open its own weight-transfer group.

    In server mode TRL joins vLLM's NCCL weight-transfer engine while the trainer is built (``VLLMClient.
    init_communicator``), which needs a CUDA device and raises on CPU. With the hook, lora_stream's
    :class:`~lora_stream.VLLMServerSink` opens the transfer group itself (``gloo`` through lora_stream's plugin, or
    ``nccl``), so TRL's is not needed on any device. Everything else TRL does at construction (connecting to the
    server, reading its configuration) still happens.
    """
    _check_version()
    from trl.generation.vllm_client import VLLMClient

    original = VLLMClient.init_communicator

    def deferred(self: Any, device: Any = 0) -> None:
        self.communicator = None  # lora_stream's sink opens the transfer group when it first syncs

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
        raise UnsupportedTrlError("use_lora_stream needs TRL installed (pip install 'lora-stream[trl]')") from exc
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


def use_lora_stream(
    trainer: Any,
    *,
    adapter: bool = False,
    lora_name: str = "lora_stream",
    stream_options: dict[str, Any] | None = None,
    sink_options: dict[str, Any] | None = None,
) -> TrlSyncHook:
    """Make ``trainer``'s vLLM weight sync go through lora_stream; returns the hook (``hook.remove()`` undoes it).

    Call it after building the trainer, on every rank. Idempotent: a second call returns the installed hook.

    Args:
        trainer: a TRL trainer built with ``use_vllm=True`` (colocate or server mode).
        adapter: sync only the LoRA adapter (:class:`~lora_stream.AdapterStream`) into vLLM's LoRA manager, as the
            adapter ``lora_name``, and generate through it: colocate mode passes its ``LoRARequest`` to every
            ``llm.generate``, server mode names it as the model of every request. The engine must serve LoRA
            (colocate: build the trainer inside :func:`trl_vllm_with_lora`; server: ``--enable-lora`` and
            ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``) from the checkpoint the trainer's base was loaded from.
        lora_name: the adapter's name in vLLM.
        stream_options: keyword arguments for each :class:`~lora_stream.ParamStream` (default ``group_by="layer"``),
            or :class:`~lora_stream.AdapterStream` with ``adapter=True``.
        sink_options: keyword arguments for the sink: :class:`~lora_stream.VLLMColocatedSink` in colocate mode,
            :class:`~lora_stream.VLLMServerSink` in server mode (``backend="gloo"`` on CPU, ``"nccl"`` on GPUs;
            ``api_key``, ``checkpoint``, ...).

    Raises:
        UnsupportedTrlError: TRL is missing or outside :data:`TESTED_TRL`, or the trainer does not generate with
            vLLM. Nothing is changed then.
    """
    gen = _check_trl(trainer)
    existing = getattr(gen, "_lora_stream_hook", None)
    if existing is not None:
        return existing  # type: ignore[no-any-return]
    if adapter and getattr(gen, "enable_sleep_mode", False):
        raise UnsupportedTrlError(
            "adapter=True with vllm_enable_sleep_mode: sleep level 2 discards the engine's base weights, which an "
            "adapter sync does not send again; sync the merged model (adapter=False) or turn sleep mode off"
        )
    hook = TrlSyncHook(
        trainer, dict(stream_options or {}), dict(sink_options or {}), adapter=adapter, lora_name=lora_name
    )
    client = getattr(gen, "vllm_client", None) if gen.mode == "server" else None
    if client is not None and getattr(client, "communicator", None) is not None:
        # TRL already joined vLLM's transfer engine (built outside without_trl_transfer_group): leave
        # its group, so that the server's engine can be initialized again for lora_stream's sink.
        client.close_communicator()
    gen.sync_weights = hook.sync_weights
    gen._lora_stream_hook = hook
    if adapter and gen.mode == "colocate":
        _generate_through_adapter(gen.llm, hook)
    return hook


def _generate_through_adapter(llm: Any, hook: TrlSyncHook) -> None:
    """TRL calls ``llm.generate(prompts, sampling_params=..., use_tqdm=False)``; this instance's ``generate`` adds
    the hook's ``LoRARequest`` (vLLM serves the base model to a request without it). Removed with the hook."""
    generate = type(llm).generate

    def through_adapter(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("lora_request") is None and hook.lora_request is not None:
            kwargs["lora_request"] = hook.lora_request
        return generate(llm, *args, **kwargs)

    llm.generate = through_adapter
