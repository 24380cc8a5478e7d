r"""MoE experts' elementwise passes as Triton kernels: the row gather, the per-token combine and the gated
activation.

Gather: ``out[s] = x[token[s]]``, a token's hidden state for each of its routed rows (S×n from T×n).

Combine (forward output and input gradient): routed rows ``R`` (S×n, in expert order) back to tokens,
``out[t] = Σ_k w[t,k] · R[pos[t·K + k]]`` (``w`` = 1 for the input gradient), ``pos`` the row of each route.
One pass reads each routed row once and writes T×n; gathering the rows into token order first and summing
afterwards would write and read S×n once more.

Each pass that reads a product of the experts' GEMMs takes it as two addends, ``R = R_base + R_lora`` (the frozen
bank's product and the LoRA update's), and sums them as it reads: adding them first would write S×n and read it
back once more.

Gated activation ``h = act(gate) ⊙ up`` of routed rows ``G = [gate, up]`` (S×2I), and its backward, per row, from ``dh₁ = ∂⟨dY, O⟩/∂h`` (before the routing
weight ``w``) and ``G = [gate, up]`` (S×2I)::

    h = act(gate) ⊙ up;   dw = Σ_cols dh₁ ⊙ h   (the routing weight's gradient: ⟨dY, O⟩ = ⟨dh₁, h⟩)
    dh = w · dh₁;   d_gate = dh ⊙ up ⊙ act'(gate);   d_up = dh ⊙ act(gate)

written in place: ``[d_gate, d_up]`` over ``G`` and ``h`` over ``dh₁`` (the down factors' gradients need it).
A program holds whole rows, so ``dw`` is one in-register sum (deterministic). Math in FP32, stores in the
tensors' dtype. Where Triton cannot run, the same formulas run in torch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from .activations import (
    ACTIVATIONS,
    act_and_slope,
    add_combine,
    build_kernel,
    interpret_requested,
    tl,
    torch_act_and_slope,
    triton,
    triton_usable,
)

_BLOCK = 1024
# rows per program of the activation passes (each row whole: next power of two ≥ I columns); on an H200 at
# I = 768, one row per program (4 warps) ran the backward in 154 µs against 234 µs with 4 rows (rows 1-16 and
# 2-16 warps tried; 65,536 bf16 rows)
_ROWS = 1


def _gather_kernel(x_ptr, token_ptr, out_ptr, n, BLOCK: tl.constexpr):
    s = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n
    t = tl.load(token_ptr + s).to(tl.int64)
    tl.store(out_ptr + s * n + cols, tl.load(x_ptr + t * n + cols, mask=ok), mask=ok)


def _combine_kernel(
    rows_ptr,
    extra_ptr,
    pos_ptr,
    w_ptr,
    out_ptr,
    n,
    K: tl.constexpr,
    WEIGHTED: tl.constexpr,
    EXTRA: tl.constexpr,
    BLOCK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n
    acc = tl.full((BLOCK,), 0.0, tl.float32)
    for k in range(K):
        row = tl.load(pos_ptr + t * K + k).to(tl.int64)
        val = tl.load(rows_ptr + row * n + cols, mask=ok, other=0.0).to(tl.float32)
        if EXTRA:
            val += tl.load(extra_ptr + row * n + cols, mask=ok, other=0.0).to(tl.float32)
        if WEIGHTED:
            val = val * tl.load(w_ptr + t * K + k).to(tl.float32)
        acc += val
    tl.store(out_ptr + t * n + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)


def _act_forward_kernel(
    gu_ptr,
    extra_ptr,
    h_ptr,
    n_rows,
    n_cols,
    ACT: tl.constexpr,
    EXTRA: tl.constexpr,
    STORE_SUM: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    ok = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    g_at = rows[:, None] * (2 * n_cols) + cols[None, :]
    g = tl.load(gu_ptr + g_at, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + g_at + n_cols, mask=ok, other=0.0).to(tl.float32)
    if EXTRA:
        g += tl.load(extra_ptr + g_at, mask=ok, other=0.0).to(tl.float32)
        u += tl.load(extra_ptr + g_at + n_cols, mask=ok, other=0.0).to(tl.float32)
        if STORE_SUM:
            tl.store(gu_ptr + g_at, g.to(gu_ptr.dtype.element_ty), mask=ok)
            tl.store(gu_ptr + g_at + n_cols, u.to(gu_ptr.dtype.element_ty), mask=ok)
    act, _ = act_and_slope(g, ACT)
    tl.store(h_ptr + rows[:, None] * n_cols + cols[None, :], (act * u).to(h_ptr.dtype.element_ty), mask=ok)


def _act_backward_kernel(
    dh_ptr,
    extra_ptr,
    gu_ptr,
    w_ptr,
    dw_ptr,
    n_rows,
    n_cols,
    ACT: tl.constexpr,
    EXTRA: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    ok = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    at = rows[:, None] * n_cols + cols[None, :]
    g_at = rows[:, None] * (2 * n_cols) + cols[None, :]
    dh1 = tl.load(dh_ptr + at, mask=ok, other=0.0).to(tl.float32)
    if EXTRA:
        dh1 += tl.load(extra_ptr + at, mask=ok, other=0.0).to(tl.float32)
    g = tl.load(gu_ptr + g_at, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + g_at + n_cols, mask=ok, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + rows, mask=rows < n_rows, other=0.0).to(tl.float32)
    act, slope = act_and_slope(g, ACT)
    h = act * u
    tl.store(dw_ptr + rows, tl.reduce(dh1 * h, 1, add_combine), mask=rows < n_rows)
    dh = dh1 * w[:, None]
    tl.store(dh_ptr + at, h.to(dh_ptr.dtype.element_ty), mask=ok)
    tl.store(gu_ptr + g_at, (dh * u * slope).to(gu_ptr.dtype.element_ty), mask=ok)
    tl.store(gu_ptr + g_at + n_cols, (dh * act).to(gu_ptr.dtype.element_ty), mask=ok)


@functools.cache
def _kernel(fn: Callable, interpret: bool):
    """``fn`` compiled for the GPU or wrapped for the interpreter, built once per mode."""
    return build_kernel(fn, interpret)


def gather(x: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    """``out[s] = x[token[s]]``.

    Args:
        x: (T, n) contiguous.
        token: (S,) int64 row of ``x`` for each output row.

    Returns:
        (S, n) in ``x``'s dtype.
    """
    if not triton_usable(x):
        return x[token]
    n = x.shape[1]
    out = x.new_empty(token.shape[0], n)
    grid = (token.shape[0], triton.cdiv(n, _BLOCK))
    _kernel(_gather_kernel, interpret_requested())[grid](x.contiguous(), token, out, n, BLOCK=_BLOCK)
    return out


def _summed(rows: torch.Tensor, extra: torch.Tensor | None) -> torch.Tensor:
    """The torch paths' ``rows + extra`` (``rows`` itself without ``extra``)."""
    return rows if extra is None else rows + extra


def combine(
    rows: torch.Tensor,
    position: torch.Tensor,
    weights: torch.Tensor | None,
    tokens: int,
    extra: torch.Tensor | None = None,
) -> torch.Tensor:
    """``out[t] = Σ_k w[t,k] · (rows + extra)[position[t·K + k]]`` (weights 1 when ``None``).

    Args:
        rows: (S, n) contiguous routed rows in expert order.
        position: (S,) int64 row of each route ``t·K + k``.
        weights: (tokens, K) routing weights, or ``None``.
        tokens: T.
        extra: (S, n) contiguous second addend of the rows, or ``None``.

    Returns:
        (T, n) in ``rows``' dtype, summed in FP32.
    """
    top_k = position.shape[0] // tokens
    if not triton_usable(rows):
        picked = _summed(rows, extra)[position].view(tokens, top_k, -1).float()
        if weights is not None:
            picked = picked * weights.float().unsqueeze(-1)
        return picked.sum(1).to(rows.dtype)
    n = rows.shape[1]
    out = rows.new_empty(tokens, n)
    w = weights.contiguous() if weights is not None else rows
    grid = (tokens, triton.cdiv(n, _BLOCK))
    _kernel(_combine_kernel, interpret_requested())[grid](
        rows,
        extra if extra is not None else rows,
        position,
        w,
        out,
        n,
        K=top_k,
        WEIGHTED=weights is not None,
        EXTRA=extra is not None,
        BLOCK=_BLOCK,
    )
    return out


def act_forward(
    gate_up: torch.Tensor, activation: str, extra: torch.Tensor | None = None, store_sum: bool = False
) -> torch.Tensor:
    """``h = act(gate) ⊙ up`` for ``[gate, up] = gate_up + extra`` (S, 2I) contiguous; returns (S, I).

    With ``extra`` and ``store_sum``, the sum is also written over ``gate_up`` (the backward's input).
    """
    code = ACTIVATIONS[activation]
    n_rows, n_cols = gate_up.shape[0], gate_up.shape[1] // 2
    if not triton_usable(gate_up):
        summed = _summed(gate_up, extra)
        if store_sum and extra is not None:
            summed = gate_up.copy_(summed)
        gate, up = summed[:, :n_cols], summed[:, n_cols:]
        act, _ = torch_act_and_slope(gate.to(torch.promote_types(gate.dtype, torch.float32)), code)
        return (act * up.to(act.dtype)).to(gate_up.dtype)
    h = gate_up.new_empty(n_rows, n_cols)
    grid = (triton.cdiv(n_rows, _ROWS),)
    block = triton.next_power_of_2(n_cols)
    _kernel(_act_forward_kernel, interpret_requested())[grid](
        gate_up,
        extra if extra is not None else gate_up,
        h,
        n_rows,
        n_cols,
        ACT=code,
        EXTRA=extra is not None,
        STORE_SUM=store_sum,
        ROWS=_ROWS,
        BLOCK=block,
    )
    return h


def act_backward_(
    dh1: torch.Tensor,
    gate_up: torch.Tensor,
    weights: torch.Tensor,
    activation: str,
    extra: torch.Tensor | None = None,
) -> torch.Tensor:
    """The gated experts' activation backward with the routing weights (module docstring), in place.

    Args:
        dh1: (S, I) contiguous gradient of h before the routing weights (its first addend); overwritten with
            ``h``.
        gate_up: (S, 2I) contiguous forward input [gate, up]; overwritten with [d_gate, d_up].
        weights: (S,) routing weight of each row.
        activation: "silu", "gelu" or "gelu_tanh".
        extra: (S, I) contiguous second addend of the gradient of h, or ``None``.

    Returns:
        (S,) FP32 gradient of each row's routing weight.
    """
    code = ACTIVATIONS[activation]
    n_rows, n_cols = dh1.shape
    if not triton_usable(gate_up):
        gate, up = gate_up[:, :n_cols], gate_up[:, n_cols:]
        act, slope = torch_act_and_slope(gate.to(torch.promote_types(gate.dtype, torch.float32)), code)
        up32, dh32 = up.to(act.dtype), _summed(dh1, extra).to(act.dtype)
        h = act * up32
        dw = (dh32 * h).sum(-1).float()
        dh = dh32 * weights.to(act.dtype).unsqueeze(-1)
        gate.copy_(dh * up32 * slope)
        up.copy_(dh * act)
        dh1.copy_(h)
        return dw
    dw = torch.empty(n_rows, dtype=torch.float32, device=dh1.device)
    block = triton.next_power_of_2(n_cols)
    grid = (triton.cdiv(n_rows, _ROWS),)
    _kernel(_act_backward_kernel, interpret_requested())[grid](
        dh1,
        extra if extra is not None else dh1,
        gate_up,
        weights.contiguous(),
        dw,
        n_rows,
        n_cols,
        ACT=code,
        EXTRA=extra is not None,
        ROWS=_ROWS,
        BLOCK=block,
    )
    return dw
