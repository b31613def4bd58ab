"""Installing the hook: :func:`use_lora_stream`, on a trainer already built or, given its class, through the builder.

Who calls it: the user's training script, once, on every rank. It refuses (on every rank alike) what the hook cannot
sync exactly, runs the sink's pre-flight, and only then replaces ``sync_weights``. What breaks if it is bypassed:
a refusal would come at the first sync, inside ``trainer.train()``, after TRL built and started everything.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, overload

from ...lockstep import describe_error
from ...redaction import redact
from .builder import _builder, _Trainer
from .guard import _agreement_seconds, _check_modes, _check_trl, _install_agreement
from .hook import TrlSyncHook, _choose_send_dtype, _decide_send_dtype, _engine_dtype_name, _generate_through_adapter

__all__ = ["use_lora_stream"]


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
        TypeError: an option the sink or stream of this mode does not take, or one the hook sets itself (``llm``,
            ``base_url``, ``rank``, ``model``): named, with the class the mode builds and the options it takes; with
            ``adapter=True``, an option of merged syncs only (``skip_unchanged``, ``merge``, ``elements``).
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
            use_lora_stream,
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
    _check_modes(gen, options)
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
