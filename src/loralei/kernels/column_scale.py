r"""DoRA's output scaling in place: ``Y = g ⊙ Z (+ bias)`` per column over a (T, N) ``Z`` (a Triton kernel).

Shapes: ``Z`` (T, N) in bf16/fp16/fp32 with contiguous columns, ``g`` (N,) FP32, ``bias`` (N,) in ``Z``'s dtype or
FP32. A DoRA projection scales each column of its LoRA output by ``g = m / ‖W + s B A‖`` (:mod:`loralei.ops.dora`).
In torch, ``Z.mul_(g)`` of a bf16 tensor by an FP32 vector takes the generic type-promoting broadcast path (about
1.2 TB/s on an H200, where a plain bf16 pass moves 2.5+ TB/s), and a bias is a second pass. Here one pass reads
and writes each tile once.

Exactly torch's values: the product is taken in FP32 and rounded once to ``Z``'s dtype (what ``Z.mul_(g)``
computes), then the bias is added to that rounded value in FP32 and rounded again (what ``.add_(bias)`` after it
computes). On the GPU the kernel is compiled without FMA contraction, so an FP32 ``Z`` with a bias is not fused
into one ``fma`` (which would round once where torch rounds twice).

Launch only where :func:`usable` says so; the caller keeps the torch passes for the rest.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from .activations import build_kernel, interpret_requested, tl, triton, triton_usable


class Tiling(NamedTuple):
    """One program's tile (rows × columns) and its warps (``benchmarks/bench_column_scale.py`` times others)."""

    rows: int
    columns: int
    warps: int


GPU_TILING = Tiling(32, 256, 4)  # a 16 KiB bf16 tile
_INTERPRETER_TILING = Tiling(16, 32, 1)


def _scale_columns_kernel(
    y_ptr, g_ptr, bias_ptr, n_rows, n_cols, stride_y, BT: tl.constexpr, BN: tl.constexpr, BIAS: tl.constexpr
):  # fmt: skip
    """Tile ``(pid(0), pid(1))`` of ``y``: ``y ⊙ g`` in FP32 rounded to ``y``'s dtype, then ``+ bias`` in FP32
    rounded again where ``BIAS``; stored over ``y``."""
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    col_ok = cols < n_cols
    ok = (rows < n_rows)[:, None] & col_ok[None, :]
    ptrs = y_ptr + rows.to(tl.int64)[:, None] * stride_y + cols[None, :]
    g = tl.load(g_ptr + cols, mask=col_ok, other=0.0)
    out = (tl.load(ptrs, mask=ok, other=0.0).to(tl.float32) * g[None, :]).to(y_ptr.dtype.element_ty)
    if BIAS:
        bias = tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        out = (out.to(tl.float32) + bias[None, :]).to(y_ptr.dtype.element_ty)
    tl.store(ptrs, out, mask=ok)


@functools.cache
def _kernel(interpret: bool):
    """The kernel compiled for the GPU or wrapped for the interpreter, built once per mode."""
    return build_kernel(_scale_columns_kernel, interpret)


def usable(y: torch.Tensor, g: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether the kernel can scale ``y`` here: Triton runs on the 2-D ``y`` (see
    :func:`~loralei.kernels.activations.triton_usable`) with contiguous columns, ``g`` is FP32 of ``y``'s column
    count on its device, ``bias`` (if any) likewise in ``y``'s dtype or FP32, and no ``torch.compile`` trace is
    running (the launcher is plain Python)."""
    if torch.compiler.is_compiling() or not triton_usable(y) or y.dim() != 2 or y.stride(1) != 1:
        return False
    vectors = [(g, (torch.float32,))] + ([] if bias is None else [(bias, (y.dtype, torch.float32))])
    return all(v.shape == (y.shape[1],) and v.dtype in ok and v.device == y.device for v, ok in vectors)


def scale_columns_(
    y: torch.Tensor, g: torch.Tensor, bias: torch.Tensor | None = None, tiling: Tiling | None = None
) -> torch.Tensor:
    """``y ← g ⊙ y (+ bias)`` in place, bit for bit ``y.mul_(g)`` (then ``.add_(bias)``); :func:`usable` must hold.

    Args:
        y: (T, N) tensor, contiguous columns (any row stride).
        g: (N,) FP32 column factors.
        bias: (N,) in ``y``'s dtype or FP32, or None.
        tiling: the launch (default :data:`GPU_TILING`; the interpreter's own small tiles there).

    Returns:
        ``y``.
    """
    n_rows, n_cols = y.shape
    if not (n_rows and n_cols):
        return y
    interpret = interpret_requested()
    tiling = tiling or (_INTERPRETER_TILING if interpret else GPU_TILING)
    grid = (triton.cdiv(n_rows, tiling.rows), triton.cdiv(n_cols, tiling.columns))
    g = g.contiguous()
    bias_arg = g if bias is None else bias.contiguous()  # never read without BIAS
    options = {} if interpret else {"num_warps": tiling.warps, "enable_fp_fusion": False}
    _kernel(interpret)[grid](
        y, g, bias_arg, n_rows, n_cols, y.stride(0), BT=tiling.rows, BN=tiling.columns, BIAS=bias is not None,
        **options,
    )  # fmt: skip
    return y
