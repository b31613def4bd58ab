"""What the TRL hook needs before it touches anything: a TRL release it was tested with (:data:`TESTED_TRL`), a trainer
that generates with vLLM, and every rank agreeing on the outcome of what it checked.

Who calls it: :func:`~lora_stream.integrations.trl.use_lora_stream`, its builder and its context managers, first.
What breaks if it is bypassed: a TRL whose ``VLLMGeneration`` syncs differently would be patched on a guess; a rank
that refused alone would leave the others waiting in their first sync.
"""

from __future__ import annotations

import datetime
import warnings
from typing import Any

from ...coordination import Coordinator
from ...errors import LoraStreamError

__all__ = ["TESTED_TRL", "UnsupportedTrlError"]


#: The TRL releases whose ``VLLMGeneration`` this hook was written against and tested with: ``[low, high)``.
TESTED_TRL = ("1.15.0", "1.17.0")


class UnsupportedTrlError(LoraStreamError):
    """The trainer's TRL is not one whose weight sync this hook knows how to replace (nothing was changed)."""


def _vllm_at_least(version: str) -> bool:
    try:
        import vllm
        from packaging.version import Version

        return Version(Version(vllm.__version__).base_version) >= Version(version)
    except Exception:  # no vLLM, or a version string packaging cannot read
        return False


def _check_version() -> None:
    try:
        import trl
        from packaging.version import Version
    except ImportError as exc:
        raise UnsupportedTrlError(
            f"use_lora_stream needs TRL installed: pip install 'trl>={TESTED_TRL[0]},<{TESTED_TRL[1]}' (the release "
            "it is tested with; docs/quickstart.md#install)"
        ) from exc
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


def _install_agreement(stream_options: dict[str, Any]) -> Coordinator:
    """Every trainer rank in ``torch.distributed``'s default group (a no-op in one process): the stream's own
    coordinator is inactive where its gatherer does not communicate (DDP), but the install must still agree."""
    seconds = _agreement_seconds(stream_options)
    return Coordinator(None, "lora_stream.integrations.trl.use_lora_stream", datetime.timedelta(seconds=seconds))


def _agreement_seconds(stream_options: dict[str, Any]) -> float:
    return float(stream_options.get("timeout", 300.0))


def _check_modes(gen: Any, options: dict[str, Any]) -> None:
    """The combinations of TRL's modes and the hook's options that cannot work, refused before anything is built
    (the same on every rank: they depend only on TRL's configuration and the options): an adapter sync under sleep
    mode, options of merged syncs with ``adapter=True``, verification under sleep mode in colocate mode; and a
    warning for element syncs under sleep mode, which would send whole tensors every time."""
    adapter, sink_options = options["adapter"], options["sink_options"]
    if adapter and getattr(gen, "enable_sleep_mode", False):
        raise UnsupportedTrlError(
            "adapter=True with vllm_enable_sleep_mode: sleep level 2 discards the engine's base weights, which an "
            "adapter sync does not send again; sync the merged model (adapter=False) or turn sleep mode off"
        )
    merged_only = sorted({"skip_unchanged", "merge", "elements"} & set(sink_options))
    if adapter and merged_only:
        # A server sink takes them and ignores them for an adapter sync (the colocated LoRA sink does not take them):
        # refused alike in both modes rather than silently ignored in one.
        raise TypeError(
            f"use_lora_stream sink_options: {merged_only} apply to merged syncs only; adapter=True sends the adapter's "
            "factors whole at every sync. Drop them, or sync the merged model (adapter=False)"
        )
    if gen.mode == "colocate" and getattr(gen, "enable_sleep_mode", False) and sink_options.get("verify"):
        # TRL wakes the weights before the sync and the KV cache only after it: the probe would generate with
        # the KV cache still asleep (untested, and on a GPU likely a crash), so it is refused, not guessed.
        raise UnsupportedTrlError(
            "verify with vllm_enable_sleep_mode in colocate mode: TRL wakes the engine's KV cache only after the "
            "sync, and verification generates a probe during it; turn verify or sleep mode off (server mode "
            "verifies on the server)"
        )
    if gen.mode == "colocate" and getattr(gen, "enable_sleep_mode", False) and sink_options.get("elements"):
        # Not wrong, only useless: TRL sleeps its engine at level 2 after every generation, which discards the
        # weights an element sync rebuilds from, so every sync goes whole and the baseline is kept for nothing.
        warnings.warn(
            "lora_stream: elements=True with vllm_enable_sleep_mode: TRL's sleep level 2 discards the engine's weights "
            "after every generation, so every sync sends whole tensors, and the element baseline costs host memory "
            "for nothing; turn one of them off",
            stacklevel=3,  # the caller of use_lora_stream
        )
