"""Scaled matmuls for LoRA terms and gradients: the scale is folded into the GEMM and the result lands in the
parameter's dtype.

A narrow product (the rank-r LoRA term ``s · U Bᵀ`` or ``G A`` written in full) runs loralei's Triton kernel
where it can (:mod:`loralei.kernels.narrow_product`: a write-bound product cuBLAS runs slower).

With ``lora_fp32_gradients`` the LoRA factors are FP32 while activations are bf16/fp16: the gradient GEMM then
reads the low-precision activations directly and writes FP32 (cuBLAS ``out_dtype``), so no full-size FP32 copy
of an activation is made. CPU has no such mixed GEMM; there the inputs are upcast (CPU runs are for tests).
"""

from __future__ import annotations

import torch

from ..kernels import narrow_product


def scaled_mm(a: torch.Tensor, b: torch.Tensor, alpha: float, out_dtype: torch.dtype) -> torch.Tensor:
    """``alpha * a @ b`` with the result in ``out_dtype``.

    Args:
        a: (m, k) matrix.
        b: (k, n) matrix of ``a``'s dtype.
        alpha: scale applied inside the GEMM.
        out_dtype: dtype of the result (``a``'s dtype, or FP32 for low-precision ``a`` and ``b``).

    Returns:
        (m, n) product.
    """
    if narrow_product.usable(a, b, out_dtype):
        return narrow_product.narrow_product(a, b, alpha)
    if out_dtype != a.dtype and a.is_cuda:
        out = torch.mm(a, b, out_dtype=out_dtype)
        return out if alpha == 1.0 else out.mul_(alpha)
    if out_dtype != a.dtype:
        a, b = a.to(out_dtype), b.to(out_dtype)
    # beta=0: the uninitialised "input" is never read (nor its NaNs propagated), only written over
    return torch.addmm(a.new_empty(a.shape[0], b.shape[1]), a, b, beta=0, alpha=alpha)
