r"""Rotary position embedding (the half-split form of Llama, Qwen, Mistral, Gemma, Phi-3) as one Triton kernel.

For ``x`` (batch, heads, seq, d) and ``cos``, ``sin`` (batch or 1, seq, d), halves ``x₁ = x[..., :d/2]``,
``x₂ = x[..., d/2:]``::

    forward:   y₁ = x₁ cos₁ - x₂ sin₁        y₂ = x₂ cos₂ + x₁ sin₂
    backward:  dx₁ = dy₁ cos₁ + dy₂ sin₂     dx₂ = dy₂ cos₂ - dy₁ sin₁

(Transformers writes the forward as ``x cos + rotate_half(x) sin``, ``rotate_half(x) = [-x₂, x₁]``.) One program
per token and block of heads: it loads the token's ``cos``/``sin`` once and rotates every head of the block, in
fp32 with one rounding to the input dtype. ``x`` may have any strides with contiguous rows of ``d`` (the
attention's ``view(...).transpose(1, 2)``); the output has ``x``'s strides. Only ``cos`` and ``sin`` are kept
for the backward. Where q and k are such views of (batch, seq, heads · d) projection outputs, the backward writes
their gradients side by side into one (batch, seq, (H_q + 2 H_k) d) buffer, the last H_k d columns left for the
attention's v gradient: there a q/k/v group takes its input gradient in one GEMM (:mod:`.joint_buffer`).

Where Triton cannot run, :func:`apply_rope` computes the same formula in torch (:func:`rope_reference`).
"""

from __future__ import annotations

import functools

import torch

from .activations import build_kernel, eager_call, interpret_requested, tl, triton, triton_usable
from .joint_buffer import with_spare

_HEADS = 16  # heads per program


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_reference(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Transformers' ``apply_rotary_pos_emb`` (``unsqueeze_dim=1``) in torch."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def _rope_kernel(
    x_ptr, cos_ptr, sin_ptr, y_ptr, n_heads, seq, half,
    sxb, sxh, sxs, syb, syh, sys, scb, scs,
    BACKWARD: tl.constexpr, BH: tl.constexpr, BD: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0)
    b, s = (token // seq).to(tl.int64), (token % seq).to(tl.int64)
    heads = tl.program_id(1) * BH + tl.arange(0, BH)
    cols = tl.arange(0, BD)
    col_ok = cols < half
    ok = (heads < n_heads)[:, None] & col_ok[None, :]
    c = cos_ptr + b * scb + s * scs + cols
    t = sin_ptr + b * scb + s * scs + cols
    cos1 = tl.load(c, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    cos2 = tl.load(c + half, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    sin1 = tl.load(t, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    sin2 = tl.load(t + half, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    x_row = x_ptr + b * sxb + s * sxs + heads.to(tl.int64)[:, None] * sxh + cols[None, :]
    y_row = y_ptr + b * syb + s * sys + heads.to(tl.int64)[:, None] * syh + cols[None, :]
    x1 = tl.load(x_row, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + half, mask=ok, other=0.0).to(tl.float32)
    if BACKWARD:
        y1, y2 = x1 * cos1 + x2 * sin2, x2 * cos2 - x1 * sin1
    else:
        y1, y2 = x1 * cos1 - x2 * sin1, x2 * cos2 + x1 * sin2
    tl.store(y_row, y1.to(y_ptr.dtype.element_ty), mask=ok)
    tl.store(y_row + half, y2.to(y_ptr.dtype.element_ty), mask=ok)


@functools.cache
def _kernel(interpret: bool):
    return build_kernel(_rope_kernel, interpret)


def _launch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool, y: torch.Tensor) -> None:
    """Writes ``x`` rotated by the forward (or its transpose, ``backward``) into ``y`` (``x``'s shape, any
    strides with contiguous rows)."""
    batch, heads, seq, dim = x.shape
    if x.numel():
        scb = cos.stride(0) if cos.shape[0] > 1 else 0
        grid = (batch * seq, triton.cdiv(heads, _HEADS))
        _kernel(interpret_requested())[grid](
            x, cos, sin, y, heads, seq, dim // 2, x.stride(0), x.stride(1), x.stride(2),
            y.stride(0), y.stride(1), y.stride(2), scb, cos.stride(1),
            BACKWARD=backward, BH=_HEADS, BD=triton.next_power_of_2(dim // 2),
        )  # fmt: skip


def _rotate_impl(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool) -> torch.Tensor:
    """``x`` rotated by the forward (or its transpose, ``backward``); the result has ``x``'s strides."""
    y = torch.empty_like(x)
    _launch(x, cos, sin, backward, y)
    return y


# A custom op hides the launch from torch.compile (Dynamo would otherwise trace into the launcher).
_rotate_op = torch.library.custom_op("loralei::rope", _rotate_impl, mutates_args=())


@_rotate_op.register_fake
def _(x, cos, sin, backward):
    return torch.empty_like(x)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool) -> torch.Tensor:
    return (_rotate_impl if eager_call() else _rotate_op)(x, cos, sin, backward)


def _rows_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _heads_last(x: torch.Tensor) -> bool:
    """Whether the (batch, heads, seq, d) ``x`` is the transpose of a contiguous (batch, seq, heads, d) tensor."""
    return x.transpose(1, 2).is_contiguous()


def _joint_grads(
    dq: torch.Tensor, dk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> list[torch.Tensor]:
    """``dq``, ``dk`` rotated back into one (batch, seq, (H_q + 2 H_k) d) buffer, as its q and k column blocks
    viewed like the inputs; the last H_k d columns are marked spare (module docstring)."""
    batch, q_heads, seq, dim = dq.shape
    k_heads = dk.shape[1]
    buffer = dq.new_empty(batch, seq, (q_heads + 2 * k_heads) * dim)
    bounds = (0, q_heads * dim, (q_heads + k_heads) * dim)
    views = []
    for d, begin, end in zip((dq, dk), bounds[:-1], bounds[1:], strict=True):
        view = buffer[..., begin:end].unflatten(-1, (d.shape[1], dim)).transpose(1, 2)
        _launch(_rows_contiguous(d), cos, sin, True, view)
        views.append(view)
    with_spare(buffer, bounds[-1])
    return views


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        ctx.save_for_backward(cos, sin)
        ctx.joint = _heads_last(q) and _heads_last(k) and q.dtype == k.dtype
        return _rotate(q, cos, sin, False), _rotate(k, cos, sin, False)

    @staticmethod
    def backward(ctx, dq: torch.Tensor | None, dk: torch.Tensor | None):
        cos, sin = ctx.saved_tensors
        if ctx.joint and dq is not None and dk is not None and not torch.compiler.is_compiling():
            return *_joint_grads(dq, dk, cos, sin), None, None
        # the kernel reads rows of d contiguous elements; a gradient may come in any layout
        grads = [None if d is None else _rotate(_rows_contiguous(d), cos, sin, True) for d in (dq, dk)]
        return *grads, None, None


def usable(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether the kernel runs on these operands: Triton on their device and dtypes, (batch, heads, seq, d)
    inputs with contiguous rows, full-width (batch or 1, seq, d) ``cos``/``sin`` that need no gradient."""
    if not all(triton_usable(t) for t in (q, k, cos, sin)) or cos.requires_grad or sin.requires_grad:
        return False
    if (
        q.dim() != 4
        or k.dim() != 4
        or cos.dim() != 3
        or cos.shape != sin.shape
        or cos.stride() != sin.stride()
    ):
        return False
    batch, _, seq, dim = q.shape
    return (
        dim % 2 == 0
        and k.shape[0] == batch
        and k.shape[2:] == (seq, dim)
        and cos.shape[1:] == (seq, dim)
        and cos.shape[0] in (1, batch)
        and q.stride(-1) == k.stride(-1) == cos.stride(-1) == 1
    )


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``apply_rotary_pos_emb(q, k, cos, sin)`` (``unsqueeze_dim=1``) with autograd: the kernel where
    :func:`usable`, else :func:`rope_reference`."""
    if not usable(q, k, cos, sin):
        return rope_reference(q, k, cos, sin)
    if eager_call(q, k):
        return _rotate_impl(q, cos, sin, False), _rotate_impl(k, cos, sin, False)
    return _Rope.apply(q, k, cos, sin)
