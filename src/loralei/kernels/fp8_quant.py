r"""Per-row e4m3 quantization of an activation for the FP8 GEMMs, in one Triton kernel.

For a (rows, cols) ``x`` and an optional (cols,) FP32 column factor ``c`` (the weight's row scales, folded into
``dY`` for the input gradient), each row ``v = x[i] · c`` (in FP32) gets::

    scale_i = amax(|v|) / 448          (1 for an all-zero row)
    code_ij = e4m3(clamp(v_j / scale_i, ±448))     (round to nearest even)

the recipe of :func:`loralei.modules.quantized.fp8_gemm.quantize_rows`, bit for bit: the divisions are
the correctly rounded ones (``div_rn``; plain ``/`` compiles to an approximate division on NVIDIA GPUs), and
the rounding to e4m3 is done in FP32 (:func:`round_e4m3`), so that the final conversion is exact on every
backend (Triton's interpreter truncates where the GPU rounds). The
output has ``padded_rows >= rows`` rows: the extra rows get zero codes and scale 1, the padding FP8 GEMMs need.

One program per row reads it twice (the maximum, then the codes; the second read comes from L2), so a row of
``x`` is read from memory once and written as one byte per element: the torch recipe's FP32 copies, the absolute
values and the folded product never exist.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

# tl: a kernel's annotations need it (activations supplies a stand-in where triton is missing)
from .activations import build_kernel, interpret_requested, jit_helper, tl, triton_usable
from .cross_entropy import max_combine

E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max  # 448.0
_MAX_BLOCK = 4096


@jit_helper
def round_e4m3(v):
    """FP32 ``v`` (|v| <= 448) rounded to the nearest e4m3 value, ties to even, still in FP32.

    Normal e4m3 values (|v| >= 2^-6) keep 3 of FP32's 23 mantissa bits: the 20 dropped bits are rounded off on
    the bit pattern (a carry moves into the exponent, as it should). Below 2^-6 the values are multiples of
    2^-9: ``|v|·512`` (exact) is rounded to an integer by adding and subtracting 2^23, the one FP32 rounding.
    """
    bits = v.to(tl.int32, bitcast=True)
    magnitude = bits & 0x7FFFFFFF
    normal = (magnitude + 0x7FFFF + ((magnitude >> 20) & 1)) & -0x100000
    small = ((tl.abs(v) * 512.0 + 8388608.0) - 8388608.0) * 0.001953125
    rounded = tl.where(magnitude >= 0x3C800000, normal.to(tl.float32, bitcast=True), small)  # 2^-6
    return tl.where(v < 0, -rounded, rounded)


def _quantize_rows_kernel(
    x_ptr, factor_ptr, codes_ptr, scales_ptr, rows, cols, stride,
    HAS_FACTOR: tl.constexpr, STEPS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    live_cols = tl.where(row < rows, cols, 0)  # padding rows read nothing: zero codes, scale 1
    x_row = x_ptr + row.to(tl.int64) * stride
    amax = tl.full([BLOCK], 0.0, tl.float32)
    for step in range(STEPS):
        offs = step * BLOCK + tl.arange(0, BLOCK)
        ok = offs < live_cols
        v = tl.load(x_row + offs, mask=ok, other=0.0).to(tl.float32)
        if HAS_FACTOR:
            v = v * tl.load(factor_ptr + offs, mask=ok, other=0.0)
        amax = tl.maximum(amax, tl.abs(v))
    top = tl.reduce(amax, 0, max_combine)
    scale = tl.where(top > 0, tl.math.div_rn(top, 448.0), 1.0)
    codes_row = codes_ptr + row.to(tl.int64) * cols
    for step in range(STEPS):
        offs = step * BLOCK + tl.arange(0, BLOCK)
        ok = offs < live_cols
        v = tl.load(x_row + offs, mask=ok, other=0.0).to(tl.float32)
        if HAS_FACTOR:
            v = v * tl.load(factor_ptr + offs, mask=ok, other=0.0)
        code = round_e4m3(tl.minimum(tl.maximum(tl.math.div_rn(v, scale), -448.0), 448.0))
        tl.store(codes_row + offs, code.to(codes_ptr.dtype.element_ty), mask=offs < cols)
    tl.store(scales_ptr + row, scale)


@functools.cache
def _launcher(interpret: bool):
    """The kernel compiled for the GPU or wrapped for the interpreter, built once per mode."""
    return build_kernel(_quantize_rows_kernel, interpret)


def usable(x: Tensor) -> bool:
    """Whether the kernel can run on ``x`` (see :func:`loralei.kernels.activations.triton_usable`)."""
    return triton_usable(x)


def quantize_rows(x: Tensor, padded_rows: int, factor: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """e4m3 codes (padded_rows, cols) and FP32 scales (padded_rows, 1) of ``x`` (rows, cols) times ``factor``.

    Args:
        x: a 2-D tensor whose rows have unit stride (fp32, fp16 or bf16; see :func:`usable`).
        padded_rows: rows of the output, at least ``x``'s; the extra ones are zero codes with scale 1.
        factor: (cols,) FP32 factors each column is multiplied by before quantizing, or ``None``.
    """
    rows, cols = x.shape
    assert x.stride(1) == 1 and padded_rows >= rows
    codes = torch.empty(padded_rows, cols, dtype=E4M3, device=x.device)
    scales = torch.empty(padded_rows, 1, dtype=torch.float32, device=x.device)
    block = min(_MAX_BLOCK, max(16, 1 << (cols - 1).bit_length()))
    _launcher(interpret_requested())[(padded_rows,)](
        x, x if factor is None else factor, codes, scales, rows, cols, x.stride(0),
        HAS_FACTOR=factor is not None, STEPS=-(-cols // block), BLOCK=block, num_warps=8 if block >= 2048 else 4,
    )  # fmt: skip
    return codes, scales
