"""How a sink reaches a vLLM engine that runs in the trainer's process or in its child, and the end of a sync into
one: shared by the colocated sink (:class:`~lora_stream.sinks.VLLMColocatedSink`) and the adapter sink
(:class:`~lora_stream.sinks.VLLMLoRASink`), which differ only in what they load.

An engine in this process (one in-process engine core, or ``external_launcher``) is driven through its model runner
and the engine side's own classes (:mod:`lora_stream.engine`); one in a child process through ``collective_rpc``
and the worker extension (:data:`WORKER_EXTENSION`), which runs the same classes there.
"""

from __future__ import annotations

import time
import weakref
from typing import Any

from ..coordination import this_rank
from ..errors import LoraStreamError
from ..transaction import Transaction
from .prefix_cache import reset_prefix_cache
from .preflight import EngineCheckpoint
from .verify import ProbeHistory, Verification, engine_logprobs, engine_probe_ids, verify_engine

__all__ = [
    "WORKER_EXTENSION",
    "engine_checkpoint",
    "engine_rpc",
    "forget_weights_on_sleep",
    "local_model_runner",
    "LocalEngineChecks",
    "probe_before",
    "require_llm",
]

#: Pass as ``LLM(..., worker_extension_cls=WORKER_EXTENSION)`` for an engine in a child process.
WORKER_EXTENSION = "lora_stream.engine.worker_extension.LoraStreamWorkerExtension"

_LOCAL_MODEL_PATHS = (
    "engine_core.engine_core.model_executor.driver_worker.worker.model_runner",  # in-process engine core
    "model_executor.driver_worker.worker.model_runner",  # external_launcher
)


def _get_path(obj: Any, path: str) -> Any:
    for attr in path.split("."):
        obj = getattr(obj, attr)
    return obj


def require_llm(llm: Any, sink: str) -> Any:
    """``llm.llm_engine``; a ``TypeError`` naming ``sink``'s ``llm`` parameter where ``llm`` is not a ``vllm.LLM``
    (a URL, a path, a model name), instead of an ``AttributeError`` from deep inside the sink."""
    engine = getattr(llm, "llm_engine", None)
    if engine is None:
        hint = " (for a vLLM server, pass its URL to VLLMServerSink)" if isinstance(llm, str) else ""
        raise TypeError(
            f"{sink}'s llm must be a vllm.LLM (the engine object, e.g. vllm.LLM(model=...)), got "
            f"{type(llm).__name__} {llm!r:.80}{hint}"
        )
    return engine


def local_model_runner(engine: Any) -> Any | None:
    """The model runner of ``engine`` (an ``LLM.llm_engine``) when its worker lives in this process: an in-process
    engine core or ``external_launcher``. ``None`` when the engine runs in a child process."""
    for path in _LOCAL_MODEL_PATHS:
        try:
            return _get_path(engine, path)
        except AttributeError:
            continue
    return None


def engine_checkpoint(engine: Any, checkpoint: str | bool | None) -> EngineCheckpoint | None:
    """What the pre-flight compares with: ``checkpoint``'s safetensors headers, by default those of the directory
    the engine was started from; ``None`` for ``checkpoint=False`` (no pre-flight)."""
    if checkpoint is False:
        return None
    return EngineCheckpoint.read(checkpoint if isinstance(checkpoint, str) else str(engine.model_config.model))


def engine_rpc(llm: Any, method: str, *args: Any) -> list[Any]:
    """Call lora_stream's worker extension ``method`` on every worker of an engine that runs in a child process.

    vLLM hands a worker's error back as a bare ``Exception`` carrying its text: a
    :class:`~lora_stream.engine.reload.VLLMLoadError` the worker raised (its text carries ``LOAD_ERROR_TAG``) is
    raised here as one again, so that the trainer sees the same :class:`~lora_stream.LoraStreamError` as from an
    engine in its own process."""
    from ..engine.reload import LOAD_ERROR_TAG, VLLMLoadError

    try:
        return list(llm.collective_rpc(method, args=args))
    except Exception as exc:
        text = str(exc)
        if "has no attribute" in text and method in text:
            raise LoraStreamError(
                f"the vLLM engine runs in a child process and its workers lack lora_stream's extension; start it "
                f"with LLM(..., worker_extension_cls={WORKER_EXTENSION!r}) (or set "
                "VLLM_ENABLE_V1_MULTIPROCESSING=0 to keep the engine in this process)"
            ) from exc
        if LOAD_ERROR_TAG in text and not isinstance(exc, LoraStreamError):
            raise VLLMLoadError(f"{text[text.index(LOAD_ERROR_TAG) :]} (child-process engine)") from exc
        raise


def forget_weights_on_sleep(llm: Any, model: Any | None) -> None:
    """Wrap ``llm.llm_engine.sleep`` (which ``LLM.sleep`` calls) so that a sleep that discards the weights (level 2
    and above: vLLM frees their memory, and waking maps it again with whatever it holds) first makes the engine's
    model hold no committed sync: a sink that sends only what changed then sends everything next (TRL's colocate
    mode sleeps at level 2 after every generation). ``model``: the engine's model in this process, or ``None`` for an
    engine reached over ``collective_rpc``. Once per engine, whichever sink comes first."""
    from ..engine.holding import hold, run_before

    # Weakly, as run_before asks: the hook lives on the engine.
    llm_ref = weakref.ref(llm)
    model_ref = weakref.ref(model) if model is not None else None

    def discarding(_engine: Any, level: int = 1, *_args: Any, **_kwargs: Any) -> None:
        if level < 2:
            return
        if model_ref is not None:
            local = model_ref()
            if local is not None:
                hold(local, None)
            return
        owner = llm_ref()
        if owner is not None:
            engine_rpc(owner, "lora_stream_release")

    run_before(llm.llm_engine, "sleep", discarding)


def probe_before(
    llm: Any, history: ProbeHistory, index: int, verifying: bool, stages: dict[str, Any], lora_request: Any = None
) -> Any:
    """What the in-process engine serves before a verified sync loads (its probe, through ``lora_request`` when
    given), for the "it changed" check; ``None`` when this sync (the ``index``-th) is not verified or cannot be
    checked (the previous one was not verified). The same decision on every rank (it depends on committed syncs
    only)."""
    if not verifying or not history.wants_before(index):
        return None
    t = time.perf_counter()
    before = engine_logprobs(llm, engine_probe_ids(llm), lora_request)
    stages["probe_before_s"] = time.perf_counter() - t
    return before


class LocalEngineChecks:
    """Step 3 of a sync (:mod:`lora_stream.sinks.vote`) into an engine in this process or its child: the probe
    through the engine against the trainer's forward, and the prefix-cache reset. ``before`` is what
    :func:`probe_before` read (the "it changed" check); ``history`` and ``index`` the sink's verification history
    and this sync's index."""

    def __init__(
        self,
        llm: Any,
        model: Any,
        where: str,
        *,
        limit: float | None,
        history: ProbeHistory,
        index: int,
        prefix_cache_timeout: float,
        lora_request: Any = None,
        before: Any = None,
    ) -> None:
        self.llm = llm
        self.model = model
        self.where = where
        self.limit = limit
        self.history = history
        self.index = index
        self.prefix_cache_timeout = prefix_cache_timeout
        self.lora_request = lora_request
        self.before = before

    def verify(self) -> Verification | None:
        return verify_engine(
            self.llm,
            self.model,
            limit=self.limit,
            rank=this_rank(),
            where=self.where,
            lora_request=self.lora_request,
            history=self.history,
            index=self.index,
            before=self.before,
        )

    def agree_on_verification(self, tx: Transaction) -> None:
        """One engine per rank: nothing to compare across ranks."""

    def reset_prefix_cache(self) -> None:
        # KV blocks cached under the previous weights (or the previous adapter, whose id is kept) must go.
        reset_prefix_cache(lambda: self.llm.reset_prefix_cache(), self.prefix_cache_timeout, "the engine")

    def before_vote(self) -> None:
        """A colocated engine is synchronous: nothing else can have changed it since it loaded."""
