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
from ..stream import ParamStream
from ..transaction import Transaction, fault_point
from .prefix_cache import reset_prefix_cache
from .preflight import EngineCheckpoint
from .source import SyncSource
from .verify import Verification, engine_logprobs, engine_probe_ids, should_verify, verify_engine

__all__ = [
    "WORKER_EXTENSION",
    "engine_checkpoint",
    "engine_rpc",
    "forget_weights_on_sleep",
    "local_model_runner",
    "probe_before",
    "verify_reset_and_vote",
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
    """Call lora_stream's worker extension ``method`` on every worker of an engine that runs in a child process."""
    try:
        return list(llm.collective_rpc(method, args=args))
    except Exception as exc:
        if "has no attribute" in str(exc) and method in str(exc):
            raise LoraStreamError(
                f"the vLLM engine runs in a child process and its workers lack lora_stream's extension; start it "
                f"with LLM(..., worker_extension_cls={WORKER_EXTENSION!r}) (or set "
                "VLLM_ENABLE_V1_MULTIPROCESSING=0 to keep the engine in this process)"
            ) from exc
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


def probe_before(sink: Any, stages: dict[str, Any], lora_request: Any = None) -> Any:
    """What the in-process engine serves before a verified sync loads (its probe, through ``lora_request`` when
    given), for the "it changed" check; ``None`` when this sync is not verified or cannot be checked (the previous
    one was not verified). The same decision on every rank (it depends on committed syncs only)."""
    if not should_verify(sink.verify, sink._syncs) or not sink._history.wants_before(sink._syncs):
        return None
    t = time.perf_counter()
    before = engine_logprobs(sink.llm, engine_probe_ids(sink.llm), lora_request)
    stages["probe_before_s"] = time.perf_counter() - t
    return before


def verify_reset_and_vote(
    tx: Transaction,
    source: SyncSource,
    sink: Any,
    stream: ParamStream,
    where: str,
    lora_request: Any = None,
    before: Any = None,
) -> Verification | None:
    """The end of a sync into an in-process engine, before its commit or abort: the verification when ``sink.verify``
    asks for this sync (after a vote, since its forward is a collective; with the "it changed" check against
    ``before``, :func:`probe_before`), the prefix-cache reset, and the vote. ``sink`` has ``llm``, ``verify``,
    ``verify_tolerance``, ``prefix_cache_timeout``, ``_syncs`` and ``_history``.

    Every rank runs as many exchanges on every path: once a vote saw a failure, no rank votes again."""
    verification: Verification | None = None
    if should_verify(sink.verify, sink._syncs):
        if not tx.vote("after loading", known=source.ended_early):
            # That vote saw a failure and every rank knows it: each took part in it or, still inside its pass (under
            # a sharded gatherer, when this rank failed before starting its own: taking the engine's snapshot, say),
            # learned it at a group boundary and will not exchange again. Another vote would wait alone until the
            # timeout.
            return None
        with tx.attempt():
            verification = verify_engine(
                sink.llm,
                stream.model,
                limit=sink.verify_tolerance,
                rank=this_rank(),
                where=where,
                lora_request=lora_request,
                history=sink._history,
                index=sink._syncs,
                before=before,
            )
            fault_point("verify")
    with tx.attempt() as go:
        if go:
            # KV blocks cached under the previous weights (or the previous adapter, whose id is kept) must go.
            reset_prefix_cache(lambda: sink.llm.reset_prefix_cache(), sink.prefix_cache_timeout, "the engine")
            fault_point("prefix-cache")
            fault_point("commit")
    tx.vote("before committing", known=source.ended_early)
    return verification
