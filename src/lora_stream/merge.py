"""Out-of-place merges: how one output tensor is computed from whole (gathered) parameters.

A :class:`Merge` names the parameters it reads (so a gatherer can make exactly those whole) and computes one fresh
output tensor from them. It never writes to a parameter: the result is a new tensor, the base weight and the adapter
factors are only read. This is the point of the library: peft's in-place ``merge_adapter()`` / ``unmerge_adapter()``
rounds the base weight twice per sync in bf16 and drifts the training weights a little every step.

The math lives in one place per layer kind, as in peft's ``get_delta_weight``:

* :class:`LoraWeightMerge` -- LoRA / rsLoRA / DoRA on ``nn.Linear``, GPT-2's ``Conv1D`` (``fan_in_fan_out``),
  ``nn.Embedding``, convolutions and bitsandbytes-quantized (QLoRA) bases. The delta is a low-rank product
  ``left @ right``, so the merge is computed in blocks of output rows (or columns), each block accumulated in
  float32 and rounded once into the output dtype. Temporaries are
  bounded by ``block_bytes`` whatever the weight's size: no full float32 copy of a large weight is ever made.
* :class:`LoraBiasMerge` -- ``lora_bias=True``: base bias + ``lora_B.bias * scaling``.
* :class:`ExpertLoraMerge` -- LoRA on 3-D MoE expert weights (peft's ``target_parameters``), expert by expert.
* :class:`LycorisMerge` -- LoHa and LoKr: peft's own LyCORIS weight functions applied to the gathered factors,
  added to the base in float32. The delta is a full tensor here.

Which merge a layer gets, and which peft options are refused, is decided by the table in :mod:`lora_stream.rules`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from .base_weights import BaseWeight
from .buffers import Scratch
from .tensors import FullTensor, ShapeOf

__all__ = [
    "DEFAULT_MERGE_BLOCK_BYTES",
    "Merge",
    "LoraTerm",
    "LoraWeightMerge",
    "LoraBiasMerge",
    "ScaledFactor",
    "LycorisMerge",
    "BufferRead",
    "ExpertLoraMerge",
    "FullTensor",
    "ShapeOf",
]

DEFAULT_MERGE_BLOCK_BYTES = 8 * 1024 * 1024
"""Largest float32 block a merge holds at once (per temporary). 8 MiB keeps a 4096 x 14336 MLP weight's merge
temporaries under 1% of the weight while each block is still a large enough GEMM to run at full speed."""


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


def _matrix(t: torch.Tensor) -> torch.Tensor:
    """A factor or weight as the matrix the merge works on: convolutions as ``[out, in * kernel]``."""
    return t if t.dim() == 2 else t.reshape(t.shape[0], -1)


@dataclass
class LoraWeightMerge(Merge):
    """``base + sum(left @ right * scaling)`` computed in float32 blocks, with DoRA's per-channel rescale.

    The base is read through a :class:`~lora_stream.base_weights.BaseWeight`, so a bitsandbytes-quantized base is
    dequantized block by block and its storage is only read. A convolution's weight ``[out, in, *kernel]`` is merged
    as the matrix ``[out, in * kernel]`` (peft's conv delta, ``conv(A^T, B)^T`` with a 1x1 ``B``, is exactly
    ``B @ A`` on those matrices), and DoRA's norm over every non-output dimension is the row norm of that matrix.
    With no terms this is a plain dequantization (a quantized layer without an adapter).

    ``channel_dim`` is the dimension of the base matrix that indexes output channels (0 for ``nn.Linear``'s
    ``[out, in]`` and for convolutions, 1 for ``Conv1D``'s ``[in, out]`` and for an embedding under DoRA). Blocks are
    taken along it so that DoRA's per-channel norm is complete inside each block and the merge is a single pass.
    """

    base: BaseWeight
    terms: Sequence[LoraTerm]
    channel_dim: int = 0
    block_bytes: int = DEFAULT_MERGE_BLOCK_BYTES
    _params: list[nn.Parameter] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.channel_dim != 0 and self.base.quantized:
            raise ValueError("a quantized base is read by rows; its channel dimension must be 0")
        ps: list[nn.Parameter] = [self.base.param]
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

    def _matrix_shape(self) -> tuple[int, int]:
        shape = self.base.shape
        return shape[0], shape.numel() // max(1, shape[0])

    def _block_len(self) -> int:
        mshape = self._matrix_shape()
        across = mshape[1 - self.channel_dim]
        n = max(1, self.block_bytes // (4 * max(1, across)))
        multiple = self.base.row_multiple() if self.channel_dim == 0 else 1
        return max(multiple, n // multiple * multiple)

    def peak_temp_bytes(self, shape_of: ShapeOf) -> int:
        mshape = self._matrix_shape()
        n = min(self._block_len(), mshape[self.channel_dim])
        block = n * mshape[1 - self.channel_dim] * 4
        # Running block; with terms one delta block; with DoRA also the unmerged base block and the norm's operand;
        # a quantized base adds its dequantized rows (at most float32-sized).
        blocks = (4 if self.has_dora else 2 if self.terms else 1) + (1 if self.base.quantized else 0)
        factors = sum((shape_of(t.left).numel() + shape_of(t.right).numel()) * 4 for t in self.terms)
        return blocks * block + factors

    def compute(self, full: FullTensor, out_dtype: torch.dtype, scratch: Scratch) -> torch.Tensor:
        # The base is read once: under FSDP1 every call of ``full`` is a whole copy of the weight, which
        # peak_temp_bytes does not count.
        base_param = self.base.param
        whole = full(base_param)

        def base_full(p: nn.Parameter) -> torch.Tensor:
            return whole if p is base_param else full(p)

        out = scratch.empty(self.base.shape, out_dtype, whole.device)
        out_m = out.view(self._matrix_shape())
        cd = self.channel_dim
        # Rows of the base (any storage) when blocks run along rows; columns of the dense base otherwise.
        read_rows = self.base.row_reader(base_full) if cd == 0 else None
        dense_m = None if cd == 0 else _matrix(self.base.dense(base_full))
        # Factors as float32 matrices, oriented so that delta = left @ right in the base's layout. They are rank-r.
        terms = [
            (
                _matrix(_oriented(full(t.left), t.left_transposed)).to(torch.float32),
                _matrix(_oriented(full(t.right), t.right_transposed)).to(torch.float32),
                float(t.scaling),
                None if t.magnitude is None else full(t.magnitude).reshape(-1).to(torch.float32),
            )
            for t in self.terms
        ]
        n_channels, across = out_m.shape[cd], out_m.shape[1 - cd]
        step = min(self._block_len(), n_channels)
        # Flat float32 workspaces, shared by every merge of the pass and reused for every block (viewed contiguous),
        # so the allocator sees a few buffers for the whole pass instead of fresh temporaries per block.
        n_ws = 3 if self.has_dora else 1
        ws = [scratch.workspace.get(i, step * across, out.device) for i in range(n_ws)]

        def view(buf: torch.Tensor, n: int) -> torch.Tensor:
            flat = buf.narrow(0, 0, n * across)
            return flat.view(n, across) if cd == 0 else flat.view(across, n)

        def read_base(start: int, n: int, into: torch.Tensor) -> None:
            # A copy either way: never accumulate into the trainer's weight.
            if read_rows is not None:
                read_rows(start, n, into)
            else:
                assert dense_m is not None
                into.copy_(dense_m.narrow(cd, start, n))

        for start in range(0, n_channels, step):
            n = min(step, n_channels - start)
            running = view(ws[0], n)
            if self.has_dora:
                base_block = view(ws[2], n)
                read_base(start, n, base_block)
                running.copy_(base_block)
            else:
                read_base(start, n, running)
            for left, right, scaling, magnitude in terms:
                lhs = left.narrow(0, start, n) if cd == 0 else left
                rhs = right if cd == 0 else right.narrow(1, start, n)
                if magnitude is None:
                    running.addmm_(lhs, rhs, alpha=scaling)
                    continue
                # DoRA: the norm is over the *unmerged* base plus this adapter's delta, as peft computes it in
                # forward and in merge; the factor then scales the running weight (base + earlier adapters).
                delta = view(ws[1], n)
                torch.mm(lhs, rhs, out=delta)
                delta.mul_(scaling)
                running.add_(delta)
                delta.add_(base_block)
                norm = torch.linalg.vector_norm(delta, dim=1 - cd)
                running.mul_((magnitude.narrow(0, start, n) / norm).unsqueeze(1 - cd))
            out_m.narrow(cd, start, n).copy_(running)
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
class ExpertLoraMerge(Merge):
    """LoRA on a 3-D expert weight (peft's ``ParamWrapper``, ``target_parameters``): expert by expert,
    ``W[e] + sum(scaling * B_e @ A_e)``, in float32 blocks of rows, rounded once.

    peft lays the experts out differently in the two factors: ``lora_A`` is ``[E * r, in]`` with expert ``e`` in
    rows ``e*r:(e+1)*r``, ``lora_B`` is ``[out, r * E]`` with expert ``e`` in columns ``e::E`` (its
    ``get_delta_weight`` reshapes ``B`` to ``[out, r, E]``). The weight is ``[E, out, in]`` (Qwen-MoE, Mixtral)
    or, for modules whose ``is_transposed`` is set (gpt-oss), ``[E, in, out]``, where the delta is transposed.
    """

    param: nn.Parameter
    shape: torch.Size
    #: ``(lora_A weight, lora_B weight, scaling)`` per active adapter.
    terms: Sequence[tuple[nn.Parameter, nn.Parameter, float]]
    transposed: bool
    block_bytes: int = DEFAULT_MERGE_BLOCK_BYTES

    def params(self) -> list[nn.Parameter]:
        return [self.param, *(p for a, b, _ in self.terms for p in (a, b))]

    def _block_len(self) -> int:
        return max(1, min(self.shape[1], self.block_bytes // (4 * max(1, self.shape[2]))))

    def peak_temp_bytes(self, shape_of: ShapeOf) -> int:
        factors = sum((shape_of(a).numel() + shape_of(b).numel()) * 4 for a, b, _ in self.terms)
        return self._block_len() * self.shape[2] * 4 + factors

    def compute(self, full: FullTensor, out_dtype: torch.dtype, scratch: Scratch) -> torch.Tensor:
        weight = full(self.param)
        out = scratch.empty(self.shape, out_dtype, weight.device)
        n_experts, rows, cols = self.shape
        factors = [(full(a).to(torch.float32), full(b).to(torch.float32), float(s)) for a, b, s in self.terms]
        step = self._block_len()
        ws = scratch.workspace.get(0, step * cols, weight.device)
        for e in range(n_experts):
            pairs = []
            for a, b, scaling in factors:
                r = a.shape[0] // n_experts
                a_e, b_e = a[e * r : (e + 1) * r], b[:, e::n_experts]  # [r, in], [out, r]
                left, right = (a_e.t(), b_e.t()) if self.transposed else (b_e, a_e)
                pairs.append((left, right, scaling))
            for start in range(0, rows, step):
                n = min(step, rows - start)
                running = ws.narrow(0, 0, n * cols).view(n, cols)
                running.copy_(weight[e].narrow(0, start, n))
                for left, right, scaling in pairs:
                    running.addmm_(left.narrow(0, start, n), right, alpha=scaling)
                out[e].narrow(0, start, n).copy_(running)
        return out


@dataclass
class ScaledFactor(Merge):
    """``scaling * factor``, in float32, rounded once: a LoRA ``lora_B`` with its layer's scaling folded in, so that
    an engine applying ``B' @ A`` with scaling 1 computes exactly the trainer's ``scaling * B @ A`` (the adapter
    stream, :class:`~lora_stream.AdapterStream`)."""

    factor: nn.Parameter
    scaling: float

    def params(self) -> list[nn.Parameter]:
        return [self.factor]

    def peak_temp_bytes(self, shape_of: ShapeOf) -> int:
        return 4 * shape_of(self.factor).numel()

    def compute(self, full: FullTensor, out_dtype: torch.dtype, scratch: Scratch) -> torch.Tensor:
        return torch.mul(full(self.factor).to(torch.float32), self.scaling).to(out_dtype)


@dataclass(frozen=True)
class BufferRead(Merge):
    """A persistent buffer the checkpoint holds (a router's ``e_score_correction_bias``), read as the module holds
    it: no gatherer shards buffers, and no adapter changes them. Kept in its own dtype, as ``save_pretrained``
    writes it."""

    module: nn.Module
    attr: str

    def params(self) -> list[nn.Parameter]:
        return []

    def peak_temp_bytes(self, shape_of: ShapeOf) -> int:
        return 0

    def compute(self, full: FullTensor, out_dtype: torch.dtype, scratch: Scratch) -> torch.Tensor:
        buf = self.module._buffers[self.attr]
        assert buf is not None
        return buf if buf.dtype == out_dtype else buf.to(out_dtype)


@dataclass
class LycorisMerge(Merge):
    """LoHa / LoKr: ``base + sum(delta(adapter))``, each delta built by peft's own LyCORIS weight functions
    (``make_weight``, ``make_weight_cp``, ``make_kron``) from the gathered factors, in float32, rounded once.

    The factors are read through the gatherer's accessor, never from the layer's attributes: under FSDP2 those are
    DTensor shards. Which function applies follows from which tensors the adapter holds
    (:func:`lora_stream.rules.lycoris_spec` checked that the set is a known one). The delta is a whole tensor of
    the base's shape (these products are not low-rank, so they cannot be blocked by rows the way LoRA is).
    """

    family: str
    base: BaseWeight
    adapters: Sequence[tuple[float, dict[str, nn.Parameter]]]

    def params(self) -> list[nn.Parameter]:
        return [self.base.param, *(p for _, factors in self.adapters for p in factors.values())]

    def peak_temp_bytes(self, shape_of: ShapeOf) -> int:
        factors = sum(shape_of(p).numel() * 4 for _, fs in self.adapters for p in fs.values())
        return 3 * 4 * self.base.shape.numel() + factors

    def _delta(self, scaling: float, t: dict[str, torch.Tensor]) -> torch.Tensor:
        if self.family == "loha":
            from peft.tuners.loha.layer import make_weight, make_weight_cp

            scale = torch.tensor(scaling)
            w = ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b")
            if "hada_t1" in t:
                delta: torch.Tensor = make_weight_cp(  # type: ignore[no-untyped-call]
                    t["hada_t1"], t[w[0]], t[w[1]], t["hada_t2"], t[w[2]], t[w[3]], scale
                )
            else:
                delta = make_weight(t[w[0]], t[w[1]], t[w[2]], t[w[3]], scale)  # type: ignore[no-untyped-call]
            return delta
        from peft.tuners.lokr.layer import make_kron
        from peft.tuners.lokr.layer import make_weight_cp as lokr_cp

        w1 = t["lokr_w1"] if "lokr_w1" in t else t["lokr_w1_a"] @ t["lokr_w1_b"]
        if "lokr_w2" in t:
            w2 = t["lokr_w2"]
        elif "lokr_t2" in t:
            w2 = lokr_cp(t["lokr_t2"], t["lokr_w2_a"], t["lokr_w2_b"])  # type: ignore[no-untyped-call]
        else:
            w2 = t["lokr_w2_a"] @ t["lokr_w2_b"]
        kron: torch.Tensor = make_kron(w1, w2, scaling)  # type: ignore[no-untyped-call]
        return kron

    def compute(self, full: FullTensor, out_dtype: torch.dtype, scratch: Scratch) -> torch.Tensor:
        acc = self.base.dense(full).to(torch.float32, copy=True)
        with torch.no_grad():
            for scaling, factors in self.adapters:
                delta = self._delta(scaling, {k: full(p).to(torch.float32) for k, p in factors.items()})
                acc.add_(delta.reshape(acc.shape))
                del delta
        return acc.to(out_dtype)
