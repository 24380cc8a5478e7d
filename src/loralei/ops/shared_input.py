r"""Shared-input group: N adapted projections that read the same X (Q/K/V, gate/up) as one autograd op.

Forward, for each member i (math of :mod:`loralei.ops.lora_w`)::

    U_i = D_i(X) A_iᵀ               (T, r_i)
    Y_i = X W_iᵀ + bias_i + s_i · U_i B_iᵀ      (T, out_i)

Backward::

    G_i  = dY_i B_i                  (T, r_i)   once per member
    dX   = Σ_i [dY_i W_i + s_i · (G_i A_i) ⊙ M_i · k_i]   (T, in)  one buffer: the unmasked LoRA terms as
           one GEMM over the concatenated G_i / A_i, then each dY_i W_i accumulated into it
    dA_i = s_i · G_iᵀ D_i(X),  dB_i = s_i · dY_iᵀ U_i

X is saved once for all members (plus one bool mask per member with dropout, and the small U_i), instead of
once per projection; the dX of all members lands in one buffer instead of N buffers summed by autograd.
Each member keeps its own dropout mask, as in the plain path.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ..errors import LoraleiError
from .lora_w import check_fusable, op_mask
from .projection import factor_grads, flat, input_grad, project
from .weights import LoRAWeights


def _members(
    Ws: list[Tensor], biases: list[Tensor | None], As: list[Tensor], Bs: list[Tensor], scales: list[float]
) -> list[LoRAWeights]:
    return [
        LoRAWeights(W, None, A, B, s, 0.0, b)
        for W, b, A, B, s in zip(Ws, biases, As, Bs, scales, strict=True)
    ]


@torch.library.custom_op("loralei::lora_group", mutates_args=())
def _lora_group_op(
    x: Tensor,
    Ws: list[Tensor],
    biases: list[Tensor | None],
    As: list[Tensor],
    Bs: list[Tensor],
    keeps: list[Tensor | None],
    ks: list[float],
    scales: list[float],
) -> list[Tensor]:
    x2 = flat(x)
    ys, us = [], []
    for w, keep, k in zip(_members(Ws, biases, As, Bs, scales), keeps, ks, strict=True):
        y, u = project(x2, w, keep, k)
        ys.append(y.view(*x.shape[:-1], w.W.shape[0]))
        us.append(u)
    return ys + us


@_lora_group_op.register_fake
def _(x: Tensor, Ws: list, biases: list, As: list, Bs: list, keeps: list, ks: list, scales: list) -> list:
    tokens = x.numel() // x.shape[-1]
    ys = [x.new_empty(*x.shape[:-1], W.shape[0]) for W in Ws]
    return ys + [x.new_empty(tokens, A.shape[0]) for A in As]


def _no_grads(values: list) -> list[None] | None:
    """The "no gradient" value of a list input: torch.library treats lists holding ``None`` as one leaf."""
    return [None] * len(values) if all(isinstance(v, Tensor) for v in values) else None


def _setup(ctx, inputs: tuple, output: list) -> None:
    x, Ws, biases, As, Bs, keeps, ks, scales = inputs
    n = len(Ws)
    ctx.n, ctx.ks, ctx.scales, ctx.need_dx = n, ks, scales, x.requires_grad
    ctx.no_grads = (_no_grads(Ws), _no_grads(biases), _no_grads(keeps))
    ctx.has_keep = [m is not None for m in keeps]
    ctx.save_for_backward(x, *Ws, *As, *Bs, *[m for m in keeps if m is not None], *output[n:])
    ctx.mark_non_differentiable(*output[n:])


def _backward(ctx, grads: list[Tensor]) -> tuple:
    n = ctx.n
    x, *rest = ctx.saved_tensors
    Ws, As, Bs, rest = rest[:n], rest[n : 2 * n], rest[2 * n : 3 * n], rest[3 * n :]
    masks = iter(rest[: sum(ctx.has_keep)])
    keeps = [next(masks) if has else None for has in ctx.has_keep]
    us = rest[sum(ctx.has_keep) :]
    x2 = flat(x)
    members = _members(list(Ws), [None] * n, list(As), list(Bs), ctx.scales)
    dys = [flat(grads[i]) for i in range(n)]
    gs = [dy.mm(w.B.to(dy.dtype)) for dy, w in zip(dys, members, strict=True)]  # once each, for dX and dA
    dx = input_grad(dys, members, gs, keeps, ctx.ks).view(x.shape) if ctx.need_dx else None
    grads_ab = [factor_grads(dys[i], x2, w, keeps[i], ctx.ks[i], us[i], gs[i]) for i, w in enumerate(members)]
    das, dbs = [da for da, _ in grads_ab], [db for _, db in grads_ab]
    no_w, no_bias, no_keep = ctx.no_grads
    return dx, no_w, no_bias, das, dbs, no_keep, None, None


torch.library.register_autograd("loralei::lora_group", _backward, setup_context=_setup)


def lora_group(
    x: Tensor, ws: Sequence[LoRAWeights], dropout_masks: Sequence[Tensor | None] | None = None
) -> tuple[Tensor, ...]:
    """Fused outputs of N projections of one input; same results as ``reference.lora_group``.

    Args:
        x: (..., in) input of any floating dtype; cast once to the members' weight dtype (dX comes back in
            ``x.dtype``).
        ws: the members (at least one), all with the same ``in`` and weight dtype, frozen dense bases.
        dropout_masks: one entry per member: ``None`` or a (..., in) mask already divided by the keep
            probability. Members without a given mask and with ``dropout_p > 0`` draw their own bool mask, in
            member order (what the plain path does when called in that order).

    Returns:
        One (..., out_i) output per member, in ``W``'s dtype.

    Raises:
        LoraleiError: no members, mismatched members or masks, or a trainable/quantized base.
    """
    if not ws:
        raise LoraleiError("lora_group: ws is empty; pass at least one LoRAWeights")
    masks = list(dropout_masks) if dropout_masks is not None else [None] * len(ws)
    if len(masks) != len(ws):
        raise LoraleiError(
            f"lora_group: got {len(masks)} dropout_masks for {len(ws)} projections; pass one each"
        )
    dtype, features = ws[0].W.dtype, ws[0].W.shape[1]
    for i, w in enumerate(ws):
        check_fusable(w, f"lora_group member {i}")
        if w.W.dtype != dtype or w.W.shape[1] != features:
            raise LoraleiError(
                f"lora_group: member {i} has weight {tuple(w.W.shape)} {w.W.dtype}, member 0 has in={features} "
                f"{dtype}; members must share the input size and weight dtype"
            )
    xc = x.to(dtype)
    keeps, ks = zip(*(op_mask(xc, w, m) for w, m in zip(ws, masks, strict=True)), strict=True)
    outs = _lora_group_op(
        xc,
        [w.W for w in ws],
        [w.bias for w in ws],
        [w.A for w in ws],
        [w.B for w in ws],
        list(keeps),
        list(ks),
        [float(w.scale) for w in ws],
    )
    return tuple(outs[: len(ws)])
