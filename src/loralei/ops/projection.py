r"""Per-projection math shared by the fused ops (single projection, shared-input group, gated MLP).

Shapes: ``X`` (T, in), ``W`` (out, in), ``A`` (r, in), ``B`` (out, r), bias (out,), scale ``s``, keep-mask ``M``
(T, in) applied as ``D(X) = X ⊙ M · k`` (``k = 1/(1-p)`` for a drawn bool mask, 1 for a caller's scaled mask).

Order of the GEMMs (why it matters on the GPU): the rank-r LoRA term is computed *first* by a GEMM that only
writes the output, and the big base GEMM then accumulates into that buffer (``beta = 1``). Reading the
accumulator is nearly free in the epilogue of the compute-bound base GEMM, whereas adding a rank-r product into
an existing output afterwards is a separate memory-bound pass that reads and writes the whole (T, out) tensor.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .gemm import scaled_mm
from .weights import LoRAWeights


def flat(x: Tensor) -> Tensor:
    """``x`` as a (T, features) matrix."""
    return x.reshape(-1, x.shape[-1])


def dropped(x2: Tensor, keep: Tensor | None, k: float) -> Tensor:
    """``D(X) = X ⊙ M · k``; ``M`` is a bool keep-mask (``k = 1/(1-p)``) or an already-scaled float mask (k = 1)."""
    if keep is None:
        return x2
    out = x2.mul(keep.reshape(x2.shape))
    return out.mul_(k) if k != 1.0 else out


def project(x2: Tensor, w: LoRAWeights, keep: Tensor | None, k: float) -> tuple[Tensor, Tensor]:
    """Forward of one projection: ``(Y, U)`` with ``U = D(X) Aᵀ`` (T, r) and ``Y = X Wᵀ + bias + s U Bᵀ``.

    Args:
        x2: (T, in) input in the compute dtype (``W``'s).
        w: the projection (``dropout_p`` is ignored; the mask is ``keep``).
        keep: (T, in) mask or ``None``.
        k: factor applied with ``keep``.
    """
    u = dropped(x2, keep, k) @ w.A.to(x2.dtype).t()
    b_t = w.B.to(x2.dtype).t()
    # The LoRA term (+ bias) writes Y; the base GEMM accumulates into it (module docstring says why).
    lora = (
        scaled_mm(u, b_t, w.scale, x2.dtype) if w.bias is None else torch.addmm(w.bias, u, b_t, alpha=w.scale)
    )
    return lora.addmm_(x2, w.W.t()), u


def input_grad(
    dys: Sequence[Tensor], ws: Sequence[LoRAWeights], gs: Sequence[Tensor], keeps: Sequence[Tensor | None],
    ks: Sequence[float],
) -> Tensor:  # fmt: skip
    """``dX = Σ_i dY_i W_i + s_i (G_i A_i) ⊙ M_i k_i`` for projections sharing one input, in one buffer.

    The unmasked LoRA terms are one GEMM over the concatenated ``[s_i G_i]`` (T, Σr) and ``[A_i]`` (Σr, in),
    written first; masked terms are added next; the base GEMMs then accumulate into the buffer.

    Args:
        dys: (T, out_i) output gradients.
        ws: the projections.
        gs: (T, r_i) ``G_i = dY_i B_i``.
        keeps, ks: each projection's mask and factor.
    """
    dtype = dys[0].dtype
    plain = [i for i, keep in enumerate(keeps) if keep is None]
    dx = None
    if plain:
        g_cat = torch.cat([gs[i] * ws[i].scale for i in plain], dim=1)
        dx = g_cat @ torch.cat([ws[i].A.to(dtype) for i in plain], dim=0)
    for i, keep in enumerate(keeps):
        if keep is not None:
            term = dropped(gs[i] @ ws[i].A.to(dtype), keep, ks[i] * ws[i].scale)
            dx = term if dx is None else dx.add_(term)
    for dy, w in zip(dys, ws, strict=True):
        dx.addmm_(dy, w.W)
    return dx


def factor_grads(
    dy: Tensor, x2: Tensor, w: LoRAWeights, keep: Tensor | None, k: float, u: Tensor, g: Tensor
) -> tuple[Tensor, Tensor]:
    """``(dA, dB) = (s Gᵀ D(X), s dYᵀ U)`` in A's and B's dtypes (FP32 outputs from low-precision inputs)."""
    da = scaled_mm(g.t(), dropped(x2, keep, k), w.scale, w.A.dtype)
    db = scaled_mm(dy.t(), u, w.scale, w.B.dtype)
    return da, db
