r"""Shared-input group: N adapted projections that read the same X (Q/K/V, gate/up) as one autograd op.

Forward, for each member i (math of :mod:`loralei.ops.lora_w`)::

    U_i = D_i(X) A_iᵀ               (T, r_i)
    Y_i = X W_iᵀ + bias_i + s_i · U_i B_iᵀ      (T, out_i)

Backward::

    G_i  = dY_i B_i                  (T, r_i)   once per member
    dX   = Σ_i [dY_i W_i + s_i · (G_i A_i) ⊙ M_i · k_i]   (T, in)  one buffer: the unmasked LoRA terms as
           one GEMM over the concatenated G_i / s_i A_i, then each dY_i W_i accumulated into it
    dA_i = s_i · G_iᵀ D_i(X),  dB_i = s_i · dY_iᵀ U_i

The members without a dropout mask read X once for all of them: their U_i are the column slices of one GEMM
``X [A_i]ᵀ`` (T, Σr) and their dA_i the row blocks of one GEMM ``[G_i]ᵀ X`` (Σr, in)
(:mod:`loralei.ops.projection`). X is saved once for all members (plus one bool mask per member with dropout,
and the small U's), instead of once per projection; the dX of all members lands in one buffer instead of N
buffers summed by autograd. Each member keeps its own dropout mask, as in the plain path.

DoRA members (``scales``; the math of :mod:`loralei.ops.dora`): the same forward with that member's bias left
out, then its output scaled per column in place, ``Y_i = g_i ⊙ Z_i + bias_i`` (one pass,
:func:`loralei.ops.dora.scale_output_`); the backward first takes ``dZ_i = g_i ⊙ dY_i`` and
``dm_i = Σ_t dY_i ⊙ Z_i · g_i / m_i`` in one pass over ``dY_i`` and ``Z_i`` (:mod:`loralei.ops.dora`), then runs the group's backward on the ``dZ_i``. So the group's GEMMs stay shared (one
``X [A_i]ᵀ``, one ``Σ dZ_i W_i`` where the bases lie side by side). ``Z_i`` is formed again in the backward (one
more base GEMM per DoRA member), so the group keeps what LoRA's keeps; inside a checkpoint recomputation, and in a
layer whose stash takes them (:mod:`loralei.ops.stash`), it keeps a member's ``Y_i`` instead
(:func:`loralei.ops.dora.kept_output`: a stash may take some members and not others, which form ``Z_i`` again).
A DoRA member takes no dropout here; a group with DoRA runs as an eager ``autograd.Function`` outside compiled
graphs, as the single DoRA op does.

Kept outputs (:mod:`loralei.ops.kept_outputs`): in a recomputation that has the members' outputs from the
forward, the node forms only the U's and returns the kept outputs; its backward is the group's.

A ``torch.library`` custom op under ``torch.compile`` (no graph break; a quantized base travels as a handle,
:func:`loralei.ops.weights.quant_handle`), an ``autograd.Function`` with the same forward and backward in eager
mode (cheaper per call on the CPU). The op returns ``Y_1..Y_N, U_plain, U_i of
each masked member`` (``U_plain`` (T, Σr over the unmasked members),
(T, 0) when all are masked): one tensor for the unmasked U's because the outputs of a custom op may not alias.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ..errors import LoraleiError
from . import dora
from .dora import DoRAScale
from .dropout import op_mask
from .projection import Shared, flat, lora_output, member_us, project_shared, shared_grads, shared_us
from .weights import LoRAWeights, base_args, base_of, check_fusable, with_base


def _members(
    Ws: list[Tensor | None],
    quants: list[int],
    biases: list[Tensor | None],
    As: list[Tensor],
    Bs: list[Tensor],
    scales: list[float],
) -> list[LoRAWeights]:
    bases = [base_of(W, q) for W, q in zip(Ws, quants, strict=True)]
    return [with_base(W, A, B, s, b) for W, b, A, B, s in zip(bases, biases, As, Bs, scales, strict=True)]


def _lora_group_impl(
    x: Tensor,
    Ws: list[Tensor | None],
    quants: list[int],
    biases: list[Tensor | None],
    As: list[Tensor],
    Bs: list[Tensor],
    keeps: list[Tensor | None],
    ks: list[float],
    scales: list[float],
) -> list[Tensor]:
    grp = Shared(_members(Ws, quants, biases, As, Bs, scales), keeps, ks)
    ys, us, u_plain = project_shared(flat(x), grp)
    ys = [y.view(*x.shape[:-1], w.shape[0]) for y, w in zip(ys, grp.ws, strict=True)]
    return [*ys, u_plain, *(u for u, keep in zip(us, keeps, strict=True) if keep is not None)]


_lora_group_op = torch.library.custom_op("loralei::lora_group", _lora_group_impl, mutates_args=())


@_lora_group_op.register_fake
def _(
    x: Tensor, Ws: list, quants: list, biases: list, As: list, Bs: list, keeps: list, ks: list, scales: list
) -> list:
    tokens = x.numel() // x.shape[-1]
    ys = [x.new_empty(*x.shape[:-1], base_of(W, q).shape[0]) for W, q in zip(Ws, quants, strict=True)]
    plain_rank = sum(A.shape[0] for A, keep in zip(As, keeps, strict=True) if keep is None)
    masked = [x.new_empty(tokens, A.shape[0]) for A, keep in zip(As, keeps, strict=True) if keep is not None]
    return [*ys, x.new_empty(tokens, plain_rank), *masked]


def _no_grads(values: list) -> list[None] | None:
    """The "no gradient" value of a list input: torch.library treats lists holding ``None`` as one leaf."""
    return [None] * len(values) if all(isinstance(v, Tensor) for v in values) else None


def _setup(ctx, inputs: tuple, output: list, extra: Sequence[Tensor] = ()) -> None:
    """Saves what the backward reads; ``extra`` tensors (DoRA's) are saved last."""
    x, Ws, quants, biases, As, Bs, keeps, ks, scales = inputs
    n = len(Ws)
    ctx.n, ctx.quants, ctx.ks, ctx.scales, ctx.n_extra = n, quants, ks, scales, len(extra)
    ctx.no_grads = (_no_grads(Ws), _no_grads(biases), _no_grads(keeps))
    ctx.has_keep = [m is not None for m in keeps]
    ctx.save_for_backward(x, *Ws, *As, *Bs, *[m for m in keeps if m is not None], *output[n:], *extra)
    ctx.mark_non_differentiable(*output[n:])


def _grads_impl(
    dys: list[Tensor],
    x: Tensor,
    Ws: list[Tensor | None],
    quants: list[int],
    As: list[Tensor],
    Bs: list[Tensor],
    keeps: list[Tensor | None],
    u_plain: Tensor,
    u_masked: list[Tensor],
    ks: list[float],
    scales: list[float],
    need_dx: bool,
) -> list[Tensor]:
    """``[dX, dA_1..dA_N, dB_1..dB_N]`` (without ``dX`` when ``need_dx`` is false)."""
    grp = Shared(_members(Ws, quants, [None] * len(Ws), As, Bs, scales), keeps, ks)
    us = member_us(u_plain, u_masked, grp)
    dx, das, dbs = shared_grads([flat(dy) for dy in dys], flat(x), grp, us, need_dx)
    return [*([dx.view(x.shape)] if dx is not None else []), *das, *dbs]


# The backward as an op of its own under torch.compile (see loralei::lora_w_grads).
_lora_group_grads_op = torch.library.custom_op("loralei::lora_group_grads", _grads_impl, mutates_args=())


@_lora_group_grads_op.register_fake
def _(dys: list, x: Tensor, Ws: list, quants: list, As: list, Bs: list, *rest) -> list[Tensor]:
    dx = [torch.empty_like(x)] if rest[-1] else []
    return [*dx, *(torch.empty_like(A) for A in As), *(torch.empty_like(B) for B in Bs)]


def _unpack(ctx, saved: tuple) -> tuple:
    """``(x, Ws, As, Bs, keeps, u_plain, u_masked)`` from the tensors :func:`_setup` saved."""
    n, n_masked = ctx.n, sum(ctx.has_keep)
    x, *rest = saved[: len(saved) - ctx.n_extra]
    Ws, As, Bs, rest = rest[:n], rest[n : 2 * n], rest[2 * n : 3 * n], rest[3 * n :]
    masks = iter(rest[:n_masked])
    keeps = [next(masks) if has else None for has in ctx.has_keep]
    return x, Ws, As, Bs, keeps, rest[n_masked], list(rest[n_masked + 1 :])


def _backward(ctx, grads: list[Tensor], grads_fn=_grads_impl, saved: tuple | None = None) -> tuple:
    """The group's backward; ``saved`` is ``ctx.saved_tensors`` where the caller read them already (they may be
    read only once under checkpointing)."""
    n = ctx.n
    x, Ws, As, Bs, keeps, u_plain, u_masked = _unpack(ctx, ctx.saved_tensors if saved is None else saved)
    need_dx = ctx.needs_input_grad[0]
    factors = [list(Ws), ctx.quants, list(As), list(Bs), keeps, u_plain, u_masked, ctx.ks, ctx.scales]
    out = grads_fn(list(grads[:n]), x, *factors, need_dx)
    first = 1 if need_dx else 0  # out holds dX first when it was asked for
    dx, das, dbs = (out[0] if need_dx else None), out[first : first + n], out[first + n :]
    no_w, no_bias, no_keep = ctx.no_grads
    return dx, no_w, None, no_bias, das, dbs, no_keep, None, None


torch.library.register_autograd(
    "loralei::lora_group",
    lambda ctx, grads: _backward(ctx, grads, _lora_group_grads_op),
    setup_context=_setup,
)


class _LoRAGroupFunction(torch.autograd.Function):
    """The op's eager twin (same forward, setup and backward without torch.library's dispatch, which costs
    more CPU time than the op's own Python). Autograd sees only top-level tensors, so the trainable factors
    come flat (``*As, *Bs``) and the frozen lists in one tuple."""

    @staticmethod
    def forward(ctx, x: Tensor, frozen: tuple, *factors: Tensor):
        Ws, quants, biases, keeps, ks, scales = frozen
        n = len(Ws)
        inputs = (x, Ws, quants, biases, list(factors[:n]), list(factors[n:]), keeps, ks, scales)
        output = _lora_group_impl(*inputs)
        _setup(ctx, inputs, output)
        return tuple(output)

    @staticmethod
    def backward(ctx, *grads: Tensor | None) -> tuple:
        dx, _, _, _, das, dbs, *_ = _backward(ctx, list(grads))
        return dx, None, *das, *dbs


class _KeptGroupFunction(torch.autograd.Function):
    """The eager node in a recomputation that has the members' outputs already (module docstring): the forward
    forms the U's the backward reads and hands back the kept outputs; setup and backward are the group's."""

    @staticmethod
    def forward(ctx, x: Tensor, frozen: tuple, kept: list[Tensor], *factors: Tensor):
        Ws, quants, biases, keeps, ks, scales = frozen
        n = len(Ws)
        As, Bs = list(factors[:n]), list(factors[n:])
        inputs = (x, Ws, quants, biases, As, Bs, keeps, ks, scales)
        us, u_plain = shared_us(flat(x), Shared(_members(Ws, quants, biases, As, Bs, scales), keeps, ks))
        masked = [u for u, keep in zip(us, keeps, strict=True) if keep is not None]
        output = [*(y.view_as(y) for y in kept), u_plain, *masked]
        _setup(ctx, inputs, output)
        return tuple(output)

    @staticmethod
    def backward(ctx, *grads: Tensor | None) -> tuple:
        dx, _, _, _, das, dbs, *_ = _backward(ctx, list(grads))
        return dx, None, None, *das, *dbs


class _DoRAGroupFunction(torch.autograd.Function):
    """The eager node with DoRA members (module docstring): the group's forward with each DoRA member's output
    scaled per column, ``Y_i = g_i ⊙ Z_i + bias_i`` (kept for ``dm_i`` only where :func:`~loralei.ops.dora.
    kept_output` says, else ``Z_i`` formed again in the backward); the backward turns each ``dY_i`` into
    ``dZ_i = g_i ⊙ dY_i`` with ``dm_i`` and runs the group's backward on those."""

    @staticmethod
    def forward(ctx, x: Tensor, frozen: tuple, gs: list, *factors: Tensor | None):
        Ws, quants, biases, keeps, ks, scales = frozen
        n = len(Ws)
        members = [i for i, g in enumerate(gs) if g is not None]
        plain_biases = [None if g is not None else b for b, g in zip(biases, gs, strict=True)]
        inputs = (x, Ws, quants, plain_biases, list(factors[:n]), list(factors[n : 2 * n]), keeps, ks, scales)
        output = _lora_group_impl(*inputs)
        for i in members:
            dora.scale_output_(output[i].view(-1, output[i].shape[-1]), gs[i], biases[i])  # a view: in place
        kept = [dora.kept_output(output[i]) for i in members]
        _setup(ctx, inputs, output, kept + [factors[2 * n + i] for i in members])
        ctx.gs, ctx.members = gs, members
        ctx.biases = [None if b is None else b.detach() for b in biases]
        return tuple(output)

    @staticmethod
    def backward(ctx, *grads: Tensor) -> tuple:
        n, members = ctx.n, ctx.members
        saved = ctx.saved_tensors
        kept = saved[len(saved) - 2 * len(members) :]
        # a member's output may be kept while another's is not (a stash takes what its layer's plan holds)
        zs = _unscaled_outputs(ctx, saved) if any(y is None for y in kept[: len(members)]) else None
        grads, d_ms = list(grads), [None] * n
        for j, i in enumerate(members):
            dy, y, m = flat(grads[i]), kept[j], kept[len(members) + j]
            need_dm = ctx.needs_input_grad[3 + 2 * n + i]
            if y is not None:
                dz, d_ms[i] = dora.scale_backward(dy, flat(y), ctx.gs[i], m, ctx.biases[i], need_dm)
            else:  # Z_i again (the forward's own products), read once and dropped
                dz, d_ms[i] = dora.unscaled_backward(dy, zs(i), ctx.gs[i], m, need_dm)
            grads[i] = dz.view(grads[i].shape)
        dx, _, _, _, das, dbs, *_ = _backward(ctx, grads, saved=saved)
        return dx, None, None, *das, *dbs, *d_ms


def _unscaled_outputs(ctx, saved: tuple):
    """A function giving member ``i``'s unscaled output ``Z_i = X W_iᵀ + s_i U_i B_iᵀ`` (T, out_i) from the saved
    tensors, as the forward formed it."""
    x, Ws, As, Bs, keeps, u_plain, u_masked = _unpack(ctx, saved)
    grp = Shared(_members(Ws, ctx.quants, [None] * ctx.n, As, Bs, ctx.scales), keeps, ctx.ks)
    us = member_us(u_plain, u_masked, grp)
    return lambda i: lora_output(flat(x), grp.ws[i], us[i])


@torch.compiler.disable  # DoRA runs outside compiled graphs (as the single DoRA op)
def _dora_group(x: Tensor, frozen: tuple, scales: Sequence[DoRAScale | None], *factors: Tensor) -> tuple:
    """The DoRA group node on checked arguments."""
    gs = [None if sc is None else sc.factor() for sc in scales]
    magnitudes = [None if sc is None else sc.magnitude for sc in scales]
    return _DoRAGroupFunction.apply(x, frozen, gs, *factors, *magnitudes)


def _check_dora(ws: Sequence[LoRAWeights], masks: list, scales: Sequence[DoRAScale | None]) -> None:
    """DoRA members take no dropout here (PEFT's rule: the base term sees the undropped input)."""
    if len(scales) != len(ws):
        raise LoraleiError(f"lora_group: got {len(scales)} scales for {len(ws)} projections; pass one each")
    for i, (w, m, sc) in enumerate(zip(ws, masks, scales, strict=True)):
        if sc is not None and (w.dropout_p > 0 or m is not None):
            raise LoraleiError(
                f"lora_group member {i}: DoRA with dropout (dropout_p={w.dropout_p}) does not run in a group "
                "(PEFT applies DoRA's base term to the undropped input); run it on its own, or lora_dropout: 0.0"
            )


def _check_kept(kept: Sequence[Tensor], ws: Sequence[LoRAWeights], dora_scales) -> None:
    if dora_scales is not None or torch.compiler.is_compiling() or len(kept) != len(ws):
        raise LoraleiError(
            f"lora_group: kept outputs ({len(kept)} for {len(ws)} projections) are taken by LoRA members in "
            "eager mode only, one per member; compute the group instead"
        )


def lora_group(
    x: Tensor,
    ws: Sequence[LoRAWeights],
    dropout_masks: Sequence[Tensor | None] | None = None,
    scales: Sequence[DoRAScale | None] | None = None,
    kept: Sequence[Tensor] | None = None,
) -> tuple[Tensor, ...]:
    """Fused outputs of N projections of one input; same results as ``reference.lora_group``.

    Args:
        x: (..., in) input of any floating dtype; cast once to the members' weight dtype (dX comes back in
            ``x.dtype``).
        ws: the members (at least one), all with the same ``in`` and weight dtype, frozen bases (dense or
            quantized).
        dropout_masks: one entry per member: ``None`` or a (..., in) mask already divided by the keep
            probability. Members without a given mask and with ``dropout_p > 0`` draw their own bool mask, in
            member order (what the plain path does when called in that order).
        scales: DoRA: one entry per member, None (LoRA) or its :class:`~loralei.ops.dora.DoRAScale`; a DoRA
            member returns ``g ⊙ Z + bias`` and its magnitude gets a gradient (module docstring). DoRA members
            take no dropout; with any, the node runs eagerly outside compiled graphs.
        kept: the members' outputs as this call's forward computed them (a checkpoint's recomputation,
            :mod:`loralei.ops.kept_outputs`): returned as they are, the base products not formed again. LoRA
            members, eager mode.

    Returns:
        One (..., out_i) output per member, in ``W``'s dtype.

    Raises:
        LoraleiError: no members, mismatched members, a mask count or shape that does not fit, a trainable
            base, a DoRA member with dropout, or kept outputs with DoRA members, under torch.compile or not one
            per member.
    """
    if not ws:
        raise LoraleiError("lora_group: ws is empty; pass at least one LoRAWeights")
    masks = list(dropout_masks) if dropout_masks is not None else [None] * len(ws)
    if len(masks) != len(ws):
        raise LoraleiError(
            f"lora_group: got {len(masks)} dropout_masks for {len(ws)} projections; pass one each"
        )
    dora_scales = scales if scales is not None and any(sc is not None for sc in scales) else None
    if dora_scales is not None:
        _check_dora(ws, masks, dora_scales)
    dtype, features = ws[0].dtype, ws[0].shape[1]
    for i, w in enumerate(ws):
        check_fusable(w, f"lora_group member {i}")
        if w.dtype != dtype or w.shape[1] != features:
            raise LoraleiError(
                f"lora_group: member {i} has weight {tuple(w.shape)} {w.dtype}, member 0 has in={features} "
                f"{dtype}; members must share the input size and weight dtype"
            )
    xc = x.to(dtype)
    keeps, ks = zip(
        *(op_mask(xc.shape, xc.device, dtype, w.dropout_p, m) for w, m in zip(ws, masks, strict=True)),
        strict=True,
    )
    bases = [base_args(w) for w in ws]
    Ws, quants = [W for W, _ in bases], [q for _, q in bases]
    biases, scales = [w.bias for w in ws], [float(w.scale) for w in ws]
    As, Bs = [w.A for w in ws], [w.B for w in ws]
    frozen = (Ws, quants, biases, list(keeps), list(ks), scales)
    if kept is not None:
        _check_kept(kept, ws, dora_scales)
        return _KeptGroupFunction.apply(xc, frozen, list(kept), *As, *Bs)[: len(ws)]
    if dora_scales is not None:
        return tuple(_dora_group(xc, frozen, dora_scales, *As, *Bs)[: len(ws)])
    if torch.compiler.is_compiling():
        outs = _lora_group_op(xc, Ws, quants, biases, As, Bs, list(keeps), list(ks), scales)
    else:
        outs = _LoRAGroupFunction.apply(xc, frozen, *As, *Bs)
    return tuple(outs[: len(ws)])
