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
    Y[t] = Σ_k w[t,k] O[route (t,k)]                      (T×H)   (one pass, :func:`..kernels.moe.combine`)

Backward, from dY (T×H); ``dY_s = dY[token]`` (S×H), ``w_s`` the sorted routing weights::

    P_d  = dY_s B_d[e]                                    (S×r)
    dh₁  = dY_s W_d[e] + s_d P_d A_d[e]                   (S×I)   = ∂⟨dY_s, O⟩/∂h, before the weights
    one elementwise pass (:func:`loralei.kernels.moe.act_backward_`), in place over dh₁ and G:
      h = act(G[:, :I]) ⊙ G[:, I:];  dw = rowsum(dh₁ ⊙ h) (= ⟨dY_s, O⟩: O is never stored);
      dG = act-backward(w_s dh₁, G)
    dA_d = s_d Σ_e (w_s P_d)ᵀ h;   dB_d = s_d Σ_e dY_sᵀ (w_s Z_d)
    P_u  = dG B_u[e];   dX_s = dG W_u[e] + s_u P_u A_u[e]  (S×H)
    dA_u = s_u Σ_e P_uᵀ X_s;   dB_u = s_u Σ_e dGᵀ Z_u
    dX[t] = Σ_k dX_s[route (t,k)]

Every ``+`` between a bank's product and its LoRA update (G, O, dh₁, dX_s) is done by the pass that reads the
sum next (the activation, its backward, the combine; :mod:`loralei.kernels.moe`), not by an add of its own,
which would write the S-row sum and read it back once more. The row gathers ``X[token]`` and ``dY[token]`` are
one Triton pass each.

The banks get no gradient. A bank without factors skips its LoRA terms. A quantized bank is dequantized into a
buffer shared by every layer of that shape, in the forward and again in the backward: whole when there are at
least as many routed rows as experts (nothing read on the host), else only the experts that received rows.
Saved per layer: X (the layer input, alive anyway), G, Z_u, Z_d, the routing; that is S·(2I + 2r) values instead
of the S·(3H + 3I) an expert-by-expert autograd graph keeps (under gradient checkpointing only X: see
:class:`_LoRAExpertsFunction`).

Numerics: compute dtype = the banks'; X is cast once and dX returned in X's dtype; FP32 factors are cast to the
compute dtype for the products and their gradients come back in FP32.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
from torch import Tensor

from ..errors import LoraleiError
from ..kernels.moe import act_backward_, act_forward
from . import recompute
from .grouped import Routing, grouped_mm, grouped_weight_grad, sort_routes
from .weights import ExpertBank, run_eager


class _Frozen(NamedTuple):
    """What the autograd Function needs besides the factors: the routing, the banks, the activation, and how
    this call keeps its values (:func:`_keeping`)."""

    routing: Routing
    up: ExpertBank
    down: ExpertBank
    activation: str
    lean: bool  # keep only the input; the backward recomputes G, Z_u, Z_d
    defer_output: bool  # a recomputation whose output may stay unfilled (loralei.ops.recompute)


def _dense(bank: ExpertBank, routing: Routing) -> Tensor:
    """The bank as a dense tensor: itself, or dequantized into the shared buffer: every expert where there are at
    least as many routed rows as experts (a training batch routes nearly every one, and the host reads nothing, so
    a CUDA graph can record the step), else only the experts that received rows (read on the host)."""
    if bank.quant is None:
        return bank.W
    if routing.order.shape[0] >= bank.quant.shape[0]:
        return bank.quant.dequantize(None)
    return bank.quant.dequantize(torch.nonzero(routing.counts).flatten().tolist())


def _project(
    x_s: Tensor, bank: ExpertBank, dense: Tensor, routing: Routing
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """``x_s W[e]ᵀ``, its LoRA update ``s (x_s A[e]ᵀ) B[e]ᵀ`` and the kept ``Z = x_s A[e]ᵀ`` (the last two
    ``None`` without factors). The two addends stay apart: their consumer sums them as it reads them."""
    y, z = grouped_mm(x_s, bank.in_out(dense), routing), _lora_z(x_s, bank, routing)
    return y, _lora_update(z, bank, routing), z


def _lora_z(x_s: Tensor, bank: ExpertBank, routing: Routing) -> Tensor | None:
    """``Z = x_s A[e]ᵀ`` (``None`` without factors)."""
    return grouped_mm(x_s, bank.A.to(x_s.dtype).transpose(-2, -1), routing) if bank.adapted else None


def _lora_update(z: Tensor | None, bank: ExpertBank, routing: Routing) -> Tensor | None:
    """``s Z B[e]ᵀ`` (``None`` without factors); the scale rides on the (small) factor."""
    if z is None:
        return None
    return grouped_mm(z, (bank.B * bank.scale).to(z.dtype).transpose(-2, -1), routing)


def _down_output(
    h: Tensor, z_d: Tensor | None, top_k_weights: Tensor, down: ExpertBank, routing: Routing
) -> Tensor:
    """``Y[t] = Σ_k w[t,k] (h W_d[e]ᵀ + s Z_d B_d[e]ᵀ)[route (t,k)]`` (T×H): the down bank's product and its
    LoRA update, summed by the combine as it reads them."""
    o = grouped_mm(h, down.in_out(_dense(down, routing)), routing)
    return routing.combine(o, top_k_weights, _lora_update(z_d, down, routing))


def _lora_p(dy_s: Tensor, bank: ExpertBank, routing: Routing) -> Tensor | None:
    """``P = dy_s B[e]`` (``None`` without factors): the rank-r product shared by dX and dA."""
    return grouped_mm(dy_s, bank.B.to(dy_s.dtype), routing) if bank.adapted else None


def _input_grad(
    dy_s: Tensor, p: Tensor | None, bank: ExpertBank, dense: Tensor, routing: Routing
) -> tuple[Tensor, Tensor | None]:
    """The addends ``dy_s W[e]`` and ``s P A[e]`` (``None`` without factors) of the input gradient."""
    dx = grouped_mm(dy_s, bank.out_in(dense), routing)
    if p is None:
        return dx, None
    return dx, grouped_mm(p, (bank.A * bank.scale).to(dy_s.dtype), routing)


def _factor_grads(
    p: Tensor, inp: Tensor, dout: Tensor, z: Tensor, bank: ExpertBank, routing: Routing
) -> tuple[Tensor, Tensor]:
    """``dA = s Σ_e Pᵀ inp`` (E×r×in) and ``dB = s Σ_e doutᵀ Z`` (E×out×r), in the factors' dtypes."""
    da = grouped_weight_grad(p.t(), inp, routing, bank.A.dtype).mul_(bank.scale)
    db = grouped_weight_grad(dout.t(), z, routing, bank.B.dtype).mul_(bank.scale)
    return da, db


def _keeping() -> tuple[bool, bool]:
    """``(lean, defer_output)`` for a call made now.

    Lean (keep only the input, recompute the rest in the backward; see :class:`_LoRAExpertsFunction`): no
    backward will follow (no grad mode), or saved tensors go through torch's checkpoint hooks, which would drop
    them. Not lean in the input-only checkpoint's recomputation (:mod:`loralei.train.input_checkpoint`, a
    recomputation without early stop): its backward follows at once, so the values are kept rather than
    computed a third time, and the output, which only the residual add reads, may stay unfilled.
    """
    rec = recompute.Recomputation.current
    input_only = rec is not None and not rec.early_stop
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False) is not None
    lean = not torch.is_grad_enabled() or (hooks and not input_only)
    return lean, input_only and recompute.may_defer()


def _recompute(
    x: Tensor, frozen: _Frozen, dense_up: Tensor
) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
    """The forward's kept values ``X_s``, ``G``, ``Z_u``, ``Z_d`` from the input again."""
    routing, up, down = frozen.routing, frozen.up, frozen.down
    x_s = routing.gather(x)
    g, g_lora, z_u = _project(x_s, up, dense_up, routing)
    z_d = None
    if down.adapted:
        z_d = _lora_z(act_forward(g, frozen.activation, g_lora, store_sum=True), down, routing)
    elif g_lora is not None:
        g.add_(g_lora)
    return x_s, g, z_u, z_d


class _LoRAExpertsFunction(torch.autograd.Function):
    """One autograd node for an experts module; the math is in the module docstring.

    Under torch's checkpoint (saved-tensor hooks active), the kept values would be dropped by the
    checkpoint and the whole layer forward recomputed to get them back, grouped GEMMs included. The op then
    keeps its input X itself (a ctx attribute, outside the hooks: T×H, 1/K of a routed activation) and
    recomputes ``G``, ``Z_u``, ``Z_d`` in its backward (one gather, the gate_up products); with no saved
    tensors of its own, the checkpoint's recomputation stops before the op (early stop) and only the
    layer's cheaper parts run again.

    The input-only checkpoint (``gradient_checkpointing: true`` or ``offload`` in one process) runs the layer's
    forward without autograd and again, with it, right before the layer's backward. The first run keeps
    nothing; the second keeps ``G``, ``Z_u``, ``Z_d`` as without checkpointing (its backward comes next) and
    leaves its output, which only the residual add reads, unfilled: the down bank's product and the combine are
    skipped there (:mod:`loralei.ops.recompute`). That is one forward and one gate_up recomputation per step,
    as torch's checkpoint costs with early stop.
    """

    @staticmethod
    def forward(ctx, x, top_k_weights, a_u, b_u, a_d, b_d, frozen: _Frozen):
        routing, up, down = frozen.routing, frozen.up, frozen.down
        ctx.frozen, ctx.lean = frozen, frozen.lean
        x_s = routing.gather(x)
        g, g_lora, z_u = _project(x_s, up, _dense(up, routing), routing)
        del x_s
        # G = base + LoRA is written back only where the backward keeps it
        h = act_forward(g, frozen.activation, g_lora, store_sum=not ctx.lean)
        del g_lora
        if ctx.lean:
            ctx.inputs = (x, top_k_weights)
        z_d = _lora_z(h, down, routing)
        if frozen.defer_output:  # O and the combine only if something reads the output
            out = x.new_empty(x.shape)
            recompute.defer(out, functools.partial(_down_output, h, z_d, top_k_weights, down, routing))
        else:
            out = _down_output(h, z_d, top_k_weights, down, routing)
        del h
        if not ctx.lean:
            ctx.save_for_backward(x, top_k_weights, g, z_u, z_d)
        return out

    @staticmethod
    def backward(ctx, dy: Tensor):
        frozen = ctx.frozen
        routing, up, down = frozen.routing, frozen.up, frozen.down
        dense_up = _dense(up, routing)  # once: a quantized bank is dequantized for the recompute and dX alike
        if ctx.lean:
            x, top_k_weights = ctx.inputs
            x_s, g, z_u, z_d = _recompute(x, frozen, dense_up)
        else:
            x, top_k_weights, g, z_u, z_d = ctx.saved_tensors
            x_s = None
        w_s = routing.sorted_weights(top_k_weights)
        dy_s = routing.gather(dy.to(g.dtype))
        p_d = _lora_p(dy_s, down, routing)
        dh, dh_lora = _input_grad(dy_s, p_d, down, _dense(down, routing), routing)
        # in place: g becomes [d_gate, d_up] and dh becomes h; dw is ⟨dh₁, h⟩ per row
        dw = act_backward_(dh, g, w_s, frozen.activation, dh_lora)
        del dh_lora
        h, dg = dh, g
        grads_d = (None, None)
        if down.adapted:
            w_col = w_s.to(g.dtype).unsqueeze(-1)
            grads_d = _factor_grads(p_d * w_col, h, dy_s, z_d * w_col, down, routing)
        del h, dh, dy_s
        p_u = _lora_p(dg, up, routing)
        grads_u = (None, None)
        if up.adapted:  # the factors' gradients first, so X_s is freed before dX_s exists
            x_s = routing.gather(x.to(g.dtype)) if x_s is None else x_s
            grads_u = _factor_grads(p_u, x_s, dg, z_u, up, routing)
        del x_s
        dx = None
        if ctx.needs_input_grad[0]:
            dx_base, dx_lora = _input_grad(dg, p_u, up, dense_up, routing)
            dx = routing.combine(dx_base, None, dx_lora)
        d_weights = dw[routing.position].view(top_k_weights.shape).to(top_k_weights.dtype)
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
    # routing, sorting and the grouped products stay eager under torch.compile (data-dependent group sizes)
    return run_eager(_sorted_and_applied, x.to(up.dtype), top_k_index, top_k_weights, up, down, activation)


def _sorted_and_applied(
    x: Tensor, top_k_index: Tensor, top_k_weights: Tensor, up: ExpertBank, down: ExpertBank, activation: str
) -> Tensor:
    routing = sort_routes(top_k_index, up.base.shape[0])
    frozen = _Frozen(routing, up, down, activation, *_keeping())
    y = _LoRAExpertsFunction.apply(x, top_k_weights, up.A, up.B, down.A, down.B, frozen)
    if frozen.defer_output:
        recompute.settle()
    return y
