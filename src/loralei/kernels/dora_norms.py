r"""DoRA's row norms ``‖W + s B A‖_row`` in one pass over the frozen base (a Triton kernel).

Shapes: ``W`` (out, in), ``A`` (r, in), ``B`` (out, r), ``AAᵀ`` (r, r) and ``‖W‖²_row`` (out,) in FP32. The norms
(:func:`loralei.ops.dora.row_norms`) are ``‖W‖²_row + 2 s rowsum((W Aᵀ) ⊙ B) + s² rowsum((B AAᵀ) ⊙ B)``, square
rooted. In torch that is a dozen and a half launches per projection and forward (casts of ``A`` and ``B``, the
two products, two row dots, the sums, the clamp and the root), about 3,800 small kernels a forward at the 8B
shape with r = 16 on the seven projections (twice that under checkpointing, before the recomputation reused the
forward's). Here one program per block of rows forms ``W Aᵀ`` for its rows (bound by reading ``W``, which the
torch product reads as well) and finishes its rows' norms from it, ``B`` and ``AAᵀ`` (a small product the caller
forms once, in FP32) without writing ``W Aᵀ`` out.

Values: ``W Aᵀ`` takes ``A`` rounded to ``W``'s dtype, products accumulated in FP32 (FP32 operands in full FP32,
not TF32), as the torch path's FP32-output GEMM; everything after it is FP32. Sums run in another order than the
torch path's, so the two agree to FP32 rounding, not bit for bit.

Launch only where :func:`usable` says so; the caller keeps the torch path for the rest.
"""

from __future__ import annotations

import functools

import torch

from .activations import (
    add_combine,
    build_kernel,
    dot_precision,
    interpret_requested,
    tl,
    triton,
    triton_usable,
)
from .gated_mlp_launch import interpreter_runs_loops

_BLOCKS = (32, 128)  # (rows, columns of W) per program on the GPU: an 8 KiB bf16 tile of W per step
_INTERPRETER_BLOCKS = (16, 32)
MAX_RANK = 128  # wider adapters keep the torch path (the (rows, r) accumulator would spill registers)


def _row_norms_kernel(
    w_ptr, a_ptr, b_ptr, aat_ptr, wsq_ptr, norm_ptr, n_out, n_in, rank, stride_w, stride_a, stride_b, scale,
    R: tl.constexpr, BO: tl.constexpr, BK: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """Rows ``pid(0)``: ``W Aᵀ`` over every column block of ``W``, then the rows' norms from it, ``B``, ``AAᵀ``."""
    rows = tl.program_id(0) * BO + tl.arange(0, BO)
    rk = tl.arange(0, R)
    row_ok, k_ok = rows < n_out, rk < rank
    r64 = rows.to(tl.int64)
    wa = tl.full((BO, R), 0.0, tl.float32)
    for c0 in range(0, n_in, BK):
        cols = c0 + tl.arange(0, BK)
        col_ok = cols < n_in
        w = tl.load(
            w_ptr + r64[:, None] * stride_w + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0
        )
        a = tl.load(
            a_ptr + rk[:, None] * stride_a + cols[None, :], mask=k_ok[:, None] & col_ok[None, :], other=0.0
        )
        wa += tl.dot(w, tl.trans(a.to(w.dtype)), input_precision=PRECISION)
    b = tl.load(
        b_ptr + r64[:, None] * stride_b + rk[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0
    )
    b = b.to(tl.float32)
    aat = tl.load(aat_ptr + rk[:, None] * rank + rk[None, :], mask=k_ok[:, None] & k_ok[None, :], other=0.0)
    cross = tl.reduce(wa * b, 1, add_combine)
    lora = tl.reduce(tl.dot(b, aat, input_precision="ieee") * b, 1, add_combine)
    total = tl.load(wsq_ptr + rows, mask=row_ok, other=0.0) + (2.0 * scale) * cross + (scale * scale) * lora
    tl.store(norm_ptr + rows, tl.sqrt(tl.maximum(total, 0.0)), mask=row_ok)


@functools.cache
def _kernel(interpret: bool):
    """The kernel compiled for the GPU or wrapped for the interpreter, built once per mode."""
    return build_kernel(_row_norms_kernel, interpret)


def usable(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, w_sq: torch.Tensor) -> bool:
    """Whether the kernel can take the norms here: Triton runs on the 2-D ``w`` (in the interpreter, one that runs
    loops) with contiguous columns, ``a`` and ``b`` are floating tensors of its device with contiguous columns
    and a rank up to :data:`MAX_RANK`, ``w_sq`` is FP32, and no ``torch.compile`` trace is running (the launcher
    is plain Python)."""
    if torch.compiler.is_compiling() or not triton_usable(w) or w.dim() != 2:
        return False
    if not (0 < a.shape[0] <= MAX_RANK and a.shape[1] == w.shape[1] and b.shape == (w.shape[0], a.shape[0])):
        return False
    if w_sq.dtype != torch.float32 or any(t.device != w.device or t.stride(-1) != 1 for t in (w, a, b)):
        return False
    if not (a.is_floating_point() and b.is_floating_point()):
        return False
    return not interpret_requested() or interpreter_runs_loops()


def row_norms(
    w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, aat: torch.Tensor, w_sq: torch.Tensor, scale: float
):
    """``‖W + s B A‖_row`` (out,) in FP32 from one launch; :func:`usable` must hold.

    Args:
        w: (out, in) the dense frozen base.
        a: (r, in) the LoRA ``A`` (any floating dtype; rounded to ``w``'s for ``W Aᵀ``).
        b: (out, r) the LoRA ``B``.
        aat: (r, r) ``A Aᵀ`` in FP32.
        w_sq: (out,) ``‖W‖²_row`` in FP32.
        scale: the LoRA scale ``s``.
    """
    n_out, n_in = w.shape
    rank = a.shape[0]
    interpret = interpret_requested()
    rows, columns = _INTERPRETER_BLOCKS if interpret else _BLOCKS
    norm = torch.empty(n_out, device=w.device, dtype=torch.float32)
    args = (w, a, b, aat.contiguous(), w_sq.contiguous(), norm, n_out, n_in, rank, w.stride(0), a.stride(0))
    _kernel(interpret)[(triton.cdiv(n_out, rows),)](
        *args, b.stride(0), float(scale), R=max(16, triton.next_power_of_2(rank)), BO=rows, BK=columns,
        PRECISION=dot_precision(w.dtype), **({} if interpret else {"num_warps": 4}),
    )  # fmt: skip
    return norm
