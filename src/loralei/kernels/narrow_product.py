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

With addends (up to two (T, N) tensors of the product's dtype) the kernel writes ``Σ addends + α · Z M``, summed in
fp32 and rounded once: where a projection's base output is already written, its LoRA term (and a residual) joins
it in the one pass that a residual add makes anyway, instead of a (T, N) write of the term that the base GEMM
then reads back (:mod:`loralei.ops.lowrank_sum`).
"""

from __future__ import annotations

import functools

import torch

from .activations import build_kernel, dot_precision, interpret_requested, tl, triton, triton_usable

MAX_WIDTH = 32  # r up to this runs here (at 48 the kernel measured no faster than cuBLAS)
_BLOCKS = (64, 128)  # (rows, columns) per program; the fastest of 7 tilings at every 8B shape (4 warps)
_INTERPRETER_BLOCKS = (16, 32)


def _narrow_product_kernel(
    z_ptr, m_ptr, out_ptr, a1_ptr, a2_ptr, n_rows, n_cols, width, stride_zt, stride_zk, stride_mk, stride_mn,
    stride_a1, stride_a2, alpha,
    R: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr, PRECISION: tl.constexpr, ADDENDS: tl.constexpr,
):  # fmt: skip
    """Tile ``(pid(0), pid(1))`` of ``α · Z M`` plus the first ``ADDENDS`` of ``a1``, ``a2`` (row strides given,
    contiguous columns), written to the contiguous ``out``."""
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
    ok, offsets = row_ok[:, None] & col_ok[None, :], rows.to(tl.int64)[:, None]
    if ADDENDS >= 1:
        tile += tl.load(a1_ptr + offsets * stride_a1 + cols[None, :], mask=ok).to(tl.float32)
    if ADDENDS >= 2:
        tile += tl.load(a2_ptr + offsets * stride_a2 + cols[None, :], mask=ok).to(tl.float32)
    tl.store(out_ptr + offsets * n_cols + cols[None, :], tile.to(out_ptr.dtype.element_ty), mask=ok)


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


def _check_addends(addends: tuple[torch.Tensor, ...], shape: tuple[int, int], z: torch.Tensor) -> None:
    if len(addends) > 2:
        raise ValueError(f"narrow_product takes at most 2 addends, got {len(addends)}")
    for a in addends:
        if a.shape != shape or a.dtype != z.dtype or a.device != z.device or (a.numel() and a.stride(1) != 1):
            raise ValueError(
                f"narrow_product: an addend is {tuple(a.shape)} {a.dtype} with strides {a.stride()} on "
                f"{a.device}; expected {shape} {z.dtype} on {z.device} with contiguous columns"
            )


def narrow_product(
    z: torch.Tensor, m: torch.Tensor, alpha: float, addends: tuple[torch.Tensor, ...] = ()
) -> torch.Tensor:
    """``Σ addends + α · Z M`` (T, N), contiguous, in the operands' dtype; :func:`usable` must hold.

    Args:
        z: (T, r) matrix, any strides.
        m: (r, N) matrix, any strides (e.g. ``B.t()``).
        alpha: the scale, applied to the fp32 products before the one rounding.
        addends: up to two (T, N) tensors in ``z``'s dtype with contiguous columns, added in fp32 before it.
    """
    (n_rows, width), n_cols = z.shape, m.shape[1]
    _check_addends(addends, (n_rows, n_cols), z)
    out = z.new_empty(n_rows, n_cols)
    if not (n_rows and n_cols):
        return out
    interpret = interpret_requested()
    rows, columns = _INTERPRETER_BLOCKS if interpret else _BLOCKS
    grid = (triton.cdiv(n_rows, rows), triton.cdiv(n_cols, columns))
    precision = dot_precision(z.dtype)
    a1, a2 = (*addends, out, out)[:2]  # never read beyond ADDENDS
    _kernel(interpret)[grid](
        z, m, out, a1, a2, n_rows, n_cols, width, *z.stride(), *m.stride(), a1.stride(0), a2.stride(0),
        float(alpha), R=max(16, triton.next_power_of_2(width)), BT=rows, BN=columns, PRECISION=precision,
        ADDENDS=len(addends),
    )  # fmt: skip
    return out
