"""The builder: ``use_lora_stream(GRPOTrainer)(...)`` checks a server before TRL contacts it, builds the trainer
without TRL's own transfer group (and, for an adapter sync in colocate mode, with LoRA in TRL's engine), then installs
the hook. The two context managers it enters are public for trainers built by hand.

Who calls it: :func:`~lora_stream.integrations.trl.use_lora_stream` given a trainer class. What breaks if it is
bypassed: in server mode, TRL's constructor joins its own NCCL group, which lora_stream's engine refuses.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any, TypeVar

from .guard import _check_version
from .server_check import _check_server_before_build

__all__ = ["trl_vllm_with_lora", "without_trl_transfer_group"]


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


_Trainer = TypeVar("_Trainer")


def _builder(
    trainer_class: type[_Trainer], options: dict[str, Any], install: Callable[..., Any]
) -> Callable[..., _Trainer]:
    """``use_lora_stream(TrainerClass, **options)``: the builder (see
    :func:`~lora_stream.integrations.trl.use_lora_stream`, which passes itself as ``install``: the builder installs
    the hook on the trainer it built the same way)."""
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
        install(trainer, **options)  # sets trainer.lora_stream
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
