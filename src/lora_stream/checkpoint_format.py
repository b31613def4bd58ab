"""The checkpoint's names and layouts, from transformers' own reversible weight conversions.

transformers 5 holds some weights differently in memory than on disk: MoE experts as one fused 3-D parameter
(``mlp.experts.gate_up_proj`` [E, 2I, H]) that ``save_pretrained`` writes back as one tensor per expert
(``mlp.experts.0.gate_proj.weight``, ...), renamed modules (GPT-NeoX's ``lm_head`` is ``embed_out`` on disk), split
projections concatenated again. An inference engine loads the checkpoint's layout. ``save_pretrained`` gets there
with ``transformers.core_model_loading.revert_weight_conversion``; so does this module, never with a table of its
own: a copy of transformers' mappings would drift from them.

``save_pretrained`` reverts the whole state dict at once; a stream has one group at a time. The conversions are
therefore split into **steps**: the in-memory tensors one conversion reads (one tensor for a rename or an expert
split, several for a concatenation) and the checkpoint tensors it writes. The split is verified when the stream is
planned: the steps, each reverted on its own, must give exactly the names, shapes and dtypes that one revert of the
whole model gives (computed on meta tensors: nothing is allocated, read or communicated). If they do not -- a
conversion transformers adds later that reads tensors of several layers, say -- the stream refuses the model
rather than guess; ``layout="memory"`` still streams it in memory layout.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from .core import Output
from .errors import LoraStreamError

__all__ = ["Layout", "FormatStep", "CheckpointFormat", "CheckpointFormatError"]

Layout = Literal["checkpoint", "memory"]
"""``"checkpoint"``: names, layouts and persistent buffers as ``save_pretrained`` writes them. ``"memory"``: the
parameters as ``named_parameters()`` holds them."""


class CheckpointFormatError(LoraStreamError):
    """transformers' conversions of this model cannot be applied group by group, or did not give what they promised."""


@dataclass
class FormatStep:
    """One conversion: the in-memory tensors it reads, and the checkpoint tensors it writes, in order.

    With ``convert`` false the step is one tensor, yielded as it is (under another name if transformers renames
    it); otherwise transformers' reverse operations run on the inputs (split, concatenate, transpose, ...).
    """

    inputs: list[str]
    outputs: list[Output]
    convert: bool


def _meta(specs: Sequence[Output]) -> dict[str, torch.Tensor]:
    return {s.name: torch.empty(s.shape, dtype=s.dtype, device="meta") for s in specs}


def _specs(state: dict[str, torch.Tensor]) -> list[Output]:
    return [Output(k, v.dtype, tuple(v.shape)) for k, v in state.items()]


class CheckpointFormat:
    """transformers' reversible conversions of one model, planned as :class:`FormatStep` s.

    ``model`` is the ``PreTrainedModel`` whose ``state_dict()`` keys are the in-memory names (the base model under a
    PEFT or trainer wrapper). A model that is not a transformers model, or a transformers without reversible
    conversions, has only ``"same"`` steps.
    """

    def __init__(self, model: nn.Module | None) -> None:
        self.model: Any = model if _has_conversions(model) else None

    @property
    def converts(self) -> bool:
        return self.model is not None

    def plan(self, tensors: Sequence[Output]) -> list[FormatStep]:
        """The steps that turn ``tensors`` (in-memory names, in stream order) into the checkpoint's tensors.

        Steps come in the order of their first input. Raises :class:`CheckpointFormatError` if the steps do not
        reproduce one revert of the whole set.
        """
        if self.model is None:
            return [FormatStep([t.name], [t], False) for t in tensors]
        from transformers.core_model_loading import revert_weight_conversion

        by_name = {t.name: t for t in tensors}
        keys = self._conversion_keys(list(by_name))
        steps: dict[tuple[str, str], FormatStep] = {}
        for t in tensors:
            kind, key = keys[t.name]
            step = steps.get((kind, key))
            if step is None:
                steps[(kind, key)] = FormatStep([t.name], [], kind == "convert")
            else:
                step.inputs.append(t.name)
        for (_, key), step in steps.items():
            if step.convert:
                step.outputs = _specs(revert_weight_conversion(self.model, _meta([by_name[n] for n in step.inputs])))
            elif len(step.inputs) > 1:
                raise CheckpointFormatError(f"transformers renames {step.inputs} all to {key!r} in the checkpoint")
            else:
                t = by_name[step.inputs[0]]
                step.outputs = [Output(key, t.dtype, t.shape)]
        whole = _specs(revert_weight_conversion(self.model, _meta(tensors)))
        self._verify(whole, [o for s in steps.values() for o in s.outputs])
        return list(steps.values())

    def apply(self, step: FormatStep, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """The checkpoint tensors of a converting ``step`` from its in-memory ``tensors`` (in ``step.inputs`` order),
        in ``step.outputs`` order. The names are checked here; the stream checks every output's shape and dtype."""
        from transformers.core_model_loading import revert_weight_conversion

        assert self.model is not None and step.convert
        out = revert_weight_conversion(self.model, dict(zip(step.inputs, tensors, strict=True)))
        if sorted(out) != sorted(o.name for o in step.outputs):
            raise CheckpointFormatError(
                f"transformers' conversion of {step.inputs} gave {sorted(out)}, but the plan promised "
                f"{[o.name for o in step.outputs]}"
            )
        return [out[o.name] for o in step.outputs]

    def _conversion_keys(self, names: list[str]) -> dict[str, tuple[str, str]]:
        """For each in-memory name: ``("convert", key)`` (the names sharing a key are one conversion's inputs) or
        ``("rename", new_name)``.

        This is the first half of ``revert_weight_conversion``, with transformers' own transforms and matching
        function, run over every name in the same (sorted) order so that order-dependent renamings behave as in
        ``save_pretrained``. Any difference from transformers' result is caught by :meth:`plan`'s verification.
        """
        from transformers.core_model_loading import (
            PrefixChange,
            WeightConverter,
            WeightRenaming,
            dot_natural_key,
            rename_source_key,
        )

        model: Any = self.model
        conversions = getattr(model, "_weight_conversions", None)
        if conversions is None:
            from transformers.conversion_mapping import get_model_conversion_mapping

            conversions = get_model_conversion_mapping(model, add_legacy=False)
            conversions = [c for c in conversions if not isinstance(c, PrefixChange)]
        reverse = [c.reverse_transform() for c in conversions[::-1]]
        renamings = [c for c in reverse if isinstance(c, WeightRenaming)]
        converters = [c for c in reverse if isinstance(c, WeightConverter)]
        # transformers >= 5.16 reverts in one call (converter first, then every renaming); earlier 5.x releases
        # (5.10, which verl pins) in two, bucketing a conversion by its name between the two phases.
        one_call = "reverse" in inspect.signature(rename_source_key).parameters
        out: dict[str, tuple[str, str]] = {}
        for name in sorted(names, key=dot_natural_key):
            if one_call:
                renamed, pattern = rename_source_key(name, renamings, converters, reverse=True)
            else:
                converted, pattern = rename_source_key(name, [], converters)
                renamed = converted if pattern is not None else rename_source_key(converted, renamings, [])[0]
            out[name] = ("convert", renamed) if pattern is not None else ("rename", renamed)
        return out

    @staticmethod
    def _verify(whole: list[Output], stepwise: list[Output]) -> None:
        a, b = {s.name: s for s in whole}, {s.name: s for s in stepwise}
        if a == b and len(stepwise) == len(b):
            return
        only_whole = sorted(set(a) - set(b))[:10]
        only_steps = sorted(set(b) - set(a))[:10]
        differ = sorted(n for n in set(a) & set(b) if a[n] != b[n])[:10]
        raise CheckpointFormatError(
            "transformers' weight conversions of this model cannot be applied one group at a time: reverting the "
            f"whole model gives {only_whole} that the steps do not, the steps give {only_steps} (or duplicates) that "
            f"it does not, and {differ} differ in shape or dtype. Stream it with layout='memory' and convert on the "
            "engine's side"
        )


def _has_conversions(model: nn.Module | None) -> bool:
    if model is None:
        return False
    try:
        from transformers import PreTrainedModel
        from transformers.core_model_loading import revert_weight_conversion  # noqa: F401
    except ImportError:  # transformers 4 holds every weight in checkpoint layout
        return False
    return isinstance(model, PreTrainedModel)
