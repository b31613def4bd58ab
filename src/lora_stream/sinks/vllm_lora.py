"""Adapter sync into a vLLM engine in the trainer's process: the LoRA factors into vLLM's LoRA manager, from memory.

The engine serves its base model with ``enable_lora=True``; after each training step only the adapter's factors
travel (:class:`~lora_stream.AdapterStream`): no merge, no file, and under ZeRO-3/FSDP no base weight gathered.
One sync:

1. checks the adapter before gathering anything: vLLM's own ``PEFTHelper`` validation against the engine's LoRA
   config (rank above ``max_lora_rank``, DoRA, ...) and the shapes of the adapted weights in the engine's checkpoint
   (:func:`~lora_stream.sinks.preflight.adapter_preflight`);
2. gathers the adapter group by group and copies it out (the whole adapter is held once: it is small);
3. stages the copy in the engine's worker process (:mod:`lora_stream.engine.adapter_staging`) and calls vLLM's own
   ``add_lora`` with ``load_inplace=True`` under a stable adapter id: vLLM builds the new version, checks it, and
   only then replaces the previous one. If vLLM refuses it, or any trainer rank failed, every rank puts its previous
   version back, so the engine keeps serving the adapter it served;
4. resets the prefix cache (blocks cached under the old adapter carry the same adapter id) and returns an
   :class:`~lora_stream.sinks.record.AdapterSyncRecord` whose ``lora_request`` generation must pass.

The three ways of running vLLM in-process are those of :class:`~lora_stream.VLLMColocatedSink`: one in-process
engine, one per trainer rank under ``external_launcher`` (each rank's engine slices the adapter to its tensor-parallel
shard), and an engine in a child process started with its worker extension (tensors travel as safetensors bytes).
"""

from __future__ import annotations

import time
import zlib
from typing import Any

import torch

from ..adapter import ADAPTER_PREFIX, AdapterStream
from ..engine.adapter_staging import AdapterLoadError, StagedAdapter, adapter_path, stage, unstage
from ..errors import LoraStreamError
from ..transaction import Transaction, fault_point
from .local_engine import (
    LocalEngineChecks,
    engine_checkpoint,
    engine_rpc,
    local_model_runner,
    probe_before,
    require_llm,
)
from .prefix_cache import reset_prefix_cache
from .preflight import adapter_preflight
from .record import AdapterSyncRecord
from .source import SyncSource
from .verify import ProbeHistory, VerifyPolicy, check_policy, should_verify
from .vote import check_and_vote

__all__ = ["VLLMLoRASink", "stable_lora_id"]


def stable_lora_id(name: str) -> int:
    """The adapter id lora_stream uses for ``name`` unless told otherwise: the same in every process and run, and
    far above the small ids vLLM's OpenAI server counts up from."""
    return (1 << 30) + zlib.crc32(name.encode()) % (1 << 30)


class VLLMLoRASink:
    """Syncs :class:`~lora_stream.AdapterStream` passes into a ``vllm.LLM(..., enable_lora=True)`` in this process
    (or its child), as one adapter replaced in place.

    >>> sink = VLLMLoRASink(llm, lora_name="policy")  # doctest: +SKIP
    >>> record = sink.sync(AdapterStream(model), version=f"step-{step}")  # every trainer rank
    >>> out = llm.generate(["t5 t17 t42"], greedy, lora_request=record.lora_request, use_tqdm=False)

    Every trainer rank calls ``sync`` with its own stream (the gathers are collectives) and loads into its own
    engine. ``checkpoint`` is where the pre-flight reads the served model's safetensors headers (default: the
    directory the engine was started from; ``False`` skips the shape check, not vLLM's validation).

    Args:
        llm: the engine, a ``vllm.LLM``, started with ``enable_lora=True`` and ``max_lora_rank`` at least the
            adapter's rank.
        lora_name: the adapter's name in the engine (and in the returned ``LoRARequest``).
        lora_int_id: its id; default :func:`stable_lora_id` of the name.
        checkpoint: see above.
        prefix_cache_timeout: seconds to keep retrying vLLM's prefix-cache reset while it refuses; past it the
            sync fails and the previous version is put back.
        verify: the probe of :mod:`lora_stream.sinks.verify` through the engine with the new adapter and the
            trainer's forward (``True``, every ``N``-th sync, or a callable of the sync's index); ``verify_tolerance``
            overrides the derived tolerance.

    Raises:
        LoraStreamError: the engine was started without ``enable_lora``.
    """

    name = "vllm-lora"

    def __init__(
        self,
        llm: Any,
        *,
        lora_name: str = "lora_stream",
        lora_int_id: int | None = None,
        checkpoint: str | bool | None = None,
        prefix_cache_timeout: float = 10.0,
        verify: VerifyPolicy = False,
        verify_tolerance: float | None = None,
    ) -> None:
        from ..engine.vllm_version import check_vllm

        engine = require_llm(llm, "VLLMLoRASink")
        check_vllm("VLLMLoRASink")
        self.prefix_cache_timeout = prefix_cache_timeout
        self.verify = check_policy(verify)
        self.verify_tolerance = verify_tolerance
        self._syncs = 0
        self._history = ProbeHistory()
        self.llm = llm
        self.lora_config = engine.vllm_config.lora_config
        if self.lora_config is None:
            raise LoraStreamError(
                "the vLLM engine was started without LoRA support; start it with LLM(..., enable_lora=True, "
                "max_lora_rank=<at least the adapter's rank>) for adapter sync, or sync the merged model with "
                "VLLMColocatedSink"
            )
        if not lora_name:
            raise ValueError("lora_name must not be empty")
        self.lora_name = lora_name
        self.lora_int_id = stable_lora_id(lora_name) if lora_int_id is None else int(lora_int_id)
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be positive, got {self.lora_int_id}")
        self.path = adapter_path(lora_name)
        self._ckpt = engine_checkpoint(engine, checkpoint)
        self._in_process = local_model_runner(engine) is not None
        self._synced = False
        self.version: str | None = None

    @property
    def in_process(self) -> bool:
        """Whether the engine's worker lives in this process (otherwise it is reached by ``collective_rpc``)."""
        return self._in_process

    @property
    def lora_request(self) -> Any:
        """The ``vllm.lora.request.LoRARequest`` that selects the synced adapter (``None`` before the first sync)."""
        if not self._synced:
            return None
        return self._request(load_inplace=False)

    def _request(self, load_inplace: bool) -> Any:
        from vllm.lora.request import LoRARequest

        return LoRARequest(
            lora_name=self.lora_name, lora_int_id=self.lora_int_id, lora_path=self.path, load_inplace=load_inplace
        )

    def preflight(self, stream: AdapterStream) -> None:
        """Raise before anything is gathered if the engine cannot serve the adapter: vLLM's own validation of its
        config against the engine's LoRA limits, and the adapted weights' shapes against the engine's checkpoint."""
        from vllm.lora.peft_helper import PEFTHelper

        try:
            PEFTHelper.from_dict(stream.adapter_config()).validate_legal(self.lora_config)
        except ValueError as exc:
            raise AdapterLoadError(f"vLLM refuses adapter {self.lora_name!r}: {exc}") from exc
        if self._ckpt is not None:
            adapter_preflight(stream.metadata(), self._ckpt, ADAPTER_PREFIX)

    def sync(self, stream: AdapterStream, *, version: str | None = None) -> AdapterSyncRecord:
        """Sync one full pass of ``stream`` as the engine's adapter ``lora_name``; see the module documentation."""
        if not isinstance(stream, AdapterStream):
            raise TypeError(
                f"VLLMLoRASink syncs an AdapterStream, got {type(stream).__name__}; use VLLMColocatedSink for a "
                "merged ParamStream"
            )
        start = time.perf_counter()
        tx = Transaction.for_stream(stream, self.name)
        tx.prepare(lambda: self.preflight(stream))  # every rank refuses together, before any gather
        verifying = should_verify(self.verify, self._syncs)  # the same on every rank: commits are agreed
        source = SyncSource(stream, {}, version)
        tensors: dict[str, torch.Tensor] = {}
        installed = False
        before = None
        with tx.attempt():
            served = self._request(load_inplace=False) if self._synced else None
            # What is served now, for the "it changed" check.
            before = probe_before(self.llm, self._history, self._syncs, verifying, {}, served)
            with source.batches() as batches:  # a failure here ends the pass for every rank, with its reason
                for names, group in batches:
                    for n, t in zip(names, group):
                        # A copy: the stream's tensors may be the trainer's own parameters, which the next optimizer
                        # step changes in place, or a gather buffer about to be freed.
                        tensors[n] = t.detach().to("cpu", copy=True)
            self._install(StagedAdapter(tensors, stream.adapter_config(), version))
            installed = True
            fault_point("reload-check")
        checks = LocalEngineChecks(
            self.llm,
            stream.model,
            " (adapter)",
            limit=self.verify_tolerance,
            history=self._history,
            index=self._syncs,
            prefix_cache_timeout=self.prefix_cache_timeout,
            lora_request=self._request(load_inplace=False),
            before=before,
        )
        verification = check_and_vote(tx, checks, verifying=verifying, known=source.ended_early)
        tx.conclude(lambda: self._commit(version), lambda error: self._restore(error) if installed else None)
        seconds = time.perf_counter() - start
        base = source.record(self.name, seconds)
        fields = {**base.__dict__, "verification": verification}
        record = AdapterSyncRecord(**fields, lora_request=self._request(load_inplace=False), lora_name=self.lora_name)
        record.log()
        return record

    def _commit(self, version: str | None) -> None:
        self._synced = True
        self.version = version
        self._history.committed(self._syncs)
        self._syncs += 1

    def close(self) -> None:
        """Nothing is held between syncs but the staged adapter, which the engine needs to rebuild it after an
        eviction."""

    # -- staging and loading, in this process or over collective_rpc -----------------------------------------------
    def _install(self, adapter: StagedAdapter) -> None:
        self._previous = self._stage(adapter)
        try:
            self.llm.llm_engine.add_lora(self._request(load_inplace=True))
        except BaseException as exc:
            self._restore(exc)  # resets the prefix cache itself
            raise

    def _restore(self, failed: BaseException) -> None:
        """Put the previous version back (stage it, reload it in place), or remove the adapter if there was none."""
        try:
            self._unstage()
            if self._synced:
                self.llm.llm_engine.add_lora(self._request(load_inplace=True))
            else:
                self.llm.llm_engine.remove_lora(self.lora_int_id)
        except Exception as exc:
            failed.add_note(f"lora_stream: putting the previous adapter version back also failed: {exc!r}")
        finally:
            reset_prefix_cache(lambda: self.llm.reset_prefix_cache(), self.prefix_cache_timeout, "the engine")

    def _stage(self, adapter: StagedAdapter) -> Any:
        if self._in_process:
            return stage(self.path, adapter)
        from safetensors.torch import save

        self._rpc("lora_stream_stage_adapter", save(adapter.tensors), self.path, adapter.config, adapter.version)
        return None

    def _unstage(self) -> None:
        if self._in_process:
            unstage(self.path, self._previous)
        else:
            self._rpc("lora_stream_unstage_adapter", self.path)

    def _rpc(self, method: str, *args: Any) -> list[Any]:
        return engine_rpc(self.llm, method, *args)
