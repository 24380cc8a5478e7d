r"""Fused LoRA on MoE experts: routed rows only, grouped GEMMs, no (E, out, in) delta ever formed.

Shapes: T tokens, K experts per token, S = T·K routed rows, E experts, H hidden, I expert intermediate, r rank.
Banks ``W_u`` (gate_up: E×2I×H) and ``W_d`` (down: E×H×I) (or their transposes), factors ``A_p`` (E×r×in),
``B_p`` (E×out×r), scales ``s_p``; routing weights ``w`` (T×K). Rows are sorted by expert once
(:func:`loralei.ops.grouped.sort_routes`); ``[e]`` below means "each row with its expert's matrix" (one grouped
GEMM), and ``Σ_e`` a per-expert sum over its rows (a grouped GEMM with the rows as the reduced dimension).

Forward::

    X_s = X[token]                                        (S×H)   gathered, not kept
    Z_u = X_s A_u[e]ᵀ                                     (S×r)   kept
    G   = X_s W_u[e]ᵀ + s_u Z_u B_u[e]ᵀ                   (S×2I)  kept (the activation's input)
    h   = act(G[:, :I]) ⊙ G[:, I:]                        (S×I)   not kept
    Z_d = h A_d[e]ᵀ                                       (S×r)   kept
    O   = h W_d[e]ᵀ + s_d Z_d B_d[e]ᵀ                     (S×H)   not kept
    Y[t] = Σ_k w[t,k] O[route (t,k)]                      (T×H)   (a deterministic per-token sum)

Backward, from dY (T×H); ``dY_s = dY[token]`` (S×H), ``w_s`` the sorted routing weights::

    P_d  = dY_s B_d[e]                                    (S×r)
    dh₁  = dY_s W_d[e] + s_d P_d A_d[e]                   (S×I)   = ∂⟨dY_s, O⟩/∂h, before the weights
    dw   = rowsum(dh₁ ⊙ h)                                (S)     = ⟨dY_s, O⟩: O itself is never stored
    dA_d = s_d Σ_e (w_s P_d)ᵀ h;   dB_d = s_d Σ_e dY_sᵀ (w_s Z_d)
    dh   = w_s dh₁;   dG = act-backward(dh, G)            (in place over G; h is recomputed with it)
    P_u  = dG B_u[e];   dX_s = dG W_u[e] + s_u P_u A_u[e]  (S×H)
    dA_u = s_u Σ_e P_uᵀ X_s;   dB_u = s_u Σ_e dGᵀ Z_u
    dX[t] = Σ_k dX_s[route (t,k)]

The banks get no gradient. A bank without factors skips its LoRA terms. A quantized bank is dequantized, only
for the experts that received rows, into a buffer shared by every layer of that shape, in the forward and again
in the backward. Saved per layer: X (the layer input, alive anyway), G, Z_u, Z_d, the routing; that is
S·(2I + 2r) values instead of the S·(3H + 3I) an expert-by-expert autograd graph keeps.

Numerics: compute dtype = the banks'; X is cast once and dX returned in X's dtype; FP32 factors are cast to the
compute dtype for the products and their gradients come back in FP32.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from ..errors import LoraleiError
from ..kernels.activations import gated_act_split_backward_, gated_act_split_forward
from .grouped import Routing, grouped_mm, grouped_weight_grad, sort_routes
from .weights import ExpertBank, run_eager


class _Frozen(NamedTuple):
    """What the autograd Function needs besides the factors: the routing, the banks, the activation."""

    routing: Routing
    up: ExpertBank
    down: ExpertBank
    activation: str


def _dense(bank: ExpertBank, routing: Routing) -> Tensor:
    """The bank as a dense tensor: itself, or the routed experts dequantized into the shared buffer."""
    if bank.quant is None:
        return bank.W
    return bank.quant.dequantize(torch.nonzero(routing.counts).flatten().tolist())


def _project(x_s: Tensor, bank: ExpertBank, dense: Tensor, routing: Routing) -> tuple[Tensor, Tensor | None]:
    """``x_s W[e]ᵀ + s (x_s A[e]ᵀ) B[e]ᵀ`` and the kept ``Z = x_s A[e]ᵀ`` (``None`` without factors)."""
    y = grouped_mm(x_s, bank.in_out(dense), routing)
    if not bank.adapted:
        return y, None
    z = grouped_mm(x_s, bank.A.to(x_s.dtype).transpose(-2, -1), routing)
    return y.add_(grouped_mm(z, bank.B.to(x_s.dtype).transpose(-2, -1), routing), alpha=bank.scale), z


def _input_grad(
    dy_s: Tensor, bank: ExpertBank, dense: Tensor, routing: Routing
) -> tuple[Tensor, Tensor | None]:
    """``dy_s W[e] + s (dy_s B[e]) A[e]`` and ``P = dy_s B[e]`` (``None`` without factors)."""
    dx = grouped_mm(dy_s, bank.out_in(dense), routing)
    if not bank.adapted:
        return dx, None
    p = grouped_mm(dy_s, bank.B.to(dy_s.dtype), routing)
    return dx.add_(grouped_mm(p, bank.A.to(dy_s.dtype), routing), alpha=bank.scale), p


def _factor_grads(
    p: Tensor, inp: Tensor, dout: Tensor, z: Tensor, bank: ExpertBank, routing: Routing
) -> tuple[Tensor, Tensor]:
    """``dA = s Σ_e Pᵀ inp`` (E×r×in) and ``dB = s Σ_e doutᵀ Z`` (E×out×r), in the factors' dtypes."""
    da = grouped_weight_grad(p.t(), inp, routing, bank.A.dtype).mul_(bank.scale)
    db = grouped_weight_grad(dout.t(), z, routing, bank.B.dtype).mul_(bank.scale)
    return da, db


class _LoRAExpertsFunction(torch.autograd.Function):
    """One autograd node for an experts module; the math is in the module docstring."""

    @staticmethod
    def forward(ctx, x, top_k_weights, a_u, b_u, a_d, b_d, frozen: _Frozen):
        routing, up, down = frozen.routing, frozen.up, frozen.down
        x_s = x[routing.token]
        g, z_u = _project(x_s, up, _dense(up, routing), routing)
        del x_s
        h = gated_act_split_forward(g, frozen.activation)
        o, z_d = _project(h, down, _dense(down, routing), routing)
        del h
        o.mul_(routing.sorted_weights(top_k_weights).to(o.dtype).unsqueeze(-1))
        ctx.frozen = frozen
        ctx.save_for_backward(x, top_k_weights, g, z_u, z_d)
        return routing.unsort(o, x.shape[0])

    @staticmethod
    def backward(ctx, dy: Tensor):
        x, top_k_weights, g, z_u, z_d = ctx.saved_tensors
        frozen = ctx.frozen
        routing, up, down = frozen.routing, frozen.up, frozen.down
        w_s = routing.sorted_weights(top_k_weights).to(g.dtype).unsqueeze(-1)
        dy_s = dy.to(g.dtype)[routing.token]
        dh, p_d = _input_grad(dy_s, down, _dense(down, routing), routing)
        h = gated_act_split_forward(g, frozen.activation)
        # ⟨dh₁, h⟩ per row: a batched (1×I)(I×1) product accumulates in FP32 without FP32 copies of either
        dw = torch.bmm(dh.unsqueeze(1), h.unsqueeze(2)).view(-1) if ctx.needs_input_grad[1] else None
        grads_d = (
            _factor_grads(p_d * w_s, h, dy_s, z_d * w_s, down, routing) if down.adapted else (None, None)
        )
        del h
        dh.mul_(w_s)
        dg = gated_act_split_backward_(dh, g, frozen.activation)  # dg is g's buffer; dh now holds h
        del dh, dy_s
        dx_s, p_u = _input_grad(dg, up, _dense(up, routing), routing)
        grads_u = (None, None)
        if up.adapted:
            grads_u = _factor_grads(p_u, x.to(g.dtype)[routing.token], dg, z_u, up, routing)
        dx = routing.unsort(dx_s, x.shape[0]) if ctx.needs_input_grad[0] else None
        d_weights = None if dw is None else routing.unsort_weights(dw, top_k_weights).to(top_k_weights.dtype)
        return dx, d_weights, *grads_u, *grads_d, None


def _check(x: Tensor, up: ExpertBank, down: ExpertBank) -> None:
    for name, bank in (("gate_up", up), ("down", down)):
        if bank.bias is not None:
            raise LoraleiError(
                f"lora_experts: the {name} bank has a bias; the fused op has none: use the plain path"
            )
        if bank.W is not None and bank.W.requires_grad:
            raise LoraleiError(
                f"lora_experts: the {name} bank requires grad, but the fused op gives frozen banks no gradient"
            )
    if x.dim() != 2:
        raise LoraleiError(f"lora_experts: x must be (tokens, hidden), got shape {tuple(x.shape)}")


def lora_experts(
    x: Tensor, top_k_index: Tensor, top_k_weights: Tensor, up: ExpertBank, down: ExpertBank, activation: str
) -> Tensor:
    """Fused forward of a gated experts module with per-expert LoRA; same result as
    ``reference.lora_experts`` with ``act(gate) * up`` gating.

    Args:
        x: (T, H) hidden states of any floating dtype (cast once to the banks' dtype).
        top_k_index: (T, K) experts of each token.
        top_k_weights: (T, K) routing weights (differentiable: the router's gradient flows through them).
        up: the gate_up bank (E×2I×H, concatenated [gate; up] rows), frozen, without bias.
        down: the down bank (E×H×I), frozen, without bias.
        activation: "silu", "gelu" or "gelu_tanh".

    Returns:
        (T, H) in the banks' dtype.

    Raises:
        LoraleiError: a bank has a bias or requires grad, or ``x`` is not 2-D.
    """
    _check(x, up, down)
    routing = sort_routes(top_k_index, (up.W if up.quant is None else up.quant).shape[0])
    frozen = _Frozen(routing, up, down, activation)
    return run_eager(
        _LoRAExpertsFunction.apply, x.to(up.dtype), top_k_weights, up.A, up.B, down.A, down.B, frozen
    )
