"""Quantization-aware LoRA (``LoRAConfig.qat``): the forward sees the merged weight as the deployment will store
it, ``W_q = Q(W + s·B·A)`` with ``Q = dequantize ∘ quantize`` of the export format, and the backward passes the
gradient through ``Q`` unchanged (a straight-through estimator).

The cost is inherent to the method: every forward forms the dense merged weight (one (out, in) matmul of rank r
and one add), quantizes and dequantizes it, and keeps ``W_q`` (one dense weight per projection) for the
input gradient; the products then run as a plain dense GEMM, never the fused LoRA ops.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from .weights import LoRAWeights

FakeQuantize = Callable[[Tensor], Tensor]  # (out, in) weight -> dequantize(quantize(weight)), same dtype


def merged_weight(w: LoRAWeights) -> Tensor:
    """``W + scale·B·A`` formed in FP32 (FP64 for an FP64 base) and rounded once to ``W``'s dtype (what merging
    stores)."""
    acc = torch.promote_types(w.W.dtype, torch.float32)
    delta = (w.B.detach().to(acc) @ w.A.detach().to(acc)) * w.scale
    return (w.W.detach().to(acc) + delta).to(w.W.dtype)


class QATLinear(torch.autograd.Function):
    """``Y = X Q(W + s·B·A)ᵀ (+ bias)`` with a straight-through ``Q``.

    Shapes: X (T, in), W (out, in), A (r, in), B (out, r), Y (T, out); s the LoRA scale.

    Forward: ``W_q = Q(W + s·B·A)`` (the merged weight rounded to W's dtype first), ``Y = X W_qᵀ + bias``.

    Backward (``∂W_q/∂(s·B·A)`` taken as the identity), with ``G = dYᵀ X`` the gradient of the merged weight,
    never formed:

    - ``dX = dY W_q`` (exact: Y is linear in X),
    - ``dA = s·Bᵀ G = s·(dY B)ᵀ X`` (r, in),
    - ``dB = s·G Aᵀ = s·dYᵀ (X Aᵀ)`` (out, r),

    each product in FP32 (FP64 for FP64 inputs) and returned in its factor's dtype; W and bias are frozen (no gradient).
    """

    @staticmethod
    def forward(ctx: Any, x: Tensor, A: Tensor, B: Tensor, w: LoRAWeights, quantize: FakeQuantize) -> Tensor:
        w_q = quantize(merged_weight(w))
        ctx.save_for_backward(x, A, B, w_q)
        ctx.scale = w.scale
        return F.linear(x, w_q, w.bias)

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor | None, ...]:
        x, A, B, w_q = ctx.saved_tensors
        dx = dy @ w_q if ctx.needs_input_grad[0] else None
        acc = torch.promote_types(dy.dtype, torch.float32)  # FP32, or FP64 for an FP64 twin
        dy_, x_ = dy.to(acc), x.to(acc)
        dA = ((dy_ @ B.to(acc)).t() @ x_).mul_(ctx.scale).to(A.dtype)  # s·(dY B)ᵀ X
        dB = (dy_.t() @ (x_ @ A.to(acc).t())).mul_(ctx.scale).to(B.dtype)  # s·dYᵀ (X Aᵀ)
        return dx, dA, dB, None, None


def qat_linear(x: Tensor, w: LoRAWeights, quantize: FakeQuantize) -> Tensor:
    """Quantization-aware LoRA projection of ``x`` (..., in): (..., out) in ``W``'s dtype (see
    :class:`QATLinear`).

    Args:
        x: input of any floating dtype; cast once to the base's dtype.
        w: the projection's weights; a dense frozen base (``w.W``) and no dropout.
        quantize: ``dequantize(quantize(·))`` of the export format, on an (out, in) weight.
    """
    x = x.to(w.W.dtype)
    y = QATLinear.apply(x.reshape(-1, x.shape[-1]), w.A, w.B, w, quantize)
    return y.reshape(*x.shape[:-1], y.shape[-1])
