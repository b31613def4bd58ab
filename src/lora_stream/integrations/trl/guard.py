"""What the TRL hook needs before it touches anything: a TRL release it was tested with (:data:`TESTED_TRL`), a trainer
that generates with vLLM, and every rank agreeing on the outcome of what it checked.

Who calls it: :func:`~lora_stream.integrations.trl.use_lora_stream`, its builder and its context managers, first.
What breaks if it is bypassed: a TRL whose ``VLLMGeneration`` syncs differently would be patched on a guess; a rank
that refused alone would leave the others waiting in their first sync.
"""

from __future__ import annotations

import datetime
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
