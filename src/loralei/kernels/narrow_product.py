r"""``α · Z M`` for a narrow ``Z`` (T, r) and ``M`` (r, N), r ≤ 32: a LoRA term written in full (a Triton kernel).

A LoRA projection writes its rank-r term ``s · U Bᵀ`` (T, out) first and lets the base GEMM accumulate into it
(:mod:`loralei.ops.projection`), and its input gradient starts the same way from ``G A``. Such a product reads
almost nothing and writes a (T, N) tensor: it is bound by the write. cuBLAS runs it at about 2.3 TB/s on an H200
(28 µs for 8192 × 16 × 4096 in bf16, replayed from a CUDA graph); one program per (rows × columns) tile that
forms its tile with one ``tl.dot`` and stores it writes at about 3.5 TB/s (19 µs;
``benchmarks/results/archive/2026-12-02-h200-gated-kernel-probes.json``). At r = 48 cuBLAS was as fast, so wider
products stay with it.

Products take the inputs' values with fp32 accumulation (fp32 inputs in full fp32, not TF32), scaled by ``α`` and
rounded once, like the GEMM they replace. Launch only where :func:`usable` says so.
"""

from __future__ import annotations

import functools

import torch

from .activations import build_kernel, dot_precision, interpret_requested, tl, triton, triton_usable

MAX_WIDTH = 32  # r up to this runs here (at 48 the kernel measured no faster than cuBLAS)
_BLOCKS = (64, 128)  # (rows, columns) per program; the fastest of 7 tilings at every 8B shape (4 warps)
_INTERPRETER_BLOCKS = (16, 32)


def _narrow_product_kernel(
    z_ptr, m_ptr, out_ptr, n_rows, n_cols, width, stride_zt, stride_zk, stride_mk, stride_mn, alpha,
    R: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """Tile ``(pid(0), pid(1))`` of ``α · Z M``, written to the contiguous ``out``."""
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    rk = tl.arange(0, R)
    row_ok, col_ok, k_ok = rows < n_rows, cols < n_cols, rk < width
    z = tl.load(
        z_ptr + rows.to(tl.int64)[:, None] * stride_zt + rk[None, :] * stride_zk,
        mask=row_ok[:, None] & k_ok[None, :],
        other=0.0,
    )
    m = tl.load(
        m_ptr + rk[:, None] * stride_mk + cols[None, :] * stride_mn,
        mask=k_ok[:, None] & col_ok[None, :],
        other=0.0,
    )
    tile = tl.dot(z, m, input_precision=PRECISION) * alpha
    out = out_ptr + rows.to(tl.int64)[:, None] * n_cols + cols[None, :]
    tl.store(out, tile.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@functools.cache
def _kernel(interpret: bool):
    return build_kernel(_narrow_product_kernel, interpret)


def usable(z: torch.Tensor, m: torch.Tensor, out_dtype: torch.dtype) -> bool:
    """Whether the kernel computes ``Z M`` here: Triton runs on ``z`` (see
    :func:`~loralei.kernels.activations.triton_usable`), both operands and the result share one dtype, ``Z``
    has at most :data:`MAX_WIDTH` columns, and no ``torch.compile`` trace is running (a compiled graph keeps
    the GEMM, which Inductor plans with the rest)."""
    return (
        not torch.compiler.is_compiling()
        and triton_usable(z)
        and z.dim() == m.dim() == 2
        and z.dtype == m.dtype == out_dtype
        and z.device == m.device
        and 0 < z.shape[1] <= MAX_WIDTH
        and z.shape[1] == m.shape[0]
    )


def narrow_product(z: torch.Tensor, m: torch.Tensor, alpha: float) -> torch.Tensor:
    """``α · Z M`` (T, N), contiguous, in the operands' dtype; :func:`usable` must hold.

    Args:
        z: (T, r) matrix, any strides.
        m: (r, N) matrix, any strides (e.g. ``B.t()``).
        alpha: the scale, applied to the fp32 products before the one rounding.
    """
    (n_rows, width), n_cols = z.shape, m.shape[1]
    out = z.new_empty(n_rows, n_cols)
    if not (n_rows and n_cols):
        return out
    interpret = interpret_requested()
    rows, columns = _INTERPRETER_BLOCKS if interpret else _BLOCKS
    grid = (triton.cdiv(n_rows, rows), triton.cdiv(n_cols, columns))
    precision = dot_precision(z.dtype)
    _kernel(interpret)[grid](
        z, m, out, n_rows, n_cols, width, *z.stride(), *m.stride(), float(alpha),
        R=max(16, triton.next_power_of_2(width)), BT=rows, BN=columns, PRECISION=precision,
    )  # fmt: skip
    return out
