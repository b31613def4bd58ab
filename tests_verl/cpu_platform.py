"""verl on a CPU: a platform for verl's own platform registry, selected with ``VERL_PLATFORM=cpu``.

verl 0.9.1 ships platforms for CUDA, ROCm and Ascend only; with none detected it falls back to CUDA
(``verl/plugin/platform/platform_manager.py``, ``_detect_platform_name``) and its FSDP engine then calls
``torch.cuda.current_device()``. ``PlatformRegistry.register`` is verl's documented way to add a platform ("External
plugins ... can register their own platform classes without modifying the verl source tree"), and ``VERL_PLATFORM``
its documented override. This is that plugin for the tests: devices are ``"cpu"``, collectives ``gloo``. Nothing of
verl's engine, registry or config path is replaced.

Its FSDP engine is registered for ``cuda`` and ``npu`` only; ``VERL_ENGINE_DEVICE=cuda`` (read by
``EngineRegistry.get_engine_cls``, verl's documented override) selects it here.
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from verl.plugin.platform.platform_base import PlatformBase
from verl.plugin.platform.platform_manager import PlatformRegistry

#: ``torch.cpu`` with the few calls verl makes on its device module that ``torch.cpu`` lacks (no-ops on a CPU).
CPU_MODULE = types.SimpleNamespace(
    **{name: getattr(torch.cpu, name) for name in dir(torch.cpu) if not name.startswith("_")},
    empty_cache=lambda: None,
    memory_allocated=lambda *a, **k: 0,
    memory_reserved=lambda *a, **k: 0,
    max_memory_allocated=lambda *a, **k: 0,
    mem_get_info=lambda *a, **k: (0, 0),
    reset_peak_memory_stats=lambda *a, **k: None,
)


@PlatformRegistry.register(platform="cpu")
class PlatformCPU(PlatformBase):
    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> Any:
        return CPU_MODULE

    def is_available(self) -> bool:
        return True

    def current_device(self) -> Any:
        return "cpu"

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        pass

    def synchronize(self, device_index: int | None = None) -> None:
        pass

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"

    @contextmanager
    def nvtx_range(self, msg: str) -> Iterator[None]:
        yield

    def profiler_start(self) -> None:
        pass

    def profiler_stop(self) -> None:
        pass

    def ray_resource_name(self) -> str:
        return "CPU"

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self) -> Any:
        return None
