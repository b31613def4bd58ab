"""``stream_merged_params``: a model's merged weights as one pass of a :class:`~lora_stream.ParamStream`, the shortest
way to read them (the pass is a :class:`~lora_stream.stream_pass.StreamPass`: iterate it inside ``with``, so that
leaving the block ends it on every rank).

Who calls it: users who only iterate the weights (a checkpoint, a custom engine); it builds the stream and opens its
pass, nothing more. What breaks if the pass were iterated outside ``with``: an exception leaving the loop ends the
pass only when its traceback is collected, and the other ranks learn of the stop that much later.
"""

from __future__ import annotations

import torch
from torch import nn

from .checkpoint_format import Layout
from .gatherers import Gatherer
from .grouping import DEFAULT_BUDGET_BYTES, GroupBy
from .merge import DEFAULT_MERGE_BLOCK_BYTES
from .names import Renames
from .stream import ParamStream
from .stream_pass import StreamPass

__all__ = ["stream_merged_params"]


def stream_merged_params(
    model: nn.Module,
    *,
    dtype: torch.dtype | None = None,
    gatherer: Gatherer | None = None,
    group_by: GroupBy = "layer",
    budget_bytes: int = DEFAULT_BUDGET_BYTES,
    renames: Renames = None,
    merge_block_bytes: int = DEFAULT_MERGE_BLOCK_BYTES,
    timeout: float = 300.0,
    reuse_outputs: bool = False,
    release_memory: bool = True,
    measure_rss: bool = False,
    layout: Layout = "checkpoint",
    prefetch: bool = False,
) -> StreamPass[tuple[str, torch.Tensor]]:
    """Iterate ``(hf_name, merged_tensor)`` over ``model``: one pass of a :class:`ParamStream` with these options.

    >>> with stream_merged_params(model) as weights:  # doctest: +SKIP
    ...     for name, tensor in weights:  # the base model's checkpoint names
    ...         ...
    """
    return iter(
        ParamStream(
            model,
            dtype=dtype,
            gatherer=gatherer,
            group_by=group_by,
            budget_bytes=budget_bytes,
            renames=renames,
            merge_block_bytes=merge_block_bytes,
            timeout=timeout,
            reuse_outputs=reuse_outputs,
            release_memory=release_memory,
            measure_rss=measure_rss,
            layout=layout,
            prefetch=prefetch,
        )
    )
