r"""DoRA_W: one DoRA projection as a single autograd op, without ever forming the dense ``W + s B A``.

Shapes: ``X`` (T, in), ``W`` (out, in), ``A`` (r, in), ``B`` (out, r), bias and magnitude ``m`` (out,), scale ``s``.

Row norms (FP32, no gradient: the norm is detached, as in the DoRA paper and PEFT)::

    ‖W + s B A‖²_row = ‖W‖²_row + 2 s rowsum((W Aᵀ) ⊙ B) + s² rowsum((B (A Aᵀ)) ⊙ B)

``‖W‖²_row`` is the frozen base's and is computed once by the caller (:mod:`loralei.modules.dora`); each step
costs one (out, in) × (in, r) product ``W Aᵀ`` (a quantized base is dequantized for it) and r-sized terms: one
Triton pass over ``W`` after the small ``A Aᵀ`` where it runs (:mod:`loralei.kernels.dora_norms`). A checkpoint's
recomputation takes the norms its forward computed (:func:`loralei.modules.dora.step_norms`).

Forward, with ``g = m / ‖W + s B A‖`` (out,)::

    U    = X Aᵀ                            (T, r)    saved for dB
    Y    = g ⊙ (X Wᵀ + s U Bᵀ) + bias       (T, out)  LoRA's forward (:func:`~.projection.lora_output`), each
                                                      column then scaled in place (g applied in FP32) and the
                                                      bias added: one Triton pass where it runs
                                                      (:func:`scale_output_`)

Backward, given dY (T, out)::

    dm   = Σ_t dY ⊙ (Y - bias) / m         (out,)    = Σ_t dY ⊙ (X Wᵀ + s U Bᵀ) / ‖W + s B A‖, from Y or Z
                                                      (see "Saved for backward")
    dY_g = dY ⊙ g                           (T, out)  with dm's column dots, one pass over dY and Y where the
                                                      Triton kernel runs (:mod:`loralei.kernels.dora`)
    dX, dA, dB = LoRA's backward with dY_g  (:func:`~.projection.shared_grads`)

Saved for backward: X, the frozen W (a quantized base is kept on ``ctx``), A, B, U and g: what LoRA keeps. The
backward forms ``Z = X Wᵀ + s U Bᵀ`` again for dm (``dm = Σ_t dY ⊙ Z · g / m``; one more base GEMM, the (T, out)
result dropped after one read), so no (T, out) tensor lives from the forward to the backward. Inside a checkpoint
recomputation (:func:`kept_output`), whose saved tensors live only until the layer's backward, and in a layer
whose stash takes it (:mod:`.stash`: the saved ``Y`` goes to host memory until the backward), the op keeps ``Y`` instead
and reads dm from it as above; an in-place change of ``Y`` afterwards makes autograd refuse the backward (it is
never silently wrong). ``m`` must have no zero entry (``m`` starts at the row norms).

With dropout (PEFT's rule: the base term sees the undropped input, the rescaled one the dropped ``D(X)``)::

    Y = X Wᵀ + bias + (g - 1) ⊙ D(X) Wᵀ + g ⊙ s D(X) Aᵀ Bᵀ = DoRA_W(D(X)) + (X - D(X)) Wᵀ + bias

:func:`dora_w_dropout` composes it from the op above on ``D(X)`` and a frozen product of ``X - D(X)``: one more
base GEMM each way, and ``D(X)`` and ``X - D(X)`` kept for the backward.

The fused gated MLP and shared-input groups take DoRA members as a :class:`DoRAScale` (magnitude and this step's
norms) and share :func:`scale_output_` (the forward's scaling) and :func:`scale_backward` (``dY ⊙ g`` and dm from
a kept output) with this op.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from ..errors import LoraleiError
from ..kernels import column_scale, dora_norms
from ..kernels import dora as dora_kernel
from . import recompute, stash
from .projection import Shared, flat, lora_output, lora_u, shared_grads
from .reference import frozen_linear
from .weights import LoRAWeights, check_fusable, run_eager


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """FP32 for low-precision compute dtypes, FP64 stays FP64 (the tests' reference runs)."""
    return torch.promote_types(dtype, torch.float32)


def dense_base(w: LoRAWeights) -> Tensor:
    """The frozen base as a dense (out, in) tensor: ``W``, or the quantized base dequantized (a new tensor)."""
    return w.W if w.quant is None else w.quant.dequantize()


@torch.no_grad()
def squared_row_norms(w: LoRAWeights) -> Tensor:
    """``‖W‖²_row`` (out,) of the frozen base in FP32 (FP64 for an FP64 base), without a full-size FP32 copy."""
    dense = dense_base(w)
    return torch.linalg.vector_norm(dense, dim=1, dtype=_acc_dtype(dense.dtype)).square_()


def _wide_mm(a: Tensor, b: Tensor, acc: torch.dtype) -> Tensor:
    """``a @ b`` with the result in ``acc``: a bf16/fp16 GEMM with FP32 outputs on CUDA, upcast inputs elsewhere."""
    if a.is_cuda and a.dtype != acc:
        return torch.mm(a, b.to(a.dtype), out_dtype=acc)
    return a.to(acc) @ b.to(acc)


@torch.no_grad()
def row_norms(w: LoRAWeights, w_sq: Tensor) -> Tensor:
    """``‖W + s B A‖_row`` (out,) from ``‖W‖²_row`` (``w_sq``) and rank-r products (module docstring).

    Args:
        w: the projection.
        w_sq: (out,) squared row norms of the frozen base, in the accumulation dtype.

    Returns:
        (out,) the norms in ``w_sq``'s dtype, with no gradient.
    """
    acc = w_sq.dtype
    dense = dense_base(w)
    if dora_norms.usable(dense, w.A, w.B, w_sq):
        return dora_norms.row_norms(dense, w.A, w.B, _wide_mm(w.A, w.A.t(), acc), w_sq, w.scale)
    a, b = w.A.to(acc), w.B.to(acc)
    wa = _wide_mm(dense, w.A.t(), acc)  # (out, r)
    cross = torch.linalg.vecdot(wa, b)
    lora = torch.linalg.vecdot(b @ (a @ a.t()), b)
    return (w_sq + (2 * w.scale) * cross + (w.scale * w.scale) * lora).clamp_min_(0).sqrt_()


class DoRAScale(NamedTuple):
    """What a fused op needs of a DoRA projection besides its LoRA weights: the trainable magnitude ``m`` (out,)
    and the detached row norms ``‖W + s B A‖`` (out,) in the accumulation dtype (:func:`row_norms`)."""

    magnitude: Tensor
    norm: Tensor

    def factor(self) -> Tensor:
        """``g = m / ‖W + s B A‖`` (out,) in the norms' dtype, without gradient."""
        return self.magnitude.detach().to(self.norm.dtype) / self.norm


def dora_scale(w: LoRAWeights, magnitude: Tensor, w_sq: Tensor) -> DoRAScale:
    """The :class:`DoRAScale` of projection ``w`` from ``‖W‖²_row`` (``w_sq``)."""
    return DoRAScale(magnitude, row_norms(w, w_sq))


def scale_output_(z: Tensor, g: Tensor, bias: Tensor | None) -> Tensor:
    """``Y = g ⊙ Z + bias`` (T, out) written over ``Z``: the product taken in ``g``'s dtype and rounded to ``Z``'s,
    then the bias added (torch's ``Z.mul_(g).add_(bias)``, bit for bit); one pass of the Triton kernel where it
    runs (:mod:`loralei.kernels.column_scale`), else those two torch passes."""
    if column_scale.usable(z, g, bias):
        return column_scale.scale_columns_(z, g, bias)
    z.mul_(g)
    return z if bias is None else z.add_(bias)


def _scaled_grad_and_dots(dy2: Tensor, y: Tensor, g: Tensor) -> tuple[Tensor, Tensor]:
    """``(dY ⊙ g, Σ_t dY ⊙ Y)``: one pass of the Triton kernel where it runs, else three torch passes (the
    product rounded to dY's dtype and summed in g's; the scaling computed in g's dtype, written in dY's)."""
    if dora_kernel.usable(dy2, y) and g.dtype == torch.float32:
        return dora_kernel.scaled_grad_and_dots(dy2, y, g)
    sums = torch.sum(dy2 * y, dim=0, dtype=g.dtype)
    dyg = torch.empty_like(dy2)
    torch.mul(dy2, g, out=dyg)
    return dyg, sums


def kept_output(y: Tensor) -> Tensor | None:
    """What a DoRA node saves of its output ``Y`` for dm: ``Y`` inside a checkpoint recomputation, whose saved
    tensors live only until the layer's backward (and in the first forward of torch's checkpoint, which keeps
    nothing it saves and checks that the recomputation saves the same: :func:`~.recompute.keeps_outputs`), and
    where the running layer's stash takes it (:mod:`.stash`: it goes to host memory). Elsewhere None: the node
    keeps nothing more than LoRA and forms the unscaled ``Z = X Wᵀ + s U Bᵀ`` again in its backward (one more base
    GEMM, a transient (T, out) tensor)."""
    return y if recompute.keeps_outputs() or stash.mark(y) else None


def scale_backward(
    dy2: Tensor, kept: Tensor, g: Tensor, magnitude: Tensor, bias: Tensor | None, need_dm: bool
) -> tuple[Tensor, Tensor | None]:
    """Backward through ``Y = g ⊙ Z + bias``: ``(dZ = dY ⊙ g, dm or None)`` with
    ``dm = Σ_t dY ⊙ (Y - bias) / m = Σ_t dY ⊙ Z · g / m`` (module docstring).

    Args:
        dy2: (T, out) output gradient.
        kept: (T, out) the output ``Y`` (from ``Z``: :func:`unscaled_backward`).
        g: (out,) ``m / ‖W + s B A‖`` in the accumulation dtype.
        magnitude: (out,) the magnitude ``m``.
        bias: (out,) the frozen bias, or None.
        need_dm: whether to compute dm.
    """
    acc = g.dtype
    dyg, sums = _scaled_grad_and_dots(dy2, kept, g)
    if not need_dm:
        return dyg, None
    if bias is not None:
        sums -= bias.to(acc) * dy2.sum(0, dtype=acc)
    return dyg, (sums / magnitude.detach().to(acc)).to(magnitude.dtype)


def unscaled_backward(
    dy2: Tensor, z: Tensor, g: Tensor, magnitude: Tensor, need_dm: bool
) -> tuple[Tensor, Tensor | None]:
    """:func:`scale_backward` from the recomputed unscaled output ``Z``: ``dm = Σ_t dY ⊙ Z · g / m``."""
    dyg, sums = _scaled_grad_and_dots(dy2, z, g)
    if not need_dm:
        return dyg, None
    return dyg, (sums * g / magnitude.detach().to(g.dtype)).to(magnitude.dtype)


class _DoRAFunction(torch.autograd.Function):
    """``Y = g ⊙ (X Wᵀ + s X Aᵀ Bᵀ) + bias`` with ``g = m / norm`` (module docstring has the math)."""

    @staticmethod
    def forward(ctx, x: Tensor, A: Tensor, B: Tensor, m: Tensor, norm: Tensor, w: LoRAWeights) -> Tensor:
        x2 = flat(x)
        plain = w._replace(A=A, B=B, bias=None)
        g = DoRAScale(m, norm).factor()
        u = lora_u(x2, plain, None, 1.0)
        y = scale_output_(lora_output(x2, plain, u), g, w.bias)
        ctx.save_for_backward(x2, w.W, A, B, u, kept_output(y), g, m)
        ctx.quant, ctx.scale = w.quant, w.scale
        ctx.bias = w.bias.detach() if w.bias is not None else None
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, dy: Tensor) -> tuple:
        x2, W, A, B, u, y, g, m = ctx.saved_tensors
        w = LoRAWeights(W, ctx.quant, A, B, ctx.scale, 0.0, None)
        need_dm = ctx.needs_input_grad[3]
        if y is not None:
            dyg, dm = scale_backward(flat(dy), y, g, m, ctx.bias, need_dm)
        else:  # Z again (the forward's own products), read once and dropped
            dyg, dm = unscaled_backward(flat(dy), lora_output(x2, w, u), g, m, need_dm)
        need_dx = ctx.needs_input_grad[0]
        dx, (da,), (db,) = shared_grads([dyg], x2, Shared([w], [None], [1.0]), [u], need_dx)
        dx = dx.view(*dy.shape[:-1], dx.shape[-1]) if dx is not None else None
        return dx, da, db, dm, None, None


def dora_w(x: Tensor, w: LoRAWeights, magnitude: Tensor, w_sq: Tensor, norm: Tensor | None = None) -> Tensor:
    """Fused DoRA projection; same result as :func:`loralei.ops.reference.dora_linear` without dropout.

    Args:
        x: (..., in) input of any floating dtype; cast once to the base's dtype (dX comes back in ``x.dtype``).
        w: the projection; ``W`` and ``bias`` frozen, the base may be quantized, ``dropout_p`` must be 0.
        magnitude: (out,) the trainable magnitude.
        w_sq: (out,) ``‖W‖²_row`` of the frozen base (:func:`squared_row_norms`).
        norm: (out,) this step's ``‖W + s B A‖_row`` (:func:`row_norms`) where the caller has them; by default
            computed here from ``w_sq``.

    Returns:
        (..., out) output in the base's dtype.

    Raises:
        LoraleiError: a trainable base, or dropout (which the plain twin computes).
    """
    check_fusable(w, "dora_w")
    if w.dropout_p > 0:
        raise LoraleiError(
            f"dora_w: dropout_p={w.dropout_p}, but the fused DoRA op takes no dropout (PEFT applies DoRA's "
            "base term to the undropped input); use loralei.ops.reference.dora_linear, or lora_dropout: 0.0"
        )
    xc = x.to(w.dtype)
    norm = row_norms(w, w_sq) if norm is None else norm
    if w.quant is None:
        return _DoRAFunction.apply(xc, w.A, w.B, magnitude, norm, w)
    return run_eager(_DoRAFunction.apply, xc, w.A, w.B, magnitude, norm, w)


def dora_w_dropout(x: Tensor, w: LoRAWeights, magnitude: Tensor, w_sq: Tensor, mask: Tensor) -> Tensor:
    """DoRA with dropout as PEFT computes it, from fused pieces: ``dora_w(D(X)) + (X - D(X)) Wᵀ + bias``
    (module docstring); same result as :func:`loralei.ops.reference.dora_linear` with ``mask``.

    Args:
        x: (..., in) input of any floating dtype; cast once to the base's dtype.
        w: the projection (``dropout_p`` is ignored; the mask is ``mask``).
        magnitude: (out,) the trainable magnitude.
        w_sq: (out,) ``‖W‖²_row`` of the frozen base.
        mask: (..., in) keep-mask already divided by the keep probability (``ops.reference``'s convention).

    Returns:
        (..., out) output in the base's dtype.
    """
    xc = x.to(w.dtype)
    dropped = xc * mask.to(w.dtype)
    y = dora_w(dropped, w._replace(dropout_p=0.0, bias=None), magnitude, w_sq)
    rest = xc - dropped
    if w.quant is None:
        return y + torch.nn.functional.linear(rest, w.W, w.bias)
    return y + frozen_linear(rest, w.quant, w.bias)
