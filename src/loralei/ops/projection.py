r"""Per-projection math shared by the fused ops (single projection, shared-input group, gated MLP).

Shapes: ``X`` (T, in), ``W`` (out, in), ``A`` (r, in), ``B`` (out, r), bias (out,), scale ``s``, keep-mask ``M``
(T, in) applied as ``D(X) = X ⊙ M · k`` (``k = 1/(1-p)`` for a drawn bool mask, 1 for a caller's scaled mask).

Order of the GEMMs (why it matters on the GPU): the rank-r LoRA term is computed *first* by a GEMM that only
writes the output, and the big base GEMM then accumulates into that buffer (``beta = 1``). Reading the
accumulator is nearly free in the epilogue of the compute-bound base GEMM, whereas adding a rank-r product into
an existing output afterwards is a separate memory-bound pass that reads and writes the whole (T, out) tensor.
FP8 GEMMs cannot accumulate (``torch._scaled_mm`` writes a new tensor), so with such bases the order turns
round: the base product is written first and the rank-r GEMMs accumulate into it. Where a projection's output goes
straight into a residual add that a loralei kernel makes (the MLP's down projection in a pre-norm layer), the term
joins that add instead (:mod:`loralei.ops.lowrank_sum`).

Projections sharing one input (:class:`Shared`): the rank-r GEMMs that read the full ``X`` are memory-bound, so
the members *without* a dropout mask ("plain") are batched to read ``X`` once instead of once per member::

    U_plain  = X [A_i]ᵀ                 (T, Σr)   one GEMM; U_i is its column slice i (a strided view)
    G_plain  = [G_i]                    (T, Σr)   G_i = dY_i B_i, concatenated once (small)
    dX       = G_plain [s_i A_i]        (T, in)   one GEMM for all plain members' LoRA terms, written first;
                                                  masked terms and each dY_i W_i then accumulate into it
    dA_plain = G_plainᵀ X               (Σr, in)  one GEMM; dA_i = s_i · (row block i), a fresh tensor each

Masked members keep their own ``U_i = D_i(X) A_iᵀ`` and ``dA_i = s_i G_iᵀ D_i(X)``.

Each member's ``G_i = dY_i B_i`` and ``dB_i = s_i dY_iᵀ U_i`` both read the whole (T, out) ``dY_i`` (memory-bound
too): where the Triton kernel runs they come from one pass over it (:func:`output_grads`).

Neighbouring members whose ``dY_i`` are adjacent columns of one buffer and whose dense ``W_i`` adjacent rows of
another (the fused q/k/v: :mod:`loralei.kernels.joint_buffer`) take ``Σ dY_i W_i`` as one GEMM: at the 8B shape
one (T, 6144) × (6144, 4096) product instead of three that each read and write ``dX``.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from ..kernels import output_grad
from ..kernels.joint_buffer import joined, take_spare
from .gemm import scaled_mm
from .weights import LoRAWeights, accumulates, base_grad_mm_, base_grads, base_linear, base_mm_


class Shared(NamedTuple):
    """Projections reading one input, each with its keep-mask (``None``: no dropout) and the mask's factor."""

    ws: Sequence[LoRAWeights]
    keeps: Sequence[Tensor | None]
    ks: Sequence[float]

    @property
    def plain(self) -> list[int]:
        """Indices of the members without a mask: their GEMMs on the full input are batched."""
        return [i for i, keep in enumerate(self.keeps) if keep is None]


def flat(x: Tensor) -> Tensor:
    """``x`` as a (T, features) matrix."""
    return x.reshape(-1, x.shape[-1])


def dropped(x2: Tensor, keep: Tensor | None, k: float) -> Tensor:
    """``D(X) = X ⊙ M · k``; ``M`` is a bool keep-mask (``k = 1/(1-p)``) or an already-scaled float mask (k = 1)."""
    if keep is None:
        return x2
    out = x2.mul(keep.reshape(x2.shape))
    return out.mul_(k) if k != 1.0 else out


def _cat(tensors: list[Tensor], dim: int) -> Tensor:
    """``torch.cat`` that hands back a lone tensor as is (no copy)."""
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim)


def _times(t: Tensor, factor: float) -> Tensor:
    """``t · factor``; ``t`` itself (no copy) for a factor of 1."""
    return t if factor == 1.0 else t * factor


def lora_output(x2: Tensor, w: LoRAWeights, u: Tensor) -> Tensor:
    """``Y = X Wᵀ + bias + s U Bᵀ`` (T, out) from ``U`` (T, r), which may be a strided column slice."""
    b_t = w.B.to(x2.dtype).t()
    if not accumulates(w):  # the base writes Y; the rank-r term accumulates into it
        return base_linear(x2, w).addmm_(u, b_t, alpha=w.scale)
    # The LoRA term (+ bias) writes Y; the base GEMM accumulates into it (module docstring says why).
    lora = (
        scaled_mm(u, b_t, w.scale, x2.dtype) if w.bias is None else torch.addmm(w.bias, u, b_t, alpha=w.scale)
    )
    return base_mm_(lora, x2, w)


def lora_u(x2: Tensor, w: LoRAWeights, keep: Tensor | None, k: float) -> Tensor:
    """``U = D(X) Aᵀ`` (T, r) of one projection."""
    return dropped(x2, keep, k) @ w.A.to(x2.dtype).t()


def project(x2: Tensor, w: LoRAWeights, keep: Tensor | None, k: float) -> tuple[Tensor, Tensor]:
    """Forward of one projection: ``(Y, U)`` with ``U = D(X) Aᵀ`` (T, r) and ``Y`` of :func:`lora_output`.

    Args:
        x2: (T, in) input in the compute dtype (``W``'s).
        w: the projection (``dropout_p`` is ignored; the mask is ``keep``).
        keep: (T, in) mask or ``None``.
        k: factor applied with ``keep``.
    """
    u = lora_u(x2, w, keep, k)
    return lora_output(x2, w, u), u


def member_us(u_plain: Tensor, masked: Sequence[Tensor], grp: Shared) -> list[Tensor]:
    """Each member's ``U_i``: a column slice of ``U_plain`` (T, Σr) or, for a masked member, its own (T, r_i)."""
    cols = iter(u_plain.split([grp.ws[i].A.shape[0] for i in grp.plain], dim=1))
    own = iter(masked)
    return [next(cols) if keep is None else next(own) for keep in grp.keeps]


def shared_us(x2: Tensor, grp: Shared) -> tuple[list[Tensor], Tensor]:
    """``(Us, U_plain)`` of projections sharing ``X``: the plain members' ``U_i`` are views of one GEMM's output.

    Args:
        x2: (T, in) input in the compute dtype.
        grp: the members and their masks.

    Returns:
        ``U_i = D_i(X) A_iᵀ`` (T, r_i) per member and ``U_plain = X [A_i]ᵀ`` (T, Σr over the plain members;
        (T, 0) when every member is masked).
    """
    dtype, plain = x2.dtype, grp.plain
    if plain:
        u_plain = x2 @ _cat([grp.ws[i].A.to(dtype) for i in plain], 0).t()
    else:
        u_plain = x2.new_empty(x2.shape[0], 0)
    masked = [
        lora_u(x2, w, keep, k)
        for w, keep, k in zip(grp.ws, grp.keeps, grp.ks, strict=True)
        if keep is not None
    ]
    return member_us(u_plain, masked, grp), u_plain


def project_shared(x2: Tensor, grp: Shared) -> tuple[list[Tensor], list[Tensor], Tensor]:
    """Forward of projections sharing ``X``: ``(Ys, Us, U_plain)`` (:func:`shared_us`, then each ``Y_i``)."""
    us, u_plain = shared_us(x2, grp)
    return [lora_output(x2, w, u) for w, u in zip(grp.ws, us, strict=True)], us, u_plain


def input_grad(
    dys: Sequence[Tensor], grp: Shared, gs: Sequence[Tensor], g_plain: Tensor | None = None
) -> Tensor:
    """``dX = Σ_i dY_i W_i + s_i (G_i A_i) ⊙ M_i k_i`` for projections sharing one input, in one buffer.

    The plain members' LoRA terms are one GEMM ``G_plain [s_i A_i]`` ((T, Σr) × (Σr, in)), written first;
    masked terms are added next; the base GEMMs then accumulate into the buffer. Bases whose products do not
    accumulate for free (FP8 GEMMs) go first instead, as one joint product where they offer it
    (:func:`~loralei.ops.weights.base_grads`), and the LoRA terms accumulate into it.

    Args:
        dys: (T, out_i) output gradients.
        grp: the members and their masks.
        gs: (T, r_i) ``G_i = dY_i B_i``.
        g_plain: the plain members' ``G_i`` concatenated (T, Σr), when the caller already has it.
    """
    dtype, plain = dys[0].dtype, grp.plain
    base_first = not all(accumulates(w) for w in grp.ws)
    dx = base_grads(dys, grp.ws) if base_first else None
    if plain:
        g_plain = _cat([gs[i] for i in plain], 1) if g_plain is None else g_plain
        # s_i is applied to the (r, in) A_i, not to the (T, r) G_i: G_plain is shared with dA. One scale for
        # every member (the usual case) is the GEMM's alpha instead: no scaled copy of each A_i.
        scales = {grp.ws[i].scale for i in plain}
        alpha = scales.pop() if len(scales) == 1 else 1.0
        a_plain = _cat([_times(grp.ws[i].A, grp.ws[i].scale / alpha).to(dtype) for i in plain], 0)
        dx = (
            scaled_mm(g_plain, a_plain, alpha, dtype)
            if dx is None
            else dx.addmm_(g_plain, a_plain, alpha=alpha)
        )
    for g, w, keep, k in zip(gs, grp.ws, grp.keeps, grp.ks, strict=True):
        if keep is not None:
            term = dropped(g @ w.A.to(dtype), keep, k * w.scale)
            dx = term if dx is None else dx.add_(term)
    if not base_first:
        for dy, w in joint_runs(dys, grp.ws):
            base_grad_mm_(dx, dy, w)
    return dx


def joint_runs(dys: Sequence[Tensor], ws: Sequence[LoRAWeights]) -> list[tuple[Tensor, LoRAWeights]]:
    """``(dY, member)`` pairs whose base products ``dY W`` sum to ``Σ_i dY_i W_i``: neighbours with dense bases
    whose ``dY`` are adjacent columns of one buffer and whose ``W`` adjacent rows of another merge into one pair
    (the joined views, no copy; module docstring)."""
    runs = [(dys[0], ws[0])]
    for dy, w in zip(dys[1:], ws[1:], strict=True):
        last_dy, last_w = runs[-1]
        dense = last_w.quant is None and w.quant is None
        dy_joint = joined(last_dy, dy, 1) if dense else None
        w_joint = joined(last_w.W, w.W, 0) if dy_joint is not None else None
        if w_joint is None:
            runs.append((dy, w))
        else:
            runs[-1] = (dy_joint, last_w._replace(W=w_joint))
    return runs


def _spare_slots(dys: Sequence[Tensor]) -> list[Tensor | None]:
    """For each ``dY_i``, the spare columns right after its predecessor (or after the slot its predecessor
    takes) where it fits them (:func:`~loralei.kernels.joint_buffer.take_spare`), else None."""
    slots: list[Tensor | None] = [None]
    for before, dy in itertools.pairwise(dys):
        slots.append(take_spare(before if slots[-1] is None else slots[-1], dy.shape))
    return slots


def _plain_a_grads(x2: Tensor, grp: Shared, g_plain: Tensor) -> list[Tensor]:
    """dA of the plain members from one GEMM ``G_plainᵀ X`` (Σr, in), its row blocks scaled by each s_i."""
    ws = [grp.ws[i] for i in grp.plain]
    if len(ws) == 1:  # the scale folds into the GEMM
        return [scaled_mm(g_plain.t(), x2, ws[0].scale, ws[0].A.dtype)]
    dtype = functools.reduce(torch.promote_types, [w.A.dtype for w in ws])
    rows = scaled_mm(g_plain.t(), x2, 1.0, dtype).split([w.A.shape[0] for w in ws])
    # mul gives each member a fresh (r_i, in) tensor: gradients that are views of one buffer would be kept
    # as such in .grad by autograd (each pinning the whole buffer)
    return [d.mul(w.scale).to(w.A.dtype) for d, w in zip(rows, ws, strict=True)]


def a_grad(g: Tensor, x2: Tensor, w: LoRAWeights, keep: Tensor | None, k: float) -> Tensor:
    """``dA = s Gᵀ D(X)`` (r, in) in A's dtype (FP32 outputs from low-precision inputs)."""
    return scaled_mm(g.t(), dropped(x2, keep, k), w.scale, w.A.dtype)


def factor_grads(
    dy: Tensor, u: Tensor, b: Tensor, scale: float, copy_to: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """``(G, dB) = (dY B, s dYᵀ U)`` of an output ``s U Bᵀ``: G (T, r) in dY's dtype, dB (out, r) in B's; ``dY``
    also copied into ``copy_to`` when given.

    Both read all of ``dY``; where the kernel runs they come from one pass over it, which also writes the copy
    (:mod:`loralei.kernels.output_grad`), elsewhere from two GEMMs.
    """
    if output_grad.usable(dy, u):
        return output_grad.output_grad_products(dy, b, u, scale, copy_to=copy_to)
    if copy_to is not None:
        copy_to.copy_(dy)
    return dy.mm(b.to(dy.dtype)), scaled_mm(dy.t(), u, scale, b.dtype)


def output_grads(
    dy: Tensor, u: Tensor, w: LoRAWeights, copy_to: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """``(G, dB) = (dY B, s dYᵀ U)`` of projection ``w`` (:func:`factor_grads`)."""
    return factor_grads(dy, u, w.B, w.scale, copy_to)


def shared_grads(
    dys: Sequence[Tensor],
    x2: Tensor,
    grp: Shared,
    us: Sequence[Tensor],
    need_dx: bool,
    dbs: list[Tensor] | None = None,
) -> tuple[Tensor | None, list[Tensor], list[Tensor]]:
    """Backward of projections sharing ``X``: ``(dX or None, [dA_i], [dB_i])``; module docstring has the math.

    Args:
        dys: (T, out_i) output gradients in the compute dtype.
        x2: (T, in) input.
        grp: the members and their masks.
        us: each member's (T, r_i) ``U_i`` from the forward.
        need_dx: whether to compute dX.
        dbs: the dB_i when the caller already has them (then ``us`` is not read).
    """
    # dY_i written right after its predecessor where that buffer has room: the base GEMMs then join (joint_runs)
    slots = _spare_slots(dys) if need_dx else [None] * len(dys)
    if dbs is None:  # G_i once each, for dX and dA
        gs, dbs = (list(t) for t in zip(*map(output_grads, dys, us, grp.ws, slots), strict=True))
    else:
        gs = [dy.mm(w.B.to(dy.dtype)) for dy, w in zip(dys, grp.ws, strict=True)]
        for slot, dy in zip(slots, dys, strict=True):
            if slot is not None:
                slot.copy_(dy)
    dys = [dy if slot is None else slot for dy, slot in zip(dys, slots, strict=True)]
    plain = grp.plain
    g_plain = _cat([gs[i] for i in plain], 1) if plain else None
    dx = input_grad(dys, grp, gs, g_plain) if need_dx else None
    plain_das = iter(_plain_a_grads(x2, grp, g_plain) if plain else [])
    das = [
        next(plain_das) if keep is None else a_grad(g, x2, w, keep, k)
        for g, w, keep, k in zip(gs, grp.ws, grp.keeps, grp.ks, strict=True)
    ]
    return dx, das, dbs
