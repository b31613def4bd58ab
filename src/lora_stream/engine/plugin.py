"""vLLM plugin entry point: registers lora_stream's weight-transfer backend (as ``gloo`` and ``lora_stream``) in
both of vLLM's factories.

Installed as ``[project.entry-points."vllm.general_plugins"] lora_stream``; vLLM calls :func:`register` in the
API server, the engine core and every worker before the worker builds its weight-transfer engine, so a server
started with ``--weight-transfer-config '{"backend": "lora_stream"}'`` (or ``"gloo"``) accepts it once lora_stream is
installed; the trainer's sink chooses the data plane's transport (gloo or nccl). A server for TRL adds TRL's own
flags: ``lora_stream.integrations.trl.SERVER_FLAGS``.

In the API server it also installs :class:`~lora_stream.engine.lease.UpdateLease`, the lease under which a trainer
holds the server paused and in an update, so that a server whose trainer vanished heals itself
(``LORA_STREAM_LEASE=0`` leaves it out).
"""

from __future__ import annotations

import os
import sys
from typing import Any

__all__ = ["BACKEND_NAMES", "register"]

#: The names a server's ``--weight-transfer-config`` may give lora_stream's worker engine: ``gloo`` (its first name)
#: and ``lora_stream``. The engine speaks gloo or nccl on its data plane, as the trainer's sink asks.
BACKEND_NAMES = ("gloo", "lora_stream")


def register() -> None:
    """Register lora_stream's engine under :data:`BACKEND_NAMES` with vLLM's worker and trainer engine factories
    (idempotent)."""
    from vllm.distributed.weight_transfer.factory import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )

    for name in BACKEND_NAMES:
        if name not in WeightTransferEngineFactory._registry:
            WeightTransferEngineFactory.register_engine(name, "lora_stream.engine.receiver", "WorkerTransferEngine")
        if name not in WeightTransferTrainerFactory._registry:
            WeightTransferTrainerFactory.register_engine(name, "lora_stream.transfer.sender", "TrainerTransferEngine")
    if os.environ.get("LORA_STREAM_LEASE", "1") not in ("0", ""):
        _install_lease()


#: Where vLLM's API server adds its middleware (``init_entrypoints_middleware``): the module that defines it and
#: the one that calls it (which imported the name, so both are wrapped).
_MIDDLEWARE_MODULES = ("vllm.entrypoints.serve.middleware.register", "vllm.entrypoints.launchers.app")


def _install_lease() -> None:
    """Wrap vLLM's middleware set-up so that every app it builds gets the lease, innermost. Only in a process that
    builds an API server (one that imported vLLM's entry points); workers and the engine core are left alone."""
    for name in _MIDDLEWARE_MODULES:
        module = sys.modules.get(name)
        original = getattr(module, "init_entrypoints_middleware", None)
        if module is None or original is None or getattr(original, "lora_stream_lease", False):
            continue

        def with_lease(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
            out = _original(*args, **kwargs)
            from .lease import install

            app = kwargs.get("app", args[1] if len(args) > 1 else None)
            if app is not None:
                install(app)
            return out

        with_lease.lora_stream_lease = True  # type: ignore[attr-defined]
        module.init_entrypoints_middleware = with_lease  # type: ignore[attr-defined]
