"""From a trainer's module path to the base model's Hugging Face name.

Names are built by structure while the model is walked, never by editing strings afterwards: a wrapper's attribute
(DDP's ``module``, ``torch.compile``'s ``_orig_mod``, PEFT's ``base_model.model``, a tuner layer's ``base_layer``,
``modules_to_save.<adapter>``, ...) is dropped because *that object* is a wrapper and the child hangs under *that
attribute*, so a user's own module that happens to be called ``module`` or ``base_layer`` keeps its name.
A substring ``replace`` cannot make that distinction.

User renames run last, on the finished Hugging Face name:

* a mapping of anchored prefixes: ``{"model.language_model": "language_model.model"}`` rewrites a name that equals a
  key or starts with ``key + "."`` (whole dot-separated segments only, the longest key wins);
* a callable ``name -> new_name``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from torch import nn

from .errors import RenameError

__all__ = ["Renames", "register_wrapper", "wrapped_child_attr", "NameNormalizer"]

Renames = Mapping[str, str] | Callable[[str], str] | None
"""What ``renames=`` takes: a mapping of anchored name prefixes (a key matches a name equal to it or starting with
``key + "."``; the longest key wins), a callable returning the new name, or ``None``. Applied last."""

# (module path of the class, class name) -> attribute holding the wrapped module. Matched by qualified name so
# that checking a model never imports DeepSpeed, FSDP or torch._dynamo.
_WRAPPERS: dict[tuple[str, str], str] = {
    ("torch.nn.parallel.distributed", "DistributedDataParallel"): "module",
    ("torch.nn.parallel.data_parallel", "DataParallel"): "module",
    ("torch._dynamo.eval_frame", "OptimizedModule"): "_orig_mod",
    (
        "torch.distributed.algorithms._checkpoint.checkpoint_wrapper",
        "CheckpointWrapper",
    ): "_checkpoint_wrapped_module",
    (
        "torch.distributed.algorithms._checkpoint.checkpoint_wrapper",
        "OffloadWrapper",
    ): "_checkpoint_wrapped_module",
    (
        "torch.distributed.fsdp.fully_sharded_data_parallel",
        "FullyShardedDataParallel",
    ): "_fsdp_wrapped_module",
    ("deepspeed.runtime.engine", "DeepSpeedEngine"): "module",
    ("peft.peft_model", "PeftModel"): "base_model",
}


def register_wrapper(cls: type[nn.Module], attr: str) -> None:
    """Declare that ``cls`` wraps one module under ``attr``, so the ``attr.`` segment is dropped from names.

    Use it for a trainer's own wrapper class. Subclasses of a registered class are recognised too.
    """
    _WRAPPERS[(cls.__module__, cls.__qualname__)] = attr


def wrapped_child_attr(module: nn.Module) -> str | None:
    """The attribute under which ``module`` wraps the real model, or ``None`` if it is not a known wrapper."""
    for klass in type(module).__mro__:
        attr = _WRAPPERS.get((klass.__module__, klass.__qualname__))
        if attr is not None:
            return attr
    # Every PEFT subclass of PeftModel (PeftModelForCausalLM, ...) is found through the MRO above; a tuner model
    # (LoraModel, LoHaModel, ...) wraps the base model under `model`.
    try:
        from peft.tuners.tuners_utils import BaseTuner
    except ImportError:  # pragma: no cover - peft is a core dependency
        return None
    if isinstance(module, BaseTuner):
        return "model"
    return None


def join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


class NameNormalizer:
    """Applies the user's renames to a finished Hugging Face name and checks the result."""

    def __init__(self, renames: Renames = None) -> None:
        if renames is not None and not callable(renames) and not isinstance(renames, Mapping):
            raise TypeError(f"renames must be a mapping of name prefixes or a callable, got {type(renames).__name__}")
        self._renames = renames
        if isinstance(renames, Mapping):
            for k, v in renames.items():
                if not isinstance(k, str) or not isinstance(v, str) or not k:
                    raise RenameError(f"renames mapping must map non-empty str to str, got {k!r} -> {v!r}")
            # Longest prefix first, so {"a": .., "a.b": ..} rewrites "a.b.c" by "a.b".
            self._prefixes = sorted(renames.items(), key=lambda kv: -len(kv[0]))

    def __call__(self, hf_name: str, source: str) -> str:
        """Return the final name of the parameter that the trainer calls ``source``."""
        renames = self._renames
        if renames is None:
            return hf_name
        if isinstance(renames, Mapping):
            for old, new in self._prefixes:
                if hf_name == old:
                    return new
                if hf_name.startswith(old + "."):
                    return join(new, hf_name[len(old) + 1 :])
            return hf_name
        out = renames(hf_name)
        if not isinstance(out, str) or not out:
            raise RenameError(
                f"rename callable returned {out!r} for parameter {source!r} (named {hf_name!r}); "
                "it must return a non-empty str"
            )
        return out
