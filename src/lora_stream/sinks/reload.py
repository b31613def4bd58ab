"""vLLM's layerwise reload bracket around a model, with the check that vLLM took every tensor it was sent.

One object, used wherever the model lives: by :class:`~lora_stream.VLLMColocatedSink` for an engine in the trainer's
process, by the worker extension for an engine in a child process, and by the ``gloo`` worker engine inside a vLLM
server. Only the transport differs between them.

vLLM reloads checkpoint-format weights inside ``initialize_layerwise_reload`` ... ``finalize_layerwise_reload``. A
fused module (``qkv_proj``, ``gate_up_proj``) is rebuilt once all of its shards arrived; one that misses a shard is
silently corrupted, and a name vLLM does not know may be dropped without a word. :meth:`ReloadBracket.finish` closes
the bracket and reports both, from what ``load_weights`` returned.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import LoraStreamError

__all__ = ["ConsumptionCheck", "LoadReport", "ReloadBracket", "VLLMLoadError"]

#: Prefix of a :class:`VLLMLoadError` message, so that the server sink can tell one apart in an HTTP error body.
LOAD_ERROR_TAG = "[lora_stream VLLMLoadError]"


class VLLMLoadError(LoraStreamError):
    """vLLM did not take every tensor it was sent (unknown name, incomplete fused module, loader error).

    Raised after the reload bracket was closed, so the engine keeps running; layers loaded before the failure hold
    the new weights, the others the old ones. The next successful sync makes the engine consistent again.
    ``unconsumed`` lists the sent names vLLM did not load; ``incomplete`` maps each fused vLLM parameter that missed
    shards to the shards it got.
    """

    def __init__(
        self, message: str, *, unconsumed: list[str] | None = None, incomplete: dict[str, list[str]] | None = None
    ) -> None:
        super().__init__(message)
        self.unconsumed = unconsumed or []
        self.incomplete = incomplete or {}


@dataclass
class LoadReport:
    """What one bracket loaded: the names vLLM did not consume and the fused modules left incomplete."""

    unconsumed: list[str] = field(default_factory=list)
    incomplete: dict[str, list[str]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.unconsumed and not self.incomplete

    def merge(self, other: LoadReport) -> None:
        """Add another worker's report (tensor-parallel workers each run their own bracket)."""
        self.unconsumed += [n for n in other.unconsumed if n not in self.unconsumed]
        self.incomplete.update(other.incomplete)

    def error(self, where: str = "") -> VLLMLoadError | None:
        """The error to raise for this report, the same text whichever sink or worker found it."""
        if self.ok:
            return None
        return VLLMLoadError(
            f"{LOAD_ERROR_TAG} vLLM{where} did not consume {len(self.unconsumed)} name(s) {self.unconsumed[:20]} and "
            f"left fused modules incomplete {dict(list(self.incomplete.items())[:20])}; the engine keeps serving, "
            "with the layers that received all their weights updated",
            unconsumed=list(self.unconsumed),
            incomplete=dict(self.incomplete),
        )

    def to_wire(self) -> tuple[list[str], dict[str, list[str]]]:
        return list(self.unconsumed), dict(self.incomplete)

    @classmethod
    def from_wire(cls, wire: Any) -> LoadReport:
        unconsumed, incomplete = wire
        return cls(list(unconsumed), {str(k): list(v) for k, v in dict(incomplete).items()})


class ConsumptionCheck:
    """Which checkpoint names vLLM consumed during one reload bracket, in vLLM's own (fused) naming.

    ``load_weights`` returns the vLLM parameter names it filled; q/k/v arrive as ``qkv_proj`` and so on. A name
    that maps to nothing that was filled was ignored (vLLM drops e.g. unexpected ``.bias`` names silently), and a
    fused module that did not get all of its shards is corrupted at finalize.
    """

    def __init__(self, model_cls: type) -> None:
        self.mapper = getattr(model_cls, "hf_to_vllm_mapper", None)
        self.packed: dict[str, list[str]] = dict(getattr(model_cls, "packed_modules_mapping", {}) or {})
        self.loaded: set[str] = set()
        self.sent: list[str] = []

    def add(self, sent: Iterable[str], loaded: Iterable[str]) -> None:
        self.sent += list(sent)
        self.loaded |= set(loaded)

    def report(self) -> LoadReport:
        unconsumed: list[str] = []
        shards: dict[str, set[str]] = defaultdict(set)
        for name in self.sent:
            mapped: Any = (name, None)
            if self.mapper is not None and hasattr(self.mapper, "_map_name_with_shard"):
                mapped = self.mapper._map_name_with_shard(name)
            if mapped is None or mapped[0] not in self.loaded:
                unconsumed.append(name)
            elif mapped[1] is not None:
                shards[mapped[0]].add(str(mapped[1]))
        incomplete: dict[str, list[str]] = {}
        for vname, got in shards.items():
            parts = vname.split(".")
            need = self.packed.get(parts[-2] if len(parts) >= 2 else vname)
            if need and len(got) < len(need):
                incomplete[vname] = sorted(got)
        return LoadReport(unconsumed, incomplete)


class ReloadBracket:
    """``begin()``, any number of ``load(pairs)``, then ``finish()`` -- or ``abort()`` -- on a vLLM model.

    Contract, relied on by every sink:

    * ``begin`` opens vLLM's layerwise reload; from then on the model's layers are in reload state and **must** be
      closed by ``finish`` or ``abort``, or the engine's next forward fails (layers left on the meta device).
    * ``load`` hands one batch to ``model.load_weights`` and records what it returned. Send whole layers in layer
      order: a fused module is rebuilt when its last shard arrives.
    * ``finish`` closes the bracket and returns the :class:`LoadReport`; it never raises for a bad report (the
      caller decides, so that the same error text reaches the user whichever process found it). ``abort`` closes
      the bracket after a failure without checking. Both are idempotent.
    """

    def __init__(self, model: torch.nn.Module, model_config: Any) -> None:
        self.model: Any = model
        self.model_config = model_config
        self._check: ConsumptionCheck | None = None

    @property
    def open(self) -> bool:
        return self._check is not None

    def begin(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        if self._check is not None:
            raise RuntimeError("a reload bracket is already open on this model")
        initialize_layerwise_reload(self.model)
        self._check = ConsumptionCheck(type(self.model))

    def load(self, pairs: list[tuple[str, torch.Tensor]]) -> list[str]:
        if self._check is None:
            raise RuntimeError("load() outside a reload bracket: call begin() first")
        loaded = sorted(self.model.load_weights(iter(pairs)))
        self._check.add([n for n, _ in pairs], loaded)
        return loaded

    def finish(self) -> LoadReport:
        check, self._check = self._check, None
        if check is None:
            return LoadReport()
        self._finalize()
        return check.report()

    def abort(self) -> None:
        if self._check is not None:
            self._check = None
            self._finalize()

    def _finalize(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        # Restores every layer that did not receive all its weights, so the engine keeps serving.
        finalize_layerwise_reload(self.model, self.model_config)  # type: ignore[no-untyped-call]
