"""Causal attention through the fused kernel PyTorch's ``scaled_dot_product_attention`` would pick, called
directly, so that its output and log-sum-exp can be kept from one forward and its backward run later from them.

A checkpointed layer computes attention twice, once in the forward and again when the backward recomputes the
layer; at 32K tokens and more, attention is the largest part of a step, and its second forward a fifth of it.
:func:`attend` runs the forward once and returns what the backward needs (the output, the log-sum-exp and the
kernel's own bookkeeping); :func:`replayed` hands that output to the recomputed layer as if attention had run
again, with a backward that calls the kernel's backward on the kept tensors: the same call, with the same
operands, that autograd makes after ``scaled_dot_product_attention``.

Kernels (PyTorch's choice for causal attention without a mask, ``torch._fused_sdp_choice``): cuDNN and flash on
CUDA, flash on the CPU, each with key/value heads fewer than the query's (grouped-query attention) taken as they
are. Anything else (the memory-efficient or math kernel, a head size the kernels would pad) gets ``None`` from
:func:`kernel_for`, and the caller runs ``scaled_dot_product_attention`` as usual.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.nn.attention import SDPBackend

# (output, log-sum-exp, extras): extras are the kernel's other forward results its backward takes
Forward = Callable[[Tensor, Tensor, Tensor, float | None], tuple[Tensor, Tensor, tuple]]
Backward = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, tuple, float | None], tuple]


def _cudnn_forward(q: Tensor, k: Tensor, v: Tensor, scale: float | None) -> tuple[Tensor, Tensor, tuple]:
    out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = (
        torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True, False, scale=scale)
    )
    return out, lse, (cum_q, cum_k, max_q, max_k, seed, offset)


def _cudnn_backward(
    grad: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    extras: tuple,
    scale: float | None,
) -> tuple:
    cum_q, cum_k, max_q, max_k, seed, offset = extras
    return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        grad, q, k, v, out, lse, seed, offset, None, cum_q, cum_k, max_q, max_k, 0.0, True, scale=scale
    )


def _flash_forward(q: Tensor, k: Tensor, v: Tensor, scale: float | None) -> tuple[Tensor, Tensor, tuple]:
    out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = (
        torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False, scale=scale)
    )
    return out, lse, (cum_q, cum_k, max_q, max_k, seed, offset)


def _flash_backward(
    grad: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    extras: tuple,
    scale: float | None,
) -> tuple:
    cum_q, cum_k, max_q, max_k, seed, offset = extras
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        grad, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, True, seed, offset, scale=scale
    )


def _cpu_flash_forward(q: Tensor, k: Tensor, v: Tensor, scale: float | None) -> tuple[Tensor, Tensor, tuple]:
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, scale=scale)
    return out, lse, ()


def _cpu_flash_backward(
    grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, _: tuple, scale: float | None
) -> tuple:
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad, q, k, v, out, lse, 0.0, True, scale=scale
    )


class Kernel(NamedTuple):
    """One fused attention kernel's forward (keeping the log-sum-exp) and backward."""

    name: str
    forward: Forward
    backward: Backward


KERNELS: dict[tuple[str, int], Kernel] = {  # by (device type, PyTorch's backend choice)
    ("cuda", int(SDPBackend.CUDNN_ATTENTION)): Kernel("cudnn", _cudnn_forward, _cudnn_backward),
    ("cuda", int(SDPBackend.FLASH_ATTENTION)): Kernel("flash", _flash_forward, _flash_backward),
    ("cpu", int(SDPBackend.FLASH_ATTENTION)): Kernel("flash (CPU)", _cpu_flash_forward, _cpu_flash_backward),
}
HEAD_MULTIPLE = 8  # head sizes the fused kernels take without padding
HEAD_GROUPS = 4  # the backward runs in up to this many groups of heads (_grouped_backward)


def kernel_for(q: Tensor, k: Tensor, v: Tensor, scale: float | None) -> Kernel | None:
    """The kernel ``scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=...)`` runs
    for these operands, or None when it is not one of :data:`KERNELS` (or would pad the heads)."""
    if q.shape[-1] % HEAD_MULTIPLE or q.shape[-1] != v.shape[-1] or q.shape[-2] != k.shape[-2]:
        return None
    gqa = q.shape[1] != k.shape[1]
    # as for a training call: some kernels have a forward but no backward for some operands
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    choice = torch._fused_sdp_choice(q, k, v, None, 0.0, True, scale=scale, enable_gqa=gqa)
    return KERNELS.get((q.device.type, int(choice)))


class Kept(NamedTuple):
    """What one attention forward leaves for its backward besides q, k and v."""

    kernel: Kernel
    out: Tensor
    lse: Tensor
    extras: tuple


def attend(kernel: Kernel, q: Tensor, k: Tensor, v: Tensor, scale: float | None) -> Kept:
    """Causal attention of (B, H, T, D) ``q`` over ``k``/``v`` (B, H_kv, T, D), without autograd."""
    with torch.no_grad():
        out, lse, extras = kernel.forward(q, k, v, scale)
    return Kept(kernel, out, lse, extras)


class _Replayed(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, kept: Kept, scale: float | None) -> Tensor:
        ctx.save_for_backward(q, k, v, kept.out, kept.lse)
        ctx.kernel, ctx.extras, ctx.scale = kept.kernel, kept.extras, scale
        return kept.out.view_as(kept.out)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple:
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _grouped_backward(ctx.kernel, grad, q, k, v, out, lse, ctx.extras, ctx.scale)
        return dq, dk, dv, None, None


def head_groups(kv_heads: int) -> int:
    """How many groups of heads the backward runs in turn: the most, up to :data:`HEAD_GROUPS`, that divide
    the key/value heads (each group's query heads use only its own key/value heads)."""
    return max(g for g in range(1, HEAD_GROUPS + 1) if kv_heads % g == 0)


def _grouped_backward(
    kernel: Kernel,
    grad: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    extras: tuple,
    scale,
) -> tuple[Tensor, Tensor, Tensor]:
    """The kernel's backward one group of heads at a time (:func:`head_groups`), each group's gradients copied
    into the whole ones: the kernel's workspace (its fp32 query-gradient accumulator above all, 16 KiB a token at
    Llama-3-8B's 32 heads) then exists for one group at a time. Heads are independent in attention, so the
    gradients are those of one call."""
    groups = head_groups(k.shape[1])
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    hq, hk = q.shape[1] // groups, k.shape[1] // groups
    for g in range(groups):
        sq, sk = slice(g * hq, (g + 1) * hq), slice(g * hk, (g + 1) * hk)
        parts = kernel.backward(
            grad[:, sq], q[:, sq], k[:, sk], v[:, sk], out[:, sq], lse[:, sq], extras, scale
        )
        for whole, part, heads in zip((dq, dk, dv), parts[:3], (sq, sk, sk), strict=True):
            whole[:, heads].copy_(part)
    return dq, dk, dv


def replayed(
    q: Tensor, k: Tensor, v: Tensor, kept: Kept, scale: float | None, after: Callable[[], None]
) -> Tensor:
    """``kept.out`` as the output of attention over ``q``, ``k``, ``v`` (which ``kept`` came from): its backward
    is the kernel's, on the kept output and log-sum-exp.

    ``after`` runs once that backward is done and autograd has let go of its operands (the output's gradient,
    q, k, v, the kept output): as the first gradient it returned reaches the op before, so that what ``after``
    brings to the device does not meet them there."""
    out = _Replayed.apply(q, k, v, kept, scale)
    needing = [t for t in (q, k, v) if t.requires_grad]
    if needing:  # otherwise there is no backward
        needing[0].register_hook(lambda _: after())
    return out
