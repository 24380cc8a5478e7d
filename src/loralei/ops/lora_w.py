r"""LoRA_W: one adapted projection as a single autograd op (per-projection math in :mod:`.projection`).

Shapes: ``X`` (T, in) (leading dims flattened), ``W`` (out, in), ``A`` (r, in), ``B`` (out, r), bias (out,),
scale ``s``, dropout keep-mask ``M`` (T, in) applied as ``D(X) = X ⊙ M · k`` with ``k = 1 / (1 - p)``.

Forward::

    U = D(X) Aᵀ                      (T, r)    saved (small) for dB
    Y = X Wᵀ + bias + s · U Bᵀ        (T, out)  s·U Bᵀ (+ bias) written first, X Wᵀ accumulated into it

Backward, given dY (T, out)::

    G  = dY B                        (T, r)    computed once, used by dX and dA
    dX = dY W + s · (G A) ⊙ M · k    (T, in)   LoRA term written first, dY W accumulated into it
    dA = s · Gᵀ D(X)                 (r, in)   one GEMM with s folded in, written in A's dtype
    dB = s · dYᵀ U                   (out, r)  likewise
    dW, dbias: none (the base is frozen; no full-size copy of W is made)

Saved for backward: X (in the compute dtype), the frozen W, A, B, the mask (bool, 1 byte per element, when
drawn here) and U; ``D(X)`` is recomputed in the backward instead of being stored. ``X`` arrives already cast to ``W``'s dtype (once, by the caller-facing
wrapper); autograd's cast node then returns dX in the caller's dtype. A and B may be FP32
(``lora_fp32_gradients``): they are cast (r-sized, cheap) to the compute dtype for the matmuls, and dA/dB come out
of GEMMs with low-precision inputs and FP32 outputs (see :mod:`loralei.ops.gemm`).

Kept output (:mod:`loralei.ops.kept_outputs`): in a recomputation that has ``Y`` from the forward, the node forms
only ``U`` and returns the kept ``Y``; its backward is the same.

Registered with ``torch.library.custom_op`` so that ``torch.compile`` treats it as one opaque op, no graph break;
a quantized base travels as a handle (:func:`loralei.ops.weights.quant_handle`).
Eager calls take an ``autograd.Function`` with the same forward and backward instead, which skips the custom
op's per-call dispatch (a third of the op's CPU time: it matters for small models, where the CPU issues kernels
barely faster than the GPU runs them).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..errors import LoraleiError
from .dropout import op_mask
from .projection import Shared, flat, lora_u, project, shared_grads
from .weights import LoRAWeights, base_args, base_of, check_fusable, with_base


def _lora_w_impl(
    x: Tensor,
    W: Tensor | None,
    quant: int,
    bias: Tensor | None,
    A: Tensor,
    B: Tensor,
    keep: Tensor | None,
    k: float,
    scale: float,
) -> tuple[Tensor, Tensor]:
    base = base_of(W, quant)
    y, u = project(flat(x), with_base(base, A, B, scale, bias), keep, k)
    return y.view(*x.shape[:-1], base.shape[0]), u


_lora_w_op = torch.library.custom_op("loralei::lora_w", _lora_w_impl, mutates_args=())


@_lora_w_op.register_fake
def _(x: Tensor, W: Tensor | None, quant: int, bias: Tensor | None, A: Tensor, *_) -> tuple[Tensor, Tensor]:
    tokens = x.numel() // x.shape[-1]
    return x.new_empty(*x.shape[:-1], base_of(W, quant).shape[0]), x.new_empty(tokens, A.shape[0])


def _setup(ctx, inputs: tuple, output: tuple) -> None:
    x, W, quant, _, A, B, keep, k, scale = inputs
    ctx.save_for_backward(x, W, A, B, keep, output[1])
    ctx.quant, ctx.k, ctx.scale = quant, k, scale
    ctx.mark_non_differentiable(output[1])


def _grads_impl(
    dy: Tensor,
    x: Tensor,
    W: Tensor | None,
    quant: int,
    A: Tensor,
    B: Tensor,
    keep: Tensor | None,
    u: Tensor,
    k: float,
    scale: float,
    need_dx: bool,
) -> list[Tensor]:
    """``[dX, dA, dB]`` (``[dA, dB]`` when ``need_dx`` is false)."""
    w = with_base(base_of(W, quant), A, B, scale)
    dx, (da,), (db,) = shared_grads([flat(dy)], flat(x), Shared([w], [keep], [k]), [u], need_dx)
    return [*([dx.view(x.shape)] if dx is not None else []), da, db]


# The backward as an op of its own under torch.compile: AOTAutograd traces a custom op's backward with fake
# tensors, which a quantized base's real codes cannot join; opaque, the backward runs on the real ones.
_lora_w_grads_op = torch.library.custom_op("loralei::lora_w_grads", _grads_impl, mutates_args=())


@_lora_w_grads_op.register_fake
def _(dy: Tensor, x: Tensor, W: Tensor | None, quant: int, A: Tensor, B: Tensor, *rest) -> list[Tensor]:
    return [*([torch.empty_like(x)] if rest[-1] else []), torch.empty_like(A), torch.empty_like(B)]


def _backward(ctx, dy: Tensor, _du: Tensor | None, grads=_grads_impl) -> tuple:
    x, W, A, B, keep, u = ctx.saved_tensors
    need_dx = ctx.needs_input_grad[0]
    *dx, da, db = grads(dy, x, W, ctx.quant, A, B, keep, u, ctx.k, ctx.scale, need_dx)
    return dx[0] if dx else None, None, None, None, da, db, None, None, None


torch.library.register_autograd(
    "loralei::lora_w",
    lambda ctx, dy, du: _backward(ctx, dy, du, _lora_w_grads_op),
    setup_context=_setup,
)


class _LoRAWFunction(torch.autograd.Function):
    """The op's eager twin: the same forward, setup and backward without torch.library's dispatch."""

    @staticmethod
    def forward(ctx, *inputs):
        output = _lora_w_impl(*inputs)
        _setup(ctx, inputs, output)
        return output

    @staticmethod
    def backward(ctx, dy: Tensor, du: Tensor | None) -> tuple:
        return _backward(ctx, dy, du)


class _KeptWFunction(torch.autograd.Function):
    """The eager node in a recomputation that has ``Y`` already (module docstring): ``U`` formed, ``Y`` handed
    back; setup and backward are the op's."""

    @staticmethod
    def forward(ctx, *inputs_and_kept):
        *inputs, kept = inputs_and_kept
        x, W, quant, bias, A, B, keep, k, scale = inputs
        u = lora_u(flat(x), with_base(base_of(W, quant), A, B, scale, bias), keep, k)
        output = (kept.view_as(kept), u)
        _setup(ctx, tuple(inputs), output)
        return output

    @staticmethod
    def backward(ctx, dy: Tensor, du: Tensor | None) -> tuple:
        return *_backward(ctx, dy, du), None


def lora_w(
    x: Tensor, w: LoRAWeights, dropout_mask: Tensor | None = None, kept: Tensor | None = None
) -> Tensor:
    """Fused ``Y = X Wᵀ (+ bias) + scale · dropout(X) Aᵀ Bᵀ``; same result as ``reference.lora_linear``.

    Args:
        x: (..., in) input of any floating dtype; cast once to ``W.dtype`` (dX comes back in ``x.dtype``).
        w: the projection; ``W`` and ``bias`` must be frozen; the base may be quantized.
        dropout_mask: (..., in) mask already divided by the keep probability (``ops.reference``'s
            convention). When ``None`` and ``w.dropout_p > 0`` a bool keep-mask is drawn with
            :func:`loralei.ops.dropout.draw_keep_mask` and kept for backward at 1 byte per element.
        kept: the output as this call's forward computed it (a checkpoint's recomputation,
            :mod:`loralei.ops.kept_outputs`): returned as it is, the base product not formed again. Eager mode.

    Returns:
        (..., out) output in ``W.dtype``.

    Raises:
        LoraleiError: the base is trainable, the mask has another shape than ``x``, or a kept output comes
            under torch.compile.
    """
    check_fusable(w, "lora_w")
    xc = x.to(w.dtype)
    keep, k = op_mask(xc.shape, xc.device, xc.dtype, w.dropout_p, dropout_mask)
    args = (xc, *base_args(w), w.bias, w.A, w.B, keep, k, w.scale)
    if kept is not None:
        if torch.compiler.is_compiling():
            raise LoraleiError(
                "lora_w: a kept output is taken in eager mode only; compute the projection instead"
            )
        return _KeptWFunction.apply(*args, kept)[0]
    op = _lora_w_op if torch.compiler.is_compiling() else _LoRAWFunction.apply
    return op(*args)[0]
