"""Runs inside vLLM's worker process: adapters staged in memory, loaded by vLLM's own ``add_lora``.

vLLM loads LoRA adapters only from a directory: ``add_lora(LoRARequest(name, id, path))`` reaches the worker's
``WorkerLoRAManager._load_adapter``, which reads ``adapter_config.json`` and the safetensors file and builds a
``LoRAModel``; everything after that (replacing the previous version in place when ``load_inplace`` is set, loading
before evicting so that a refused adapter leaves the old one serving, LRU eviction, slot activation) is vLLM's.

lora_stream keeps all of that and replaces only the read. The tensors of an adapter sync are *staged* in the worker
process under a path of its own scheme, ``lora-stream://<name>``; :func:`install_loader` wraps ``_load_adapter``
so that such a path is built from the staged tensors with vLLM's ``LoRAModel.from_lora_tensors`` and vLLM's
``PEFTHelper`` validation, and any other path goes to vLLM's loader unchanged. Because the staged adapter stays
in the process until the next sync replaces it, an adapter that vLLM's LRU cache evicts is rebuilt from memory
when a request needs it again.

Before vLLM sees the adapter, :func:`build_lora_model` checks what vLLM would otherwise drop silently: every module
the adapter names must be one of the engine's LoRA modules (or a slice of a packed one), both factors must be
present, and vLLM must apply it with scaling 1 (the adapter stream folds the scaling into ``lora_B``). After
building it, it runs the validations the running release's own ``_load_adapter`` runs (:data:`LOADER_VALIDATIONS`):
their names changed between vLLM releases, and skipping one would let an adapter vLLM's loader refuses into the
engine.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import LoraStreamError

__all__ = [
    "ADAPTER_SCHEME",
    "LOADER_VALIDATIONS",
    "AdapterLoadError",
    "StagedAdapter",
    "adapter_path",
    "install_loader",
    "loader_validations",
    "prune",
    "stage",
    "staged",
    "unstage",
]

#: ``LoRARequest.lora_path`` of an adapter lora_stream staged in memory.
ADAPTER_SCHEME = "lora-stream://"

#: The checks vLLM's own ``WorkerLoRAManager._load_adapter`` runs on the ``LoRAModel`` it built, as methods of its
#: ``LoRAModelManager`` called with that model, in the loader's order: one tuple per vLLM loader, newest first.
#: :func:`loader_validations` picks the first whose methods the running release has all of (each later tuple is
#: a subset of what an older release has, so the order matters). tests/vllm_contract.py checks, for every supported
#: release's source, that the tuple picked for it is exactly the calls its ``_load_adapter`` makes.
LOADER_VALIDATIONS: tuple[tuple[str, ...], ...] = (
    # vLLM 0.33, 0.34: the classification-head checks merged into one
    ("_validate_moe_lora_format", "_validate_classification_head_lora"),
    # vLLM 0.32
    ("_validate_moe_lora_format", "_validate_modules_to_save", "_validate_token_classification_lora"),
    # vLLM 0.31: no MoE format check yet
    ("_validate_modules_to_save", "_validate_token_classification_lora"),
)

_LOCK = threading.Lock()
_STAGED: dict[str, StagedAdapter] = {}
_installed = False


class AdapterLoadError(LoraStreamError):
    """vLLM's LoRA manager cannot serve the adapter as the trainer applies it (a module it has no LoRA layer for,
    a missing factor, a scaling other than 1, an option vLLM refuses). Raised before the previous version is
    replaced: the engine keeps serving it."""


@dataclass(frozen=True)
class StagedAdapter:
    """One adapter version held in the worker process: its tensors (peft checkpoint names) and its config."""

    tensors: dict[str, torch.Tensor]
    config: dict[str, Any]
    version: str | None = None


def adapter_path(name: str, tag: str | None = None) -> str:
    """The ``lora_path`` under which the adapter ``name`` is staged (what the sink's ``LoRARequest`` carries);
    with ``tag``, one version of it (the server sink stages every version under a path of its own)."""
    return ADAPTER_SCHEME + name + (f"@{tag}" if tag else "")


def prune(path: str, keep: str | None) -> None:
    """Drop the staged versions of ``path``'s adapter other than ``path`` itself and ``keep``."""
    stem = path.split("@", 1)[0]
    with _LOCK:
        for other in [p for p in _STAGED if p.split("@", 1)[0] == stem and p not in (path, keep)]:
            del _STAGED[other]


def stage(path: str, adapter: StagedAdapter) -> StagedAdapter | None:
    """Hold ``adapter`` for the next ``_load_adapter`` of ``path``; returns the version it replaces (to put back
    if vLLM refuses the new one)."""
    if not path.startswith(ADAPTER_SCHEME):
        raise ValueError(f"{path!r} is not a lora_stream adapter path ({ADAPTER_SCHEME}<name>)")
    install_loader()
    with _LOCK:
        previous = _STAGED.get(path)
        _STAGED[path] = adapter
    return previous


def unstage(path: str, previous: StagedAdapter | None) -> None:
    """Put ``previous`` back under ``path`` (or drop the path when there was none)."""
    with _LOCK:
        if previous is None:
            _STAGED.pop(path, None)
        else:
            _STAGED[path] = previous


def staged(path: str) -> StagedAdapter | None:
    """The adapter staged under ``path`` in this process, if any."""
    with _LOCK:
        return _STAGED.get(path)


def install_loader() -> None:
    """Wrap vLLM's ``WorkerLoRAManager._load_adapter`` once per process so that ``lora-stream://`` paths are read
    from memory. Idempotent; other paths keep vLLM's own loader."""
    global _installed
    with _LOCK:
        if _installed:
            return
        from vllm.lora.worker_manager import WorkerLoRAManager

        original = WorkerLoRAManager._load_adapter

        def _load_adapter(self: Any, lora_request: Any) -> Any:
            path = str(getattr(lora_request, "lora_path", "") or "")
            if not path.startswith(ADAPTER_SCHEME):
                return original(self, lora_request)
            return build_lora_model(self, lora_request)

        _load_adapter.__wrapped__ = original  # type: ignore[attr-defined]
        WorkerLoRAManager._load_adapter = _load_adapter
        _installed = True


def build_lora_model(worker_manager: Any, lora_request: Any) -> Any:
    """vLLM's ``_load_adapter`` for a staged adapter: the same validation and ``LoRAModel`` construction, from
    memory, plus the checks that keep a silently partial adapter out of the engine."""
    from vllm.lora.peft_helper import PEFTHelper

    path = str(lora_request.lora_path)
    adapter = staged(path)
    if adapter is None:
        raise AdapterLoadError(
            f"no adapter is staged under {path!r} in this vLLM process; sync it with lora_stream's adapter sink "
            "before generating with it"
        )
    manager = worker_manager._adapter_manager
    helper = PEFTHelper.from_dict(
        {**adapter.config, "vllm_max_position_embeddings": worker_manager.max_position_embeddings}
    )
    try:
        helper.validate_legal(worker_manager.lora_config)
    except ValueError as exc:
        raise AdapterLoadError(f"vLLM refuses adapter {lora_request.lora_name!r}: {exc}") from exc
    model = manager.model
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    lora = worker_manager._lora_model_cls.from_lora_tensors(
        lora_model_id=lora_request.lora_int_id,
        tensors=dict(adapter.tensors),
        peft_helper=helper,
        device="cpu",
        dtype=worker_manager.lora_config.lora_dtype,
        model_vocab_size=worker_manager.vocab_size,
        weights_mapper=mapper.get_rename_mapper() if mapper is not None else None,
        skip_prefixes=getattr(model, "lora_skip_prefixes", None),
    )
    check_accepted(manager, lora, lora_request.lora_name)
    lora.is_3d_lora_weight = lora_request.is_3d_lora_weight
    for check in loader_validations(manager):
        getattr(manager, check)(lora)
    return lora


def loader_validations(manager: Any) -> tuple[str, ...]:
    """The names of the ``LoRAModelManager`` methods the running vLLM's own ``_load_adapter`` calls on a built
    adapter (``manager``: the adapter manager, or its class), from :data:`LOADER_VALIDATIONS`.

    Raises :class:`AdapterLoadError` when the release has none of the known sets: its loader validates in a way
    lora_stream does not know, and loading without those checks would let in an adapter vLLM refuses."""
    cls = manager if isinstance(manager, type) else type(manager)
    for names in LOADER_VALIDATIONS:
        if all(callable(getattr(cls, n, None)) for n in names):
            return names
    known = "; ".join(", ".join(names) for names in LOADER_VALIDATIONS)
    raise AdapterLoadError(
        f"vLLM's {cls.__name__} has none of the adapter validations lora_stream knows vLLM's loader to run "
        f"({known}); this vLLM release validates adapters differently, so lora_stream refuses to load one "
        "without its checks. Use a supported vLLM release (docs/compatibility.md)"
    )


def check_accepted(manager: Any, lora: Any, name: str) -> None:
    """Every LoRA of ``lora`` lands on one of the engine's LoRA layers, whole, with scaling 1.

    vLLM's activation skips a LoRA whose module name matches no LoRA layer, silently; the engine would then serve
    the base weights there while the trainer applies the adapter. The accepted names are the engine's own: its
    LoRA layers and the slices of its packed ones (``q_proj`` of ``qkv_proj``)."""
    accepted = set(manager.modules) | {n for subs in manager.packed_modules.values() for n in subs}
    unknown = sorted(m for m in lora.loras if m not in accepted)
    if unknown:
        shown = ", ".join(unknown[:5]) + (f" (+{len(unknown) - 5} more)" if len(unknown) > 5 else "")
        raise AdapterLoadError(
            f"adapter {name!r}: vLLM's {type(manager.model).__name__} has no LoRA layer for {shown}; the engine "
            "would serve the base weights there. Sync this model merged (ParamStream) instead"
        )
    for module, weights in lora.loras.items():
        if weights.lora_a is None or weights.lora_b is None:
            raise AdapterLoadError(f"adapter {name!r}: module {module!r} is missing lora_A or lora_B")
        if weights.scaling != 1:
            raise AdapterLoadError(
                f"adapter {name!r}: vLLM would scale module {module!r} by {weights.scaling}; lora_stream folds the "
                "scaling into lora_B and sends r == lora_alpha (was the config changed on the way?)"
            )
    if not lora.loras:
        raise AdapterLoadError(f"adapter {name!r} holds no LoRA weights vLLM can apply")
