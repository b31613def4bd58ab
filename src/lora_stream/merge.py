"""Out-of-place merges: how one output tensor is computed from whole (gathered) parameters.

A :class:`Merge` names the parameters it reads (so a gatherer can make exactly those whole) and computes one fresh
output tensor from them. It never writes to a parameter: the result is a new tensor, the base weight and the adapter
factors are only read. This is the point of the library: peft's in-place ``merge_adapter()`` / ``unmerge_adapter()``
rounds the base weight twice per sync in bf16 and drifts the training weights a little every step.

The math lives in one place per layer kind, as in peft's ``get_delta_weight``:

* :class:`LoraWeightMerge` -- LoRA / rsLoRA / DoRA on ``nn.Linear``, GPT-2's ``Conv1D`` (``fan_in_fan_out``) and
  ``nn.Embedding``. The delta is a low-rank product ``left @ right``, so the merge is computed in blocks of output
  rows (or columns), each block accumulated in float32 and rounded once into the output dtype. Temporaries are
  bounded by ``block_bytes`` whatever the weight's size: no full float32 copy of a large weight is ever made.
* :class:`LoraBiasMerge` -- ``lora_bias=True``: base bias + ``lora_B.bias * scaling``.
* :class:`DeltaMerge` -- any other additive tuner (LoHa, LoKr, LoRA on convolutions): the tuner layer's own
  ``get_delta_weight`` gives the delta, which is added to the base in float32. The delta is a full tensor here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from .buffers import Scratch

__all__ = [
    "DEFAULT_MERGE_BLOCK_BYTES",
    "Merge",
    "LoraTerm",
    "LoraWeightMerge",
    "LoraBiasMerge",
    "DeltaMerge",
    "FullTensor",
    "ShapeOf",
]

#: Largest float32 block a merge holds at once (per temporary). 8 MiB keeps a 4096 x 14336 MLP weight's merge
#: temporaries under 1% of the weight while each block is still a large enough GEMM to run at full speed.
DEFAULT_MERGE_BLOCK_BYTES = 8 * 1024 * 1024

#: Gives the whole tensor of a parameter of the group being merged (the gatherer made it whole).
FullTensor = Callable[[nn.Parameter], torch.Tensor]
#: Gives a parameter's whole shape without communication (a gatherer's ``full_shape``).
ShapeOf = Callable[[nn.Parameter], torch.Size]


class Merge:
    """How to compute one output tensor out of place.

    Contract, relied on by :class:`~lora_stream.ParamStream`:

    * ``params()`` lists every parameter ``compute`` reads. The stream makes exactly these whole (with the rest of
      the group) before calling ``compute``; a parameter missing from the list reads as a shard under ZeRO-3/FSDP
      and yields a wrongly shaped or silently wrong tensor.
    * ``compute`` returns a fresh tensor of the base's full shape in ``out_dtype`` and writes to no parameter.
      The float32 temporaries it holds at once are at most ``peak_temp_bytes()``; the stream reports that figure.
    """

    def params(self) -> list[nn.Parameter]:
        raise NotImplementedError

    def compute(self, full: FullTensor, out_dtype: torch.dtype, scratch: Scratch) -> torch.Tensor:
        raise NotImplementedError

    def peak_temp_bytes(self, shape_of: ShapeOf) -> int:
        raise NotImplementedError


@dataclass(frozen=True)
class LoraTerm:
    """One adapter's contribution to a LoRA-merged weight.

    ``delta = left @ right * scaling`` in the base weight's layout (after the transposes that ``fan_in_fan_out`` or
    an embedding imply), so that row ``i`` of the delta is ``left[i] @ right``. When ``magnitude`` is set the term
    is DoRA's: the running weight plus this delta is rescaled per output channel by
    ``magnitude / ||base + delta||`` (norm over the non-channel dimension), exactly as peft's ``DoraLinearVariant``
    and ``DoraEmbeddingVariant`` merge.
    """

    left: nn.Parameter
    right: nn.Parameter
    scaling: float
    left_transposed: bool
    right_transposed: bool
    magnitude: nn.Parameter | None = None


def _oriented(t: torch.Tensor, transposed: bool) -> torch.Tensor:
    return t.t() if transposed else t


@dataclass
class LoraWeightMerge(Merge):
    """``base + sum(left @ right * scaling)`` computed in float32 blocks, with DoRA's per-channel rescale.

    ``channel_dim`` is the dimension of the base weight that indexes output channels (0 for ``nn.Linear``'s
    ``[out, in]``, 1 for ``Conv1D``'s ``[in, out]`` and for an embedding under DoRA). Blocks are taken along it so
    that DoRA's per-channel norm is complete inside each block and the merge is a single pass.
    """

    base: nn.Parameter
    terms: Sequence[LoraTerm]
    channel_dim: int = 0
    block_bytes: int = DEFAULT_MERGE_BLOCK_BYTES
    _params: list[nn.Parameter] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        ps: list[nn.Parameter] = [self.base]
        for t in self.terms:
            ps += [t.left, t.right]
            if t.magnitude is not None:
                ps.append(t.magnitude)
        self._params = ps

    @property
    def has_dora(self) -> bool:
        return any(t.magnitude is not None for t in self.terms)

    def params(self) -> list[nn.Parameter]:
        return self._params

    def _block_len(self, shape: torch.Size) -> int:
        across = shape[1 - self.channel_dim]
        return max(1, self.block_bytes // (4 * max(1, across)))

    def peak_temp_bytes(self, shape_of: ShapeOf) -> int:
        shape = shape_of(self.base)
        n = min(self._block_len(shape), shape[self.channel_dim])
        block = n * shape[1 - self.channel_dim] * 4
        # Running block and one delta block; with DoRA also the unmerged base block and the norm's operand.
        blocks = 4 if self.has_dora else 2
        factors = sum((shape_of(t.left).numel() + shape_of(t.right).numel()) * 4 for t in self.terms)
        return blocks * block + factors

    def compute(self, full: FullTensor, out_dtype: torch.dtype, scratch: Scratch) -> torch.Tensor:
        base = full(self.base)
        if base.dim() != 2:
            raise ValueError(f"LoRA merge expects a 2-D base weight, got shape {tuple(base.shape)}")
        out = scratch.empty(base.shape, out_dtype, base.device)
        cd = self.channel_dim
        # Factors as float32, oriented so that delta = left @ right in the base's layout. They are rank-r, small.
        terms = [
            (
                _oriented(full(t.left), t.left_transposed).to(torch.float32),
                _oriented(full(t.right), t.right_transposed).to(torch.float32),
                float(t.scaling),
                None if t.magnitude is None else full(t.magnitude).reshape(-1).to(torch.float32),
            )
            for t in self.terms
        ]
        n_channels = base.shape[cd]
        across = base.shape[1 - cd]
        step = min(self._block_len(base.shape), n_channels)
        # Flat float32 workspaces, shared by every merge of the pass and reused for every block (viewed contiguous),
        # so the allocator sees a few buffers for the whole pass instead of fresh temporaries per block.
        n_ws = 3 if self.has_dora else 1
        ws = [scratch.workspace.get(i, step * across, base.device) for i in range(n_ws)]

        def view(buf: torch.Tensor, n: int) -> torch.Tensor:
            flat = buf.narrow(0, 0, n * across)
            return flat.view(n, across) if cd == 0 else flat.view(across, n)

        for start in range(0, n_channels, step):
            n = min(step, n_channels - start)
            running = view(ws[0], n)
            running.copy_(base.narrow(cd, start, n))  # a copy: never accumulate into the trainer's weight
            for left, right, scaling, magnitude in terms:
                lhs = left.narrow(0, start, n) if cd == 0 else left
                rhs = right if cd == 0 else right.narrow(1, start, n)
                if magnitude is None:
                    running.addmm_(lhs, rhs, alpha=scaling)
                    continue
                # DoRA: the norm is over the *unmerged* base plus this adapter's delta, as peft computes it in
                # forward and in merge; the factor then scales the running weight (base + earlier adapters).
                delta, unmerged = view(ws[1], n), view(ws[2], n)
                torch.mm(lhs, rhs, out=delta)
                delta.mul_(scaling)
                unmerged.copy_(base.narrow(cd, start, n))
                unmerged.add_(delta)
                norm = torch.linalg.vector_norm(unmerged, dim=1 - cd)
                running.add_(delta)
                running.mul_((magnitude.narrow(0, start, n) / norm).unsqueeze(1 - cd))
            out.narrow(cd, start, n).copy_(running)
        return out


@dataclass
class LoraBiasMerge(Merge):
    """``lora_bias=True``: ``bias + sum(lora_B.bias * scaling)``, in float32, rounded once."""

    base: nn.Parameter
    terms: Sequence[tuple[nn.Parameter, float]]

    def params(self) -> list[nn.Parameter]:
        return [self.base, *(p for p, _ in self.terms)]

    def peak_temp_bytes(self, shape_of: ShapeOf) -> int:
        return 2 * 4 * shape_of(self.base).numel()

    def compute(self, full: FullTensor, out_dtype: torch.dtype, scratch: Scratch) -> torch.Tensor:
        acc = full(self.base).to(torch.float32, copy=True)
        for bias, scaling in self.terms:
            acc.add_(full(bias).to(torch.float32), alpha=scaling)
        return acc.to(out_dtype)


@dataclass
class DeltaMerge(Merge):
    """Generic additive tuner: ``base + layer.get_delta_weight(adapter)`` for each active adapter.

    Used for tuner kinds whose merge peft defines as adding ``get_delta_weight`` (LoHa, LoKr, LoRA on
    convolutions). The delta is computed by peft from the layer's own (whole) adapter parameters, in their dtype;
    peft keeps adapters in float32 by default, so the sum is float32 and rounded once.
    """

    base: nn.Parameter
    layer: nn.Module
    adapters: Sequence[str]
    adapter_params: Sequence[nn.Parameter]

    def params(self) -> list[nn.Parameter]:
        return [self.base, *self.adapter_params]

    def peak_temp_bytes(self, shape_of: ShapeOf) -> int:
        return 3 * 4 * shape_of(self.base).numel()

    def compute(self, full: FullTensor, out_dtype: torch.dtype, scratch: Scratch) -> torch.Tensor:
        acc = full(self.base).to(torch.float32, copy=True)
        for adapter in self.adapters:
            delta = self.layer.get_delta_weight(adapter)  # type: ignore[operator]
            acc.add_(delta.to(torch.float32).reshape(acc.shape))
            del delta
        return acc.to(out_dtype)
