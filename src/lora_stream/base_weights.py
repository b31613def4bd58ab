"""Base weights as a merge reads them: dense parameters, and bitsandbytes-quantized ones dequantized block by block.

A merge reads its base weight one block of output channels at a time into a float32 buffer. For a dense parameter
that is a narrow-and-copy. For a QLoRA base (bitsandbytes ``Params4bit`` / ``Int8Params``) it is bitsandbytes' own
dequantization of just those rows, so a merged 4-bit weight never needs a whole float copy of the base and the
quantized storage is only read. The dequantized values are exactly what bitsandbytes' (and peft's)
``dequantize_bnb_weight`` gives for the whole weight: the same kernel, in the same dtype, on a slice that starts and
ends on a quantization-block boundary.

Everything else that is quantized (GPTQ, AWQ, HQQ, torchao, ...) is refused by :func:`base_weight_of`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .errors import UnsupportedModelError

__all__ = ["BaseWeight", "RowReader", "DenseWeight", "Bnb4BitWeight", "Bnb8BitWeight", "base_weight_of", "is_quantized"]

#: Output dtype of a merged quantized base when the stream is given none: what vLLM and most trainers serve in.
QUANTIZED_DEFAULT_DTYPE = torch.bfloat16

#: Rows per interleaved group of bitsandbytes' CPU (AVX512-BF16) 4-bit layout (``block_n`` of its packing).
_CPU_PACK_ROWS = 32

#: Packages whose tensor classes hold quantized weights.
_QUANTIZER_PACKAGES = ("bitsandbytes", "torchao", "hqq", "optimum", "quanto", "compressed_tensors")
#: Packages whose layers are weight-only quantized, whatever their attributes look like.
_WEIGHT_ONLY_QUANTIZERS = ("auto_gptq", "gptqmodel", "awq", "hqq", "eetq", "aqlm", "optimum", "quanto", "vptq")


#: Writes rows ``[start, start + n)`` of a base weight (viewed as the matrix ``[shape[0], -1]``) into ``out``.
RowReader = Callable[[int, int, torch.Tensor], None]


class BaseWeight:
    """How a merge reads one base weight.

    ``param`` is what the gatherer must make whole; ``shape`` is the logical (dequantized) shape of the weight.
    ``row_reader(full)`` is called once per merge, after the gather, and returns a :data:`RowReader`; whatever the
    storage needs per weight (its layout, dequantized scales) is settled there, not when the stream was planned: a
    bitsandbytes layer may change its storage layout in place between planning and a pass. ``row_multiple()`` is the
    granularity at which row blocks may start (quantization blocks must not be cut), read at the same time.
    """

    param: Any
    shape: torch.Size
    quantized: bool = False

    def row_multiple(self) -> int:
        return 1

    def row_reader(self, full: Any) -> RowReader:
        raise NotImplementedError

    def dense(self, full: Any) -> torch.Tensor:
        """The whole weight (for merges that are not blocked): the parameter itself for a dense weight."""
        raise NotImplementedError


class DenseWeight(BaseWeight):
    """A plain floating-point parameter, whole once gathered."""

    def __init__(self, param: Any, shape: torch.Size) -> None:
        self.param, self.shape = param, shape

    def row_reader(self, full: Any) -> RowReader:
        w: torch.Tensor = full(self.param)
        matrix = w.reshape(w.shape[0], -1)

        def read(start: int, n: int, out: torch.Tensor) -> None:
            out.copy_(matrix.narrow(0, start, n))

        return read

    def dense(self, full: Any) -> torch.Tensor:
        t: torch.Tensor = full(self.param)
        return t


class Bnb4BitWeight(BaseWeight):
    """A bitsandbytes ``Params4bit`` (nf4 / fp4, with or without double quantization).

    The packed storage holds two 4-bit codes per byte in row-major order of the logical ``[out, in]`` weight, one
    absmax per ``blocksize`` codes. When a row is a whole number of quantization blocks (every real model: ``in`` is
    a multiple of 64), a block of rows is a byte range of the storage and a range of absmax entries, dequantized on
    its own by ``bitsandbytes.functional.dequantize_4bit``. Otherwise the weight is dequantized in one piece: the
    result must equal bitsandbytes' whole-weight dequantization bit for bit, and its CPU kernel (0.50) indexes
    blocks per row, so a slice that does not start a row on a block boundary would not. Double-quantized absmax is
    dequantized once per merge (``1/blocksize`` of the weight's elements).

    The quantization state is read from the parameter when a merge starts, never kept from planning:
    ``Linear4bit`` rewrites its storage and state in place into bitsandbytes' CPU layout at its first no-grad eval
    forward, which may come after the stream was built.
    """

    quantized = True

    def __init__(self, param: Any) -> None:
        self.param = param
        self.shape = torch.Size(param.quant_state.shape)
        self._cols = math.prod(self.shape[1:]) if len(self.shape) > 1 else 1

    def _cpu_packed(self) -> bool:
        return bool(getattr(self.param.quant_state, "packing_format_for_cpu", False))

    def row_multiple(self) -> int:
        if self._cpu_packed():
            return _CPU_PACK_ROWS
        return 1 if self._cols % int(self.param.quant_state.blocksize) == 0 else max(1, self.shape[0])

    def row_reader(self, full: Any) -> RowReader:
        import bitsandbytes.functional as F

        s = self.param.quant_state
        data = full(self.param).detach()
        if self._cpu_packed():
            table = F.get_4bit_type(s.quant_type, device=data.device).to(torch.bfloat16).float()

            def read_packed(start: int, n: int, out: torch.Tensor) -> None:
                out.copy_(self._cpu_packed_rows(data, table, start, n))

            return read_packed
        codes_flat = data.reshape(-1).view(torch.uint8)
        block = int(s.blocksize)
        if s.nested:
            absmax: torch.Tensor = F.dequantize_blockwise(s.absmax, s.state2)
            absmax += s.offset
            absmax = absmax.float()
        else:
            absmax = s.absmax.float()

        def read(start: int, n: int, out: torch.Tensor) -> None:
            first, count = start * self._cols, n * self._cols
            # Copies of the slices (a few bytes per row): bitsandbytes' CPU kernel does not honour a view's offset.
            rows_absmax = absmax.narrow(0, first // block, math.ceil(count / block)).clone()
            codes = codes_flat.narrow(0, first // 2, (count + 1) // 2).reshape(-1, 1).clone()
            rows_state = F.QuantState(
                absmax=rows_absmax,
                shape=torch.Size((n, self._cols)),
                blocksize=block,
                quant_type=s.quant_type,
                dtype=s.dtype,
            )
            out.copy_(F.dequantize_4bit(codes, rows_state))

        return read

    def _cpu_packed_rows(self, data: torch.Tensor, table: torch.Tensor, start: int, n: int) -> torch.Tensor:
        """Rows of a weight in bitsandbytes' AVX512-BF16 layout (``packing_format_for_cpu``).

        ``Linear4bit`` converts its weight in place to this layout on its first CPU forward in eval mode without
        grad (a GRPO loop's no-grad logprob pass does): codes ``[N, K/2]`` interleaved in groups of 32 rows, absmax
        ``[K/blocksize, N]`` in bfloat16, no double quantization. bitsandbytes ships no dequantization for it (its
        inverse conversion re-quantizes the absmax), so this undoes ``_convert_weight_packed_for_cpu`` for a group
        of rows: nibble ``j`` of a 64-code chunk is low for the first 32 codes, high for the next 32. The values are
        what the layer's own forward multiplies by from then on: the code table (``table``, rounded to bfloat16)
        times the bfloat16 absmax, rounded to bfloat16 (checked bit for bit by probing the layer with the identity
        matrix).
        """
        s = self.param.quant_state
        block, k = int(s.blocksize), self._cols
        b = data.narrow(0, start, n).reshape(-1, 32)
        nibbles = torch.cat([b & 0xF, b >> 4], dim=-1)  # [.., 64]: 32 low, then 32 high
        codes = nibbles.reshape(n // _CPU_PACK_ROWS, k // 2, _CPU_PACK_ROWS, 2).transpose(1, 2).reshape(n, k)
        scale = s.absmax.narrow(1, start, n).t().float().repeat_interleave(block, dim=1)[:, :k]
        # A product of two bfloat16 values is exact in float32, so this rounds once, as the bf16 kernel does.
        rows: torch.Tensor = (table[codes.long()] * scale).to(s.dtype)
        return rows

    def dense(self, full: Any) -> torch.Tensor:
        import bitsandbytes.functional as F

        if self._cpu_packed():
            whole = torch.empty(self.shape, dtype=torch.float32)
            self.row_reader(full)(0, self.shape[0], whole.view(self.shape[0], -1))
            return whole
        deq: torch.Tensor = F.dequantize_4bit(full(self.param).detach(), self.param.quant_state)
        return deq


class Bnb8BitWeight(BaseWeight):
    """A bitsandbytes ``Int8Params`` (LLM.int8()): int8 rows with one absmax per row (``SCB``)."""

    quantized = True

    def __init__(self, param: Any, scb: torch.Tensor) -> None:
        self.param = param
        self.shape = torch.Size(param.shape)
        self._scb = scb

    def row_reader(self, full: Any) -> RowReader:
        import bitsandbytes.functional as F

        data = full(self.param).detach()
        scb = self._scb.to(data.device)

        def read(start: int, n: int, out: torch.Tensor) -> None:
            out.copy_(F.int8_vectorwise_dequant(data.narrow(0, start, n), scb.narrow(0, start, n)))

        return read

    def dense(self, full: Any) -> torch.Tensor:
        import bitsandbytes.functional as F

        data = full(self.param).detach()
        whole: torch.Tensor = F.int8_vectorwise_dequant(data, self._scb.to(data.device))
        return whole


def is_quantized(module: nn.Module) -> bool:
    """Whether ``module``'s weight is stored quantized: a quantizer's tensor class, a non-float weight, or a module of
    a weight-only quantizer (GPTQ, AWQ, ... keep ``qweight`` / ``scales`` instead of a ``weight``).

    The module's class alone does not decide for packages that also ship float layers (torchao's ``Float8Linear``
    trains a float master weight, which is what an engine should receive)."""
    w = getattr(module, "weight", None)
    if isinstance(w, torch.Tensor) and not w.is_meta:
        if type(w).__module__.split(".")[0] in _QUANTIZER_PACKAGES or not w.is_floating_point():
            return True
    return type(module).__module__.split(".")[0] in _WEIGHT_ONLY_QUANTIZERS


def base_weight_of(module: nn.Module, param: Any | None, shape: torch.Size, where: str) -> BaseWeight | None:
    """The reader of ``module``'s weight ``param`` (``None`` if it has none); raises :class:`UnsupportedModelError`
    for a quantization that cannot be dequantized exactly here."""
    kind = type(param).__name__
    if kind == "Params4bit" and getattr(param, "quant_state", None) is not None:
        return Bnb4BitWeight(param)
    if kind == "Int8Params" and param is not None and param.dtype == torch.int8:
        scb = getattr(param, "SCB", None)
        if scb is None:
            scb = getattr(getattr(module, "state", None), "SCB", None)
        if scb is None:
            raise UnsupportedModelError(f"module {where}: an int8 bitsandbytes weight without its row scales (SCB)")
        return Bnb8BitWeight(param, scb)
    if kind in ("Params4bit", "Int8Params"):
        raise UnsupportedModelError(
            f"module {where} has a bitsandbytes {kind} weight that is not quantized yet: its forward quantizes it on "
            "the fly, so the stored values are not the quantized base weight it computes with. Load the model with "
            "from_pretrained(..., quantization_config=BitsAndBytesConfig(...)), or move it to its device, first"
        )
    if is_quantized(module):
        raise UnsupportedModelError(
            f"module {where} ({type(module).__name__}, weight {kind}) has a quantized base weight that lora_stream "
            "cannot dequantize exactly; bitsandbytes 4-bit and 8-bit bases are supported (dequantize the model first)"
        )
    return None if param is None else DenseWeight(param, shape)
