r"""``Y = Σ addends + U Bᵀ`` as one autograd node: a projection's base output, its LoRA term and a residual summed
in one pass.

A projection writes its LoRA term first and lets the base GEMM accumulate into it
(:mod:`loralei.ops.projection`): a (T, out) write of the term, and the GEMM's read of it. Where the projection's
output goes straight into a residual add (the MLP's down projection in a pre-norm decoder layer), the add reads
the base output anyway, so the term can join there instead: the projection hands over its base output and
``U' = s · D(X) Aᵀ`` (T, r), the add writes ``h + Y₀ + U' Bᵀ`` (:mod:`loralei.kernels.narrow_product` with
addends: fp32 sum, rounded once), and neither the term's write nor the GEMM's read of it remains.

Backward, from dY (T, out)::

    dAddend_i = dY;   dU' = dY B;   dB = dYᵀ U'

``dU'`` is the projection's ``G = dY B`` itself (the ``s`` lives in ``U'``), so the projection's backward takes
it as its G; ``dU'`` and ``dB`` come from one pass over dY where the output-gradient kernel runs
(:func:`loralei.ops.projection.factor_grads`).

Callers hand a term over only where the kernel runs (:func:`usable`); :func:`lowrank_sum` still sums in torch
wherever it does not.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..kernels import narrow_product
from .projection import factor_grads


class _LowRankSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, u: Tensor, b: Tensor, *addends: Tensor) -> Tensor:
        ctx.save_for_backward(u, b)
        ctx.addends = len(addends)
        return narrow_product.narrow_product(u, b.to(u.dtype).t(), 1.0, addends)

    @staticmethod
    def backward(ctx, dy: Tensor):
        u, b = ctx.saved_tensors
        dy = dy.contiguous()
        du, db = factor_grads(dy, u, b, 1.0)
        return du, db, *([dy] * ctx.addends)


def usable(u: Tensor, b: Tensor, *addends: Tensor) -> bool:
    """Whether the kernel computes ``Σ addends + U Bᵀ`` for a (T, r) ``u``, an (out, r) ``b`` and (T, out)
    ``addends`` (the narrow-product kernel's conditions with ``b`` cast to ``u``'s dtype; addends in ``u``'s
    dtype with contiguous columns)."""
    return (
        b.device == u.device
        and narrow_product.usable(u, b.to(u.dtype).t(), u.dtype)
        and all(a.dtype == u.dtype and a.dim() == 2 and a.stride(1) == 1 for a in addends)
    )


def lowrank_sum(u: Tensor, b: Tensor, *addends: Tensor) -> Tensor:
    """``Σ addends + U Bᵀ`` (T, out): one autograd node on the kernel where :func:`usable` holds, torch's ops
    elsewhere.

    Args:
        u: (T, r) left factor (the projection's ``s · D(X) Aᵀ``), any strides.
        b: (out, r) LoRA ``B``, any floating dtype (cast to ``u``'s for the product; dB comes back in its own).
        addends: up to two (T, out) tensors.
    """
    if usable(u, b, *addends):
        return _LowRankSum.apply(u, b, *addends)
    return sum(addends, u @ b.to(u.dtype).t())
