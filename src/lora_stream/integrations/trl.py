"""TRL in one line: route a TRL trainer's vLLM weight sync through lora_stream.

>>> trainer = GRPOTrainer(model, args=GRPOConfig(use_vllm=True, vllm_mode="colocate", ...), peft_config=...)
>>> hook = lora_stream.integrations.trl.use_lora_stream(trainer)   # the line
>>> trainer.train()

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

from ..errors import LoraStreamError
from ..sinks.record import SyncRecord
from ..stream import ParamStream

__all__ = [
    "TESTED_TRL",
    "TrlSyncHook",
    "UnsupportedTrlError",
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
    _sink: Any = None

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
        stream = ParamStream(self._model(), **{"group_by": "layer", **self.stream_options})
        # The sink logs the record as one line; the version names the trainer's step. Both sinks reset vLLM's prefix
        # cache after loading, as TRL's own sync does.
        record = self._get_sink().sync(stream, version=f"step-{self.trainer.state.global_step}")
        self.records.append(record)

    def _model(self) -> Any:
        # The trainer's model as accelerate prepared it (a DeepSpeed engine, an FSDP- or DDP-wrapped module, or the
        # model itself): the gatherer is chosen from the wrapper, and the names are found through it.
        return self.trainer.model_wrapped if self.trainer.model_wrapped is not None else self.trainer.model

    def _get_sink(self) -> Any:
        if self._sink is None:
            gen = self.generation
            if gen.mode == "colocate":
                from ..sinks.vllm_colocated import VLLMColocatedSink

                self._sink = VLLMColocatedSink(gen.llm, **self.sink_options)
            else:
                from ..sinks.vllm_server import VLLMServerSink

                base_url = gen.server_base_url or f"http://{gen.server_host}:{gen.server_port}"
                options = {"timeout": gen.server_timeout, **self.sink_options}
                self._sink = VLLMServerSink(base_url, rank=gen.accelerator.process_index, **options)
        return self._sink


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
    trainer: Any, *, stream_options: dict[str, Any] | None = None, sink_options: dict[str, Any] | None = None
) -> TrlSyncHook:
    """Make ``trainer``'s vLLM weight sync go through lora_stream; returns the hook (``hook.remove()`` undoes it).

    Call it after building the trainer, on every rank. Idempotent: a second call returns the installed hook.

    Args:
        trainer: a TRL trainer built with ``use_vllm=True`` (colocate or server mode).
        stream_options: keyword arguments for each :class:`~lora_stream.ParamStream` (default ``group_by="layer"``).
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
    hook = TrlSyncHook(trainer, dict(stream_options or {}), dict(sink_options or {}))
    client = getattr(gen, "vllm_client", None) if gen.mode == "server" else None
    if client is not None and getattr(client, "communicator", None) is not None:
        # TRL already joined vLLM's transfer engine (built outside without_trl_transfer_group): leave
        # its group, so that the server's engine can be initialized again for lora_stream's sink.
        client.close_communicator()
    gen.sync_weights = hook.sync_weights
    gen._lora_stream_hook = hook
    return hook
