"""verl in one config line: its FSDP engine's weight export, LoRA merged out of place, one decoder layer at a time.

.. code-block:: yaml

    actor_rollout_ref:
      model:
        external_lib: lora_stream.integrations.verl   # the one line
        lora_rank: 16
        lora:
          merge: true      # verl's own switch: a merged sync (false: verl's adapter-only sync)

verl imports ``model.external_lib`` in every process that builds a model config (``HFModelConfig.__post_init__``).
Importing this module registers :class:`LoraStreamFSDPEngine` in verl's ``EngineRegistry`` for
``model_type="language_model"`` and the ``fsdp`` / ``fsdp2`` backends, under the ``(device, vendor)`` key that
verl's lookup tries *before* the device-wide key its own FSDP engine holds. So every language-model engine verl
builds in that process (the actor, the reference model) is this one; critics and other backends are untouched.

What changes is one method, ``get_per_tensor_param()``: the generator verl's weight sync consumes (its
``CheckpointEngine.send_weights``, and the colocated "naive" path's ``rollout.update_weights``). Training, the
optimizer, checkpoints, offload and the reference model are verl's own code, unchanged; ``train_batch()`` only adds
the latest sync's figures to the metrics verl's own step returns.

Each export that verl consumes to its end is a sync a user sees: one line on the ``lora_stream`` logger on rank 0
(:meth:`SyncRecord.log <lora_stream.SyncRecord.log>`, version ``export-N``: verl does not pass its step to the
export), :attr:`LoraStreamFSDPEngine.last_record`, and the figures (``actor/lora_stream/sync_s``, ...) in the
metrics of the next training step, whose rollouts those weights generated.

* ``lora.merge: true`` (merged sync). verl merges the adapter into the FSDP shards in place
  (``merged_lora_context(backup_adapters=True)``: a CPU copy of the rank's whole base shard, peft's in-place
  ``merge()``, a restore from the copy) and then ``full_tensor()``-s every parameter of the model. Here the merged
  weights are :class:`~lora_stream.ParamStream`'s: gathered one decoder layer at a time, merged out of place in
  float32 and rounded once to the actor's compute dtype (``mixed_precision.param_dtype``, bf16 by default: what
  verl's own merged export sends), under the checkpoint's names (verl's, as ``convert_weight_keys`` gives them; a
  tied weight under both names, as verl's ``state_dict()`` export has it). The training weights are never written.
* ``lora.merge: false`` (verl's default: adapter-only sync). With ``base_sync_done=True`` the adapter comes from
  :class:`~lora_stream.AdapterStream`: peft's adapter-checkpoint names, as verl's ``collect_lora_params`` gives
  them, gathered one group of LoRA modules at a time, with each layer's scaling folded into ``lora_B`` and a peft
  config whose scaling is 1 (``r == lora_alpha``; ``rank_pattern`` / ``alpha_pattern`` for other ranks), so the
  served adapter computes the trainer's forward whatever verl's rollout does with ``lora_alpha``. The base-only
  export (``base_sync_done=False``, once, when the rollout starts from dummy weights) is verl's own.
* No adapter: the plain weights, one layer at a time, in the actor's compute dtype.

Every rank iterates the generator in lockstep (verl's senders do: producing a weight is collective). If one rank's
consumer fails, or a rank stops iterating, every rank raises (:class:`~lora_stream.StreamAbortedError` naming the
rank) within one group, instead of hanging in the next all-gather.

Refused when this module is imported (:class:`UnsupportedVerlError`): a verl release outside :data:`TESTED_VERL`.
Refused when the engine is built (:class:`UnsupportedVerlError`, or the stream's own
:class:`~lora_stream.UnsupportedAdapterError` / :class:`~lora_stream.UnsupportedModelError` from planning): QAT
(verl quantizes its export; this engine would have to as well); a backend other than ``fsdp2`` (verl's FSDP1 engine
is not tested here); and every peft configuration or model the stream itself refuses. Engines built
``forward_only`` (the reference model) are verl's own in everything, their export included.

Options are class attributes (:attr:`LoraStreamFSDPEngine.sync_timeout`, :attr:`LoraStreamFSDPEngine.group_by`):
set them in a module of your own that imports this one, and name that module as ``external_lib``.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from importlib.metadata import version as _installed_version
from typing import Any

import torch
from verl.workers.engine import EngineRegistry
from verl.workers.engine.fsdp import FSDPEngineWithLMHead

from ..adapter import AdapterStream
from ..errors import LoraStreamError
from ..gatherers.base import nbytes
from ..grouping import GroupBy
from ..reporting import SYNC_BAR_DELAY_S, progress_bar
from ..sinks.record import SyncRecord
from ..stream import ParamStream

logger = logging.getLogger("lora_stream")

__all__ = ["TESTED_VERL", "LoraStreamFSDPEngine", "UnsupportedVerlError", "registry_key"]

#: The verl releases whose FSDP engine this one was written against and tested with: ``[low, high)``. verl calls its
#: engine interface "subject to change before release"; another release is refused rather than guessed at.
TESTED_VERL = ("0.9.1", "0.10.0")

#: The verl backends (``engine.strategy``) whose language-model engine this one replaces: FSDP1's too, so that a
#: run configured for it is refused when its engine is built instead of silently keeping verl's own export.
BACKENDS = ("fsdp", "fsdp2")
#: The backends it exports. verl's FSDP1 engine cannot be built on a CPU (FSDP1's ``sync_module_states`` needs a
#: GPU), so it is untested here, and refused.
EXPORTED_BACKENDS = ("fsdp2",)


class UnsupportedVerlError(LoraStreamError):
    """verl, or this engine's configuration, is one that :class:`LoraStreamFSDPEngine` cannot export exactly;
    raised when the engine is built (or when this module is imported, for a verl release), before any weight
    moves."""


def _release(text: str) -> tuple[int, ...]:
    parts: list[int] = []
    for piece in text.split("+")[0].split("."):
        digits = "".join(c for c in piece if c.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def _check_verl_release() -> None:
    installed = _installed_version("verl")
    low, high = TESTED_VERL
    if not _release(low) <= _release(installed) < _release(high):
        raise UnsupportedVerlError(
            f"lora_stream.integrations.verl was tested with verl >= {low}, < {high}; this is verl {installed}. "
            "Its FSDP engine's export may have changed: remove model.external_lib to use verl's own sync"
        )


def registry_key() -> tuple[str, str]:
    """The ``(device, vendor)`` key verl's ``EngineRegistry.get_engine_cls`` tries first in this process: the
    platform's device and vendor, or ``VERL_ENGINE_DEVICE`` / ``VERL_ENGINE_VENDOR`` where set (verl reads those
    too). :class:`LoraStreamFSDPEngine` is registered under it."""
    from verl.utils.device import get_device_name, get_vendor

    return (os.getenv("VERL_ENGINE_DEVICE") or get_device_name(), os.getenv("VERL_ENGINE_VENDOR") or get_vendor())


class LoraStreamFSDPEngine(FSDPEngineWithLMHead):  # type: ignore[misc]  # verl is untyped
    """verl's ``FSDPEngineWithLMHead`` with its weight export (``get_per_tensor_param``) replaced by lora_stream's
    streams; see the module documentation. Built by verl's ``EngineRegistry`` once this module is imported
    (``model.external_lib``); never constructed by hand.

    Its options are the class attributes below: set them before verl builds its engines (in the module named as
    ``external_lib``, after importing this one).
    """

    #: Seconds a rank waits for its peers at a group boundary before raising (a slow or dead rank).
    sync_timeout: float = 300.0
    #: How the merged stream is grouped (:data:`~lora_stream.grouping.GroupBy`): one decoder layer per gather.
    group_by: GroupBy = "layer"

    _stream: ParamStream | None = None
    _adapter_stream: AdapterStream | None = None
    #: The latest export's :class:`~lora_stream.SyncRecord` (``None`` before the first one completes).
    last_record: SyncRecord | None = None
    _exports = 0
    #: The latest export's figures, until the next training step's metrics carry them.
    _unreported: dict[str, float] | None = None

    # -- building ----------------------------------------------------------------------------------------------
    def initialize(self) -> None:
        """This engine's refusals, verl's ``initialize`` (model, FSDP, optimizer, checkpoint manager), then the plan
        of the stream it exports, so that what cannot be exported exactly fails here, not at the first sync."""
        exports = not self.engine_config.forward_only
        if exports:
            self._refuse_configuration()
        super().initialize()
        if exports:
            self._plan()

    def _refuse_configuration(self) -> None:
        where = f"rank {self.rank}"
        if self.engine_config.strategy not in EXPORTED_BACKENDS:
            strategy = self.engine_config.strategy
            why = " (verl's default: FSDP1, which lora_stream is not tested with)" if strategy == "fsdp" else ""
            raise UnsupportedVerlError(
                f"{where}: lora_stream's verl engine exports {', '.join(EXPORTED_BACKENDS)} models; this engine's "
                f"strategy is {strategy!r}{why}. Add "
                "actor_rollout_ref.actor.strategy=fsdp2 to verl's command line (in YAML: actor_rollout_ref.actor."
                "strategy: fsdp2; the reference model follows it), or remove actor_rollout_ref.model.external_lib to "
                "keep verl's own export"
            )
        if self._qat_enabled:
            raise UnsupportedVerlError(
                f"{where}: QAT is enabled (engine.qat.enable): verl quantizes its own export, lora_stream's would "
                "send unquantized weights. Remove model.external_lib for QAT runs"
            )

    def _plan(self) -> None:
        """Plan the stream this engine's lora mode exports (raises the stream's refusals on every rank)."""
        if self._adapter_mode():
            self._adapter_stream = AdapterStream(self.module, timeout=self.sync_timeout, group_by=self.group_by)
        else:
            self._stream = ParamStream(
                self.module,
                dtype=self._export_dtype(),
                group_by=self.group_by,
                timeout=self.sync_timeout,
            )

    def _adapter_mode(self) -> bool:
        """Whether verl's configuration asks for the adapter-only sync: a peft model and ``lora.merge`` off."""
        peft_model = getattr(self.module, "_fsdp_wrapped_module", self.module)
        return hasattr(peft_model, "peft_config") and not self.model_config.lora.get("merge", False)

    def _export_dtype(self) -> torch.dtype:
        """The actor's forward dtype (what verl's ``_build_fsdp_module`` set from ``mixed_precision.param_dtype``):
        the dtype verl's own merged export sends."""
        dtype: torch.dtype = self._autocast_dtype
        return dtype

    # -- exporting ---------------------------------------------------------------------------------------------
    def get_per_tensor_param(
        self, layered_summon: bool = False, base_sync_done: bool = False, **kwargs: Any
    ) -> tuple[Iterator[tuple[str, torch.Tensor]], dict[str, Any] | None]:
        """What verl's weight sync sends: ``(generator of (name, tensor), peft config or None)``, as verl's own
        method returns it (``BaseEngine.get_per_tensor_param``).

        Every rank must iterate the generator to its end, in lockstep: each step gathers from every rank. A
        yielded tensor is a fresh tensor (merged or cast) or a copy out of the gather buffer; it stays valid after
        the generator moves on, until the next optimizer step (for a tensor yielded without a copy). The first
        ``next()`` runs the stream's checks (the plan still matches the model, every rank agrees); a rank that
        fails or stops makes every rank raise within one group.

        ``layered_summon`` has no effect on lora_stream's exports (every one is layered); the adapter mode's base
        export (``base_sync_done=False``) is verl's own and reads it as verl does.
        """
        if self.engine_config.forward_only:  # not planned here: verl's own export, which verl never asks of it
            own: tuple[Iterator[tuple[str, torch.Tensor]], dict[str, Any] | None] = super().get_per_tensor_param(
                layered_summon=layered_summon, base_sync_done=base_sync_done, **kwargs
            )
            return own
        if self._adapter_mode():
            if not base_sync_done:
                # The base, once, for a rollout started from dummy weights: verl's own export (not a merge), with
                # verl's own refusal of layered_summon there.
                result: tuple[Iterator[tuple[str, torch.Tensor]], dict[str, Any] | None] = super().get_per_tensor_param(
                    layered_summon=layered_summon, base_sync_done=False, **kwargs
                )
                return result
            adapter = self._current()
            assert isinstance(adapter, AdapterStream)
            return self._export(adapter, aliases={}), self._adapter_peft_config(adapter)
        merged = self._current()
        return self._export(merged, aliases=merged.tied_aliases()), None

    def _current(self) -> ParamStream:
        """The stream this engine's lora mode exports, planned again when the model changed since (another adapter,
        adapters disabled, a module replaced): a reused plan must not yield a stale merge. Every rank decides alike
        (the change is the model's, the same on every rank); were they to differ, the pass's status exchange raises
        on all of them."""
        stream = self._adapter_stream if self._adapter_mode() else self._stream
        if stream is None or stream.plan_changes():
            if self._adapter_stream is not None:
                self._adapter_stream.close()  # its gather buffers are kept between syncs
            self._stream = self._adapter_stream = None
            self._plan()
            stream = self._adapter_stream if self._adapter_mode() else self._stream
        assert stream is not None
        return stream

    def _adapter_peft_config(self, stream: AdapterStream) -> dict[str, Any]:
        """The model's peft config as verl returns it (``LoraConfig.to_dict()``: ``peft_type`` and ``task_type`` as
        enum members), with the ranks and scaling of the tensors :class:`~lora_stream.AdapterStream` yields
        (scaling 1, folded into ``lora_B``)."""
        peft_model: Any = getattr(self.module, "_fsdp_wrapped_module", self.module)
        config: dict[str, Any] = peft_model.peft_config[stream.adapter_name].to_dict()
        served = stream.adapter_config()
        for key in ("r", "lora_alpha", "rank_pattern", "alpha_pattern", "use_rslora"):
            config[key] = served[key]
        return config

    def _export(self, stream: ParamStream, aliases: dict[str, str]) -> Iterator[tuple[str, torch.Tensor]]:
        """One pass over ``stream`` as verl's generator: each tied alias right after the tensor it shares. Once the
        consumer took the last tensor, the export's record is logged (one line, rank 0) and its figures wait for
        the next training step's metrics (:meth:`train_batch`)."""
        followers: dict[str, list[str]] = {}
        for alias, source in aliases.items():
            followers.setdefault(source, []).append(alias)
        start = time.perf_counter()
        tensors_sent = bytes_sent = largest = 0
        with self._staged(), iter(stream) as tensors:
            bar = self._bar(stream, followers)
            try:
                for name, tensor in tensors:
                    size = tensor.numel() * tensor.element_size()
                    largest = max(largest, size)
                    for out in (name, *followers.get(name, ())):
                        yield out, tensor
                        tensors_sent += 1
                        bytes_sent += size
                        if bar is not None:
                            bar.update(size)
            finally:
                if bar is not None:
                    bar.close()
        self._exports += 1
        record = SyncRecord(
            sink="verl-adapter" if isinstance(stream, AdapterStream) else "verl",
            tensors=tensors_sent,
            bytes=bytes_sent,
            groups=stream.last_stats.groups,
            seconds=time.perf_counter() - start,
            peak_group_bytes=largest,  # verl takes one tensor at a time
            peak_gathered_bytes=stream.last_stats.peak_gathered_bytes,
            version=f"export-{self._exports}",
            gathered_bytes=stream.last_stats.gathered_bytes,
            full_because="verl's weight sync takes the whole export each time",
        )
        self.last_record = record
        self._unreported = record.metrics()
        record.log(self.rank)

    def _bar(self, stream: ParamStream, followers: dict[str, list[str]]) -> Any:
        """The export's progress bar (rank 0, a terminal: not under Ray, whose workers write to a pipe)."""
        meta = stream.metadata()
        total = sum(nbytes(torch.Size(m.shape), m.dtype) * (1 + len(followers.get(m.name, ()))) for m in meta)
        return progress_bar(total, "lora_stream sync (verl)", rank=self.rank, delay=SYNC_BAR_DELAY_S, leave=False)

    # -- metrics -------------------------------------------------------------------------------------------------
    def train_batch(self, data: Any, loss_function: Any) -> Any:
        """verl's own training step; its metrics also carry the latest export's figures, once
        (:meth:`SyncRecord.metrics <lora_stream.SyncRecord.metrics>`, as one value per rank, the way verl's
        per-micro-batch metrics are lists): verl's trainer logs them as ``actor/lora_stream/sync_s``,
        ``actor/lora_stream/sent_mib``, ... beside its own, for the step whose rollouts those weights generated."""
        outputs = super().train_batch(data, loss_function)
        figures, self._unreported = self._unreported, None
        metrics = outputs.get("metrics") if isinstance(outputs, dict) else None
        if figures and isinstance(metrics, dict):
            for name, value in figures.items():
                metrics.setdefault(name, [value])
        return outputs

    @contextmanager
    def _staged(self) -> Iterator[None]:
        """The shards on the device for the export, and back after, where verl offloads them between steps (what
        its own export does: ``load_fsdp_model_to_gpu`` / ``offload_fsdp_model_to_cpu``). FSDP2's
        ``CPUOffloadPolicy`` owns placement itself; the stream's gatherer moves each shard as it gathers it."""
        from verl.utils.fsdp_utils import load_fsdp_model_to_gpu, offload_fsdp_model_to_cpu

        stage = self._is_offload_param and not self._uses_fsdp2_cpu_offload_policy
        if stage:
            load_fsdp_model_to_gpu(self.module)
        try:
            yield
        finally:
            if stage:
                offload_fsdp_model_to_cpu(self.module)


def _register() -> None:
    _check_verl_release()
    key = registry_key()
    engines = EngineRegistry._engines.get("language_model", {})
    for backend in BACKENDS:
        held = engines.get(backend, {}).get(key)
        if held is LoraStreamFSDPEngine:
            return  # this module's class, already registered (a re-import)
        if held is not None:
            raise UnsupportedVerlError(
                f"verl's EngineRegistry already holds {held.__name__} for language_model/{backend} on {key}: "
                "lora_stream's engine would not be the one verl builds"
            )
    device, vendor = key
    EngineRegistry.register(model_type="language_model", backend=list(BACKENDS), device=device, vendor=vendor)(
        LoraStreamFSDPEngine
    )
    logger.info("lora_stream: verl's language-model FSDP engine on %s/%s is lora_stream's", device, vendor)


_register()
