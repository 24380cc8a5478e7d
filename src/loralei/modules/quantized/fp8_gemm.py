"""The FP8 GEMMs of an FP8 base (``fp8_kernel="auto"``): the forward ``X Wᵀ`` and the input gradient ``dY W`` as
``torch._scaled_mm`` products of e4m3 operands, written in the compute dtype.

The activation side is quantized on the fly, one scale per row (per token): ``amax(|row|) / 448``, the weights'
recipe (:func:`quantize_rows`) except that the row is multiplied by the scale's reciprocal instead of divided by
the scale, by a Triton kernel that reads the activation once and writes the codes
(:mod:`loralei.kernels.fp8_operands`, bit-identical to ``quantize_rows(..., reciprocal=True)``; plain torch where
Triton cannot run). Where the kernel that wrote the activation took its row maxima and offered them
(:func:`loralei.kernels.fp8_operands.offer_row_maxima`: the fused gated MLP's ``h`` and ``[dG dU]``), the
quantization reads them instead of its first pass over the rows.

- Forward: ``Y = (X₈ sₓ)(W₈ s_w)ᵀ = _scaled_mm(X₈, W₈ᵀ, sₓ, s_wᵀ)``. ``W₈ᵀ`` is a column-major view of the stored
  row-major codes, the layout FP8 GEMMs take their second operand in, so nothing is copied. With ``fast_accum``
  (``LoRAConfig.fp8_fast_accum``, the default) it runs with fast accumulation (the tensor cores' partial sums are
  not periodically promoted to FP32), the split of TorchAO's Float8 training recipe: fast for the output, FP32
  for the gradients.
- Input gradient: ``dX = dY W = (dY diag(s_w)) W₈``. The weight's scales run along the reduction dimension here,
  where per-row scaling cannot apply them, so they are folded into ``dY`` as it is quantized (in the kernel),
  and ``W₈`` is transposed (by a Triton kernel) into a shared buffer (one per shape, as the dequantize
  backend's) to be the column-major operand: the stored weight stays one byte per element. The members of a
  shared-input group (q/k/v, gate/up) make one GEMM ``[dY_q dY_k dY_v] [W_q; W_k; W_v]``: one quantization of
  their output gradients, one product, no sums of partial products.

The projections of a shared-input group (q/k/v, gate/up) read one ``X``: it is quantized once, for the first of
them, and kept while that tensor lives and is not changed (:class:`_LastInput`).

FP8 GEMMs on the GPU need every dimension to be a multiple of 16: rows are padded with zeros here (their
outputs are dropped), and the weight's two dimensions are checked at injection (:func:`check_fp8_shape`).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from ...errors import InjectionError
from ...kernels import fp8_operands
from .buffers import shared_buffer

E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max  # 448.0
ALIGN = fp8_operands.ROW_ALIGN  # FP8 GEMMs on the GPU need dimensions divisible by this


def quantize_rows(x: Tensor, reciprocal: bool = False) -> tuple[Tensor, Tensor]:
    """e4m3 codes of a (rows, cols) tensor and its FP32 scales (rows, 1): ``amax(|row|) / 448``, 1 for a zero
    row; codes ``x / scale`` clamped to ±448 and rounded to the nearest e4m3 value.

    ``reciprocal``: ``x · (1 / scale)`` instead of ``x / scale`` (the activation recipe: what the Triton kernel
    computes, a multiplication being much cheaper there; the weights keep TorchAO's division).
    """
    x32 = x.float()
    amax = x32.abs().amax(dim=1, keepdim=True)
    # a tensor divisor: CUDA torch multiplies by the reciprocal of a Python scalar, which rounds differently
    scale = torch.where(amax > 0, amax / torch.full_like(amax, E4M3_MAX), 1.0)
    scaled = x32 * (torch.ones_like(scale) / scale) if reciprocal else x32 / scale
    return scaled.clamp_(-E4M3_MAX, E4M3_MAX).to(E4M3), scale


def check_fp8_shape(name: str, shape: torch.Size) -> None:
    """Refuses a weight that FP8 GEMMs cannot take, before anything changes.

    Raises:
        InjectionError: a dimension is not a multiple of 16.
    """
    if any(dim % ALIGN for dim in shape):
        raise InjectionError(
            f"module {name!r}: weight {tuple(shape)} has a dimension that is not a multiple of {ALIGN}, which FP8 "
            "GEMMs need; exclude the module, or set fp8_kernel='emulated'"
        )


def padded_rows(x: Tensor) -> Tensor:
    """``x`` with zero rows appended up to a multiple of 16 (the rows FP8 GEMMs take)."""
    extra = -x.shape[0] % ALIGN
    return F.pad(x, (0, 0, 0, extra)) if extra else x


def quantize_activation(
    xs: Sequence[Tensor], factors: Sequence[Tensor] | None = None
) -> tuple[Tensor, Tensor]:
    """:func:`quantize_rows` of the column concatenation of ``xs`` (T, cols_i), each times its (cols_i,) FP32
    factors (when given), its rows padded with zeros to a multiple of 16: the first operand of an FP8 GEMM."""
    if fp8_operands.usable(xs[0]):
        amax = fp8_operands.take_row_maxima(xs, factors)  # the rows' maxima, where their producer took them
        xs = [x if x.stride(1) == 1 else x.contiguous() for x in xs]
        return fp8_operands.quantize_rows(xs, fp8_operands.padded(xs[0].shape[0]), factors, amax=amax)
    parts = (
        [x.float() for x in xs]
        if factors is None
        else [x.float() * f for x, f in zip(xs, factors, strict=True)]
    )
    return quantize_rows(padded_rows(torch.cat(parts, 1)), reciprocal=True)


def transposed_codes(codes: Sequence[Tensor]) -> Tensor:
    """``[W_0; W_1; ...]ᵀ``'s codes (in, Σout) in the shared buffer of that shape, row-major."""
    widths = [c.shape[0] for c in codes]
    buffer = shared_buffer((codes[0].shape[1], sum(widths)), codes[0].dtype, codes[0].device)
    in_triton = fp8_operands.transposes_on(buffer.device)
    for c, part in zip(codes, buffer.split(widths, dim=1), strict=True):
        if in_triton:
            fp8_operands.transpose_into(c, part)
        else:
            part.copy_(c.t())
    return buffer


class _LastInput:
    """The last ``X`` quantized for a forward product, its codes and scales, while ``X`` lives (a weak reference:
    a new tensor at the same address is never mistaken for it) and keeps its version (not changed in place)."""

    ref: weakref.ref | None = None
    version = -1
    quantized: tuple[Tensor, Tensor] | None = None

    @classmethod
    def codes(cls, x: Tensor) -> tuple[Tensor, Tensor]:
        if cls.ref is None or cls.ref() is not x or cls.version != x._version:
            # quantized already where the kernel that wrote X made the codes (loralei's RMSNorm)
            cls.quantized = fp8_operands.take_codes(x) or quantize_activation([x])
            cls.ref, cls.version = weakref.ref(x, cls._forget), x._version
        assert cls.quantized is not None
        return cls.quantized

    @classmethod
    def _forget(cls, _ref: weakref.ref) -> None:
        if _ref is cls.ref:
            cls.ref, cls.quantized = None, None


def _scaled(
    a8: Tensor,
    scale_a: Tensor,
    b_t: Tensor,
    scale_b: Tensor,
    rows: int,
    dtype: torch.dtype,
    out: Tensor | None,
    fast_accum: bool = False,
) -> Tensor:
    """``a (b_t)`` from e4m3 ``a8`` (rows padded) and column-major e4m3 ``b_t`` with their scales, in ``dtype``
    (on CUDA the GEMM writes bf16, the one output type row-wise scaling takes there, cast when ``dtype`` differs),
    accumulated in FP32 or, with ``fast_accum``, with fast accumulation."""
    gemm_dtype = torch.bfloat16 if a8.is_cuda else dtype
    product = torch._scaled_mm(
        a8, b_t, scale_a=scale_a, scale_b=scale_b, out_dtype=gemm_dtype, use_fast_accum=fast_accum
    )[:rows]
    product = product.to(dtype)
    return product if out is None else out.add_(product)


def fp8_mm(
    x: Tensor, codes: Tensor, scales: Tensor, out: Tensor | None = None, fast_accum: bool = False
) -> Tensor:
    """``X Wᵀ`` (T, out) for X (T, in) and W = ``codes`` (out, in) times ``scales`` (out, 1); accumulated into
    ``out`` when given; with fast accumulation when ``fast_accum``."""
    return _scaled(*_LastInput.codes(x), codes.t(), scales.t(), x.shape[0], x.dtype, out, fast_accum)


def fp8_grad_mm(
    dys: Sequence[Tensor], codes: Sequence[Tensor], scales: Sequence[Tensor], out: Tensor | None = None
) -> Tensor:
    """``Σ_i dY_i W_i`` (T, in) for dY_i (T, out_i) and W_i as in :func:`fp8_mm` (at most three, one input
    width), as one FP8 GEMM over the concatenated ``[dY_i]`` and ``[W_i]``; accumulated into ``out`` when given."""
    factors = [s.view(-1) for s in scales]
    # quantized already where the kernel that wrote dY made the codes (loralei's RMSNorm, for o's dY)
    offered = fp8_operands.take_codes(dys[0], factors) if len(dys) == 1 else None
    a8, scale_a = offered or quantize_activation(dys, factors)
    width = codes[0].shape[1]
    b_t = transposed_codes(codes).t()
    return _scaled(a8, scale_a, b_t, _unit_scales(width, b_t.device), dys[0].shape[0], dys[0].dtype, out)


@functools.cache
def _unit_scales(columns: int, device: torch.device) -> Tensor:
    """The (1, columns) scales of a second operand whose scales were folded into the first (read-only; one per
    width and device instead of one per product)."""
    return torch.ones(1, columns, dtype=torch.float32, device=device)
