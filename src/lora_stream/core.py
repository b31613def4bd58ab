"""The ground floor: the types every layer of lora_stream shares, and nothing else.

Gatherers, merges, the planner, grouping and the sinks all speak of parameters (as a gatherer refers to them), whole
tensors (as a gatherer hands them out), output tensors (targets) and gather units. Keeping those here lets each of
those modules depend on this one instead of on each other (a gatherer need not import the merge module for a type
alias, nor grouping the planner).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from .tensors import FullTensor, ParamRef, ShapeOf

if TYPE_CHECKING:
    from .merge import Merge

__all__ = ["FullTensor", "ParamRef", "ShapeOf", "Output", "Step", "Target", "Unit"]


@dataclass
class Target:
    """One tensor of the merged model as it is held in memory: its Hugging Face name (``state_dict()`` key of the
    merged model), the trainer's path it comes from, and how it is computed. A :class:`Step` turns targets into
    the stream's outputs."""

    name: str
    source: str
    param: ParamRef
    dtype: torch.dtype
    shape: torch.Size
    merge: Merge | None = None


@dataclass(frozen=True)
class Output:
    """One tensor the stream yields: final name (checkpoint format, user renames applied), dtype and shape."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass
class Step:
    """The targets one checkpoint-format conversion reads (usually one) and the outputs it writes.

    ``convert`` turns the targets' tensors, in order, into the outputs' tensors, in order; ``None`` means each
    output is its target's tensor as is (nothing to convert, or a rename).
    """

    inputs: list[Target]
    outputs: list[Output]
    convert: Callable[[list[torch.Tensor]], list[torch.Tensor]] | None = None


@dataclass
class Unit:
    """The smallest gather unit: one module's own parameters, or one tuner layer with its adapter weights.

    A unit is never split across groups, so a merge always sees its base weight and its adapter factors whole.
    """

    module: str
    targets: list[Target] = field(default_factory=list)
    params: list[ParamRef] = field(default_factory=list)
    #: Filled once the unit's targets are planned into outputs (:func:`lora_stream.plan.plan_model`).
    steps: list[Step] = field(default_factory=list)
