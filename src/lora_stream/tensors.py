"""How a gatherer refers to a parameter and hands out whole tensors: the three type aliases the gatherers, the merges
and the planner share. A module of its own, below :mod:`lora_stream.core` and :mod:`lora_stream.merge`, so that a
merge can name them without importing the types that name the merge."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["FullTensor", "ParamRef", "ShapeOf"]

#: What identifies one parameter to a gatherer: the ``nn.Parameter`` itself for every built-in gatherer except FSDP1
#: with ``use_orig_params=False``, whose original parameters do not exist between forwards (a slot object stands in).
ParamRef = Any

#: Gives the whole tensor of a parameter of the group being merged (the gatherer made it whole).
FullTensor = Callable[[Any], torch.Tensor]

#: Gives a parameter's whole shape without communication (a gatherer's ``full_shape``).
ShapeOf = Callable[[Any], torch.Size]
