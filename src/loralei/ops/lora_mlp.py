"""Fused LoRA gated MLP: gate/up projections, gated activation and down projection in one autograd node.

Shapes: T tokens, H hidden, I intermediate, r rank. Per projection p ∈ {g, u, d}: base W_p (out×in), bias b_p,
A_p (r×in), B_p (out×r), scale s_p, dropout mask m_p (gate's and up's on x, down's on h; 1 without dropout).

Forward::

    G = x W_gᵀ + b_g + s_g ((x⊙m_g) A_gᵀ) B_gᵀ                       (T×I)
    U = x W_uᵀ + b_u + s_u ((x⊙m_u) A_uᵀ) B_uᵀ                       (T×I)
    h = act(G) ⊙ U                                                    (T×I)
    Y = h W_dᵀ + b_d + s_d ((h⊙m_d) A_dᵀ) B_dᵀ                       (T×H)

Backward, from dY (T×H); ``P_p = dOut_p B_p`` (T×r) is computed once and serves both dA_p and the input grad::

    P_d = dY B_d;  dB_d = s_d dYᵀ ((h⊙m_d) A_dᵀ);  dh = dY W_d + s_d (P_d A_d) ⊙ m_d
    dG = dh ⊙ U ⊙ act'(G);  dU = dh ⊙ act(G)        (one kernel; it also recomputes h from G, U)
    dA_d = s_d P_dᵀ (h⊙m_d)
    P_g = dG B_g;  dB_g = s_g dGᵀ ((x⊙m_g) A_gᵀ);  dA_g = s_g P_gᵀ (x⊙m_g)         (same for u with dU)
    dX = dG W_g + dU W_u + s_g (P_g A_g) ⊙ m_g + s_u (P_u A_u) ⊙ m_u             (one buffer)

Gate and up share x (:class:`loralei.ops.projection.Shared`): without dropout masks their rank-r GEMMs that read
x are batched, so x is read once for both: ``[x A_gᵀ, x A_uᵀ] = x [A_g; A_u]ᵀ`` (T×2r) in the forward and
``[dA_g; dA_u] = [P_g, P_u]ᵀ x`` (2r×H) in the backward (scales applied per row block).

Where Triton runs and h has no dropout mask (:func:`loralei.kernels.gated_mlp.usable`), the MLP kernels take
the gate/up LoRA terms and the down projection's input-gradient term in their tiles::

    forward:   G₀ = x W_gᵀ + b_g,  U₀ = x W_uᵀ + b_u   (plain GEMMs, stored)
               h = act(G₀ + s_g Z_g B_gᵀ) ⊙ (U₀ + s_u Z_u B_uᵀ)  and  U_d = h A_dᵀ
                                                      (one kernel; G, U never stored, h not read again)
    backward:  dh₀ = dY W_d;  one kernel forms G, U, dh = dh₀ + s_d P_d A_d tile by tile, writes dG over G₀
               and dU over U₀, and takes dA_d, dB_g, dB_u from the same tiles (h is never stored; dG/dU
               are not read again by those GEMMs)

With FP8 bases that quantize their activations per row (:meth:`~loralei.ops.weights.QuantizedWeight.row_factors`)
the kernels also take the row maxima of ``h`` (down's input) and of ``[dG·c_g dU·c_u]`` (the joint input-gradient
product's, ``c`` the row scales), and offer them to that quantization, which then reads those T×I rows once
(:mod:`loralei.ops.mlp_fp8`; the same codes).

Adding a rank-r term inside a kernel that reads the tile anyway costs a small dot per tile; the alternative
(the term written as its own T×I tensor and accumulated by the base GEMM) costs a write and a read of T×I.
Elsewhere (no Triton, a CPU tensor without the interpreter, a mask on h, rank > 64) every projection writes its
rank-r LoRA term first and lets the base GEMM accumulate into it (:mod:`loralei.ops.projection` says why), and
the activation runs as its elementwise kernel or in torch.

W and biases get no gradient. Saved for backward: x (in the compute dtype), G₀ and U₀ (or G and U), the three
r-wide products ``(input⊙m) Aᵀ`` (gate's and up's are column views of one T×2r tensor when unmasked) and the
masks. ``h`` is not saved but recomputed in the backward's elementwise pass, which writes dG, dU (and, on the
unfused path, h) over G, U (and dh), so the backward allocates no extra T×I buffer for them (a second backward
through the same graph, ``retain_graph=True``, therefore raises autograd's in-place error).

Under ``torch.compile`` with a quantized base the MLP is the shared-input group's op for gate/up, the activation,
and the single-projection op for down: those are custom ops that take quantized bases (this node is traced).

In a checkpoint recomputation (:mod:`loralei.ops.recompute`) the node saves the same tensors but ``Y`` (the
down projection's base GEMM and LoRA term) is left unfilled and computed only if something after the MLP
could read it; ``U_d = (h⊙m_d) A_dᵀ`` is still formed, since the backward needs it.

DoRA members (``scales``; the math of :mod:`loralei.ops.dora`, ``g_p = m_p / ‖W_p + s_p B_p A_p‖`` detached):
a DoRA gate is ``G = g_g ⊙ Z_G + b_g`` with ``Z_G`` the LoRA output without bias (likewise up), and a DoRA down
``Y = g_d ⊙ Z_d + b_d``. ``Z_G``, ``Z_U`` (or their base parts G₀, U₀) are kept in place of G, U, so gate/up keep
nothing extra; where the kernels run they apply ``g`` and the bias per column as they read the sums, write
``g_g ⊙ dG`` and ``g_u ⊙ dU`` (the gradients of the Z's, which the LoRA products then take) and return the column
dots ``Σ_t dG ⊙ Z_G``, ``Σ_t dU ⊙ Z_U``, whence ``dm = dots / norm``; elsewhere the same in torch passes (G, U
formed as new T×I tensors in both directions). A DoRA down's output is scaled in place in one pass
(:func:`loralei.ops.dora.scale_output_`) and kept (T×H) for ``dm_d`` (no hand-over, no deferred output in a
recomputation; a recomputation handed the forward's output, ``kept_down``, takes it instead of forming down's
product again: :mod:`loralei.ops.kept_outputs`; in a layer with a stash it goes to host memory until the backward:
:mod:`loralei.ops.stash`); its backward starts from ``g_d ⊙ dY`` (:func:`loralei.ops.dora.scale_backward`). DoRA
members take no dropout; with any, the node runs eagerly outside
compiled graphs. The DoRA helpers are in :mod:`loralei.ops.mlp_dora`.

Dropout: masks drawn here are bool (1 byte per element: two T×H, one T×I) and scaled by 1/(1-p) on use;
masks passed in are float, already scaled, as in :func:`loralei.ops.reference.lora_mlp`
(:func:`loralei.ops.dropout.op_mask`, as in the other fused ops).

Numerics: compute dtype = W's dtype; x is cast once and dX returned in x's dtype. A/B of another dtype (FP32
with ``lora_fp32_gradients``) are cast to the compute dtype for the matmuls (r-sized copies only); their grads
come out of GEMMs with low-precision inputs and FP32 outputs on CUDA (on CPU, which lacks such GEMMs, the
low-precision product is cast), never from full-size FP32 copies of activations.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from ..errors import LoraleiError
from ..kernels import gated_mlp
from ..kernels.activations import activation_code, gated_act_backward_with_h, gated_act_forward
from . import dora, mlp_dora, mlp_fp8, recompute, reference, stash
from .dora import DoRAScale
from .dropout import op_mask
from .lora_w import lora_w
from .projection import (
    Shared,
    a_grad,
    flat,
    input_grad,
    lora_output,
    lora_u,
    output_grads,
    project_shared,
    shared_grads,
    shared_us,
)
from .shared_input import lora_group
from .weights import (
    LoRAWeights,
    QuantizedWeight,
    base_grad,
    base_linear,
    check_fusable,
    join_bases,
    split_bases,
    with_base,
)

Masks = tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]
Scales = tuple[DoRAScale | None, DoRAScale | None, DoRAScale | None]


class _Frozen(NamedTuple):
    """The non-trainable part of one projection as the autograd Function sees it."""

    W: torch.Tensor | QuantizedWeight
    bias: torch.Tensor | None
    scale: float
    mask: torch.Tensor | None
    keep_scale: float  # 1/(1-p) for a drawn bool mask; 1.0 for a caller's already-scaled float mask


class _MLPSpec(NamedTuple):
    gate: _Frozen
    up: _Frozen
    down: _Frozen
    activation: str
    defer_output: bool  # a checkpoint recomputation: Y may stay unfilled (loralei.ops.recompute)
    hand_over: bool  # return (Y₀, U'_d) and leave down's LoRA term to the caller (loralei.ops.lowrank_sum)
    norms: tuple[
        torch.Tensor | None, torch.Tensor | None, torch.Tensor | None
    ]  # DoRA's ‖W + s B A‖ per member


def _weights(p: _Frozen, a: torch.Tensor, b: torch.Tensor) -> LoRAWeights:
    return with_base(p.W, a, b, p.scale, p.bias)


class _LoRAMLPFunction(torch.autograd.Function):
    """One autograd node for the whole gated MLP; the math is in the module docstring."""

    @staticmethod
    def forward(
        ctx, x, a_g, b_g, a_u, b_u, a_d, b_d, spec: _MLPSpec, m_g=None, m_u=None, m_d=None, kept_down=None
    ):
        x2 = flat(x).to(spec.down.W.dtype)
        g, u, d = spec.gate, spec.up, spec.down
        pair = Shared(
            [_weights(g, a_g, b_g), _weights(u, a_u, b_u)], [g.mask, u.mask], [g.keep_scale, u.keep_scale]
        )
        ranks = (a_g.shape[0], a_u.shape[0], a_d.shape[0])
        ctx.fused_kernels = d.mask is None and gated_mlp.usable(x2, ranks)
        down = _weights(d, a_d, b_d)
        factors = mlp_dora.factors(spec.norms, (m_g, m_u, m_d))
        columns = mlp_dora.kernel_columns(pair.ws, factors)
        if columns is not None:  # a DoRA member's G₀ (or Z) is kept without its bias
            ws = [
                w if f is None else w._replace(bias=None) for w, f in zip(pair.ws, factors[:2], strict=True)
            ]
            pair = pair._replace(ws=ws)
        if ctx.fused_kernels:  # G₀, U₀ stored; the kernels add the LoRA terms as they load them
            (za_g, za_u), _ = shared_us(x2, pair)
            gate_out, up_out = (base_linear(x2, w) for w in pair.ws)
            # where down quantizes h per row: read once for it (not where down's product waits to be filled:
            # a recomputation, whose down product nobody reads)
            h_max = None if spec.defer_output or kept_down is not None else mlp_fp8.h_maxima(d.W, x2)
            terms = (_term(za_g, b_g.t(), g), _term(za_u, b_u.t(), u))
            extra = {} if columns is None else {"columns": columns}
            h, za_d = gated_mlp.gated_mlp_forward(
                gate_out, up_out, *terms, a_d, spec.activation, row_max=h_max, **extra
            )
            mlp_fp8.offer_h(h, h_max)
        else:
            (gate_out, up_out), (za_g, za_u), _ = project_shared(x2, pair)
            acts = (
                mlp_dora.scaled(z, f, b)
                for z, f, b in zip((gate_out, up_out), factors[:2], (g.bias, u.bias), strict=True)
            )
            h = gated_act_forward(*acts, spec.activation)
            za_d = lora_u(h, down, d.mask, d.keep_scale)
        out_shape = (*x.shape[:-1], down.shape[0])
        y_down = None
        if kept_down is not None:  # DoRA on down, its output kept from the forward: not formed again
            y_down = kept_down.view(-1, out_shape[-1])
            out = kept_down
        elif factors[2] is not None:  # DoRA on down: its output kept for dm_d (no deferral, no hand-over)
            y_down = dora.scale_output_(lora_output(h, down._replace(bias=None), za_d), factors[2], d.bias)
            stash.mark(y_down, held=True)  # to host memory where the layer's stash takes it
            out = y_down.view(out_shape)
        elif spec.defer_output:  # a recomputation: Y only if something reads it (loralei.ops.recompute)
            out = h.new_empty(out_shape)  # not a view: settle may write it in place
            recompute.defer(out.view(-1, out.shape[-1]), functools.partial(lora_output, h, down, za_d))
        elif spec.hand_over:  # the caller adds s U_d B_dᵀ = U'_d B_dᵀ
            out = (base_linear(h, down).view(out_shape), za_d * down.scale)
        else:
            out = lora_output(h, down, za_d).view(out_shape)
        bases, ctx.quants = split_bases([g.W, u.W, d.W])
        saved_za_d = None if spec.hand_over else za_d  # handed over, dB_d comes from the caller's node
        ctx.save_for_backward(
            x2, gate_out, up_out, za_g, za_u, saved_za_d, a_g, b_g, a_u, b_u, a_d, b_d,
            *bases, g.mask, u.mask, d.mask, m_g, m_u, m_d, y_down,
        )  # fmt: skip
        ctx.biases = tuple(None if p.bias is None else p.bias.detach() for p in (g, u, d))
        ctx.columns = columns
        ctx.spec = spec._replace(
            **{k: getattr(spec, k)._replace(W=None, bias=None, mask=None) for k in ("gate", "up", "down")}
        )
        ctx.x_dtype, ctx.x_shape = x.dtype, x.shape
        return out

    @staticmethod
    def backward(ctx, dy, *handed):
        x2, gate_out, up_out, za_g, za_u, za_d, a_g, b_g, a_u, b_u, a_d, b_d, *rest = ctx.saved_tensors
        w_g, w_u, w_d = join_bases(rest[:3], ctx.quants)
        m_g, m_u, m_d = rest[3:6]
        *magnitudes, y_down = rest[6:]
        s = ctx.spec
        gate = _weights(s.gate._replace(W=w_g), a_g, b_g)
        up = _weights(s.up._replace(W=w_u), a_u, b_u)
        down = _weights(s.down._replace(W=w_d), a_d, b_d)
        k_g, k_u, k_d = s.gate.keep_scale, s.up.keep_scale, s.down.keep_scale
        dy = flat(dy).to(x2.dtype)
        factors = mlp_dora.factors(s.norms, magnitudes)
        d_ms = [None, None, None]
        if y_down is not None:  # DoRA on down: dZ_d = g_d ⊙ dY, dm_d from the kept output
            dy, d_ms[2] = dora.scale_backward(dy, y_down, factors[2], magnitudes[2], ctx.biases[2], True)

        if s.hand_over:  # dU'_d = dY B_d is G itself; the caller's node gave dB_d
            p_d, d_b_d = handed[0].to(x2.dtype), None
        else:
            p_d, d_b_d = output_grads(dy, za_d, down)
        if ctx.fused_kernels:  # dG over G₀, dU over U₀; dA_d, dB_g, dB_u from the same pass
            maxima = mlp_fp8.grad_maxima(w_g, w_u, gate_out) if ctx.needs_input_grad[0] else None
            extra = {} if ctx.columns is None else {"columns": ctx.columns}
            d_a_d, *pair_dbs = gated_mlp.gated_mlp_backward_(
                base_grad(dy, down), gate_out, up_out,
                _term(p_d, a_d, s.down), _term(za_g, b_g.t(), s.gate), _term(za_u, b_u.t(), s.up), s.activation,
                (a_d.dtype, b_g.dtype, b_u.dtype), row_max=maxima, **extra,
            )  # fmt: skip
            if ctx.columns is not None:  # dZ over Z_G, Z_U already; the column dots give dm
                *pair_dbs, dots = pair_dbs
                d_ms[:2] = [None if f is None else mlp_dora.magnitude_grad(dot, n, m)
                            for f, dot, n, m in zip(factors[:2], dots, s.norms, magnitudes, strict=False)]  # fmt: skip
            d_gate, d_up = gate_out, up_out
            # the maxima of dG, dU as written (a DoRA member's: f ⊙ dG, its Z's gradient)
            mlp_fp8.offer_grads(d_gate, d_up, maxima)
        else:  # h lands in dh's buffer, dG in gate_out's, dU in up_out's (a DoRA member's G, U: new ones)
            dh = input_grad([dy], Shared([down], [m_d], [k_d]), [p_d])
            acts = [
                mlp_dora.scaled(z, f, b)
                for z, f, b in zip((gate_out, up_out), factors[:2], ctx.biases[:2], strict=True)
            ]
            h, d_gate, d_up = gated_act_backward_with_h(dh, *acts, s.activation, inplace=True)
            d_a_d = a_grad(p_d, h, down, m_d, k_d)
            pair_dbs = None
            del h, dh
            grads = [
                mlp_dora.unscaled_grad(dz, z, f, n, m)
                for dz, z, f, n, m in zip(
                    (d_gate, d_up), (gate_out, up_out), factors, s.norms, magnitudes, strict=False
                )
            ]
            (d_gate, d_ms[0]), (d_up, d_ms[1]) = grads

        pair = Shared([gate, up], [m_g, m_u], [k_g, k_u])
        d_x, (d_a_g, d_a_u), (d_b_g, d_b_u) = shared_grads(
            [d_gate, d_up], x2, pair, [za_g, za_u], ctx.needs_input_grad[0], pair_dbs
        )
        if d_x is not None:
            d_x = d_x.to(ctx.x_dtype).view(ctx.x_shape)
        return d_x, d_a_g, d_b_g, d_a_u, d_b_u, d_a_d, d_b_d, None, *d_ms, None


def _term(z: torch.Tensor, m: torch.Tensor, p: _Frozen) -> gated_mlp.LowRank:
    """The LoRA term ``s · z m`` of projection ``p`` as the kernels take it."""
    return gated_mlp.LowRank(z, m, p.scale)


def _frozen(w: LoRAWeights, mask: torch.Tensor | None, shape: torch.Size, device: torch.device) -> _Frozen:
    """Bundles a projection's frozen tensors with the mask it applies to its (``shape``) input."""
    mask, factor = op_mask(shape, device, w.dtype, w.dropout_p, mask)
    return _Frozen(W=w.base, bias=w.bias, scale=w.scale, mask=mask, keep_scale=factor)


def _check_shapes(x: torch.Tensor, gate: LoRAWeights, up: LoRAWeights, down: LoRAWeights) -> None:
    """Gate and up must be I×H, down H×I, all in one dtype, and x must end in H."""
    inter, hidden = gate.shape
    expected = {"gate": (inter, hidden), "up": (inter, hidden), "down": (hidden, inter)}
    for name, w in (("gate", gate), ("up", up), ("down", down)):
        if tuple(w.shape) != expected[name] or w.dtype != gate.dtype:
            raise LoraleiError(
                f"lora_mlp {name}: base weight is {tuple(w.shape)} {w.dtype}, expected {expected[name]} "
                f"{gate.dtype} (gate/up I×H, down H×I, one dtype)"
            )
    if x.shape[-1] != hidden:
        raise LoraleiError(f"lora_mlp: input has {x.shape[-1]} features, the projections take {hidden}")


def lora_mlp(
    x: torch.Tensor,
    gate: LoRAWeights,
    up: LoRAWeights,
    down: LoRAWeights,
    activation: str,
    masks: Masks | None = None,
    hand_over: bool = False,
    scales: Scales | None = None,
    kept_down: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Fused ``down(act(gate(x)) * up(x))`` with LoRA on all three projections; see the module docstring.

    Same semantics as :func:`loralei.ops.reference.lora_mlp`.

    Args:
        x: (..., H) input of any floating dtype.
        gate: gate projection (W: I×H); every base must be frozen (dense or quantized).
        up: up projection (W: I×H).
        down: down projection (W: H×I).
        activation: "silu", "gelu" or "gelu_tanh".
        masks: optional float dropout masks (gate's and up's shaped like x, down's like h), already divided by
            the keep probability; a ``None`` entry draws a mask when that projection's ``dropout_p > 0``.
        hand_over: return ``(Y₀, U'_d)`` instead, the output without down's LoRA term (base and bias, (..., H))
            and ``U'_d = s_d (h⊙m_d) A_dᵀ`` (T, r), for a caller that adds ``U'_d B_dᵀ`` itself
            (:func:`loralei.ops.lowrank_sum.lowrank_sum`, which gives B_d its gradient); not under
            ``torch.compile`` with a quantized base. In a checkpoint recomputation ``Y₀`` is computed too.
        scales: DoRA: one entry per projection, None (LoRA) or its :class:`~loralei.ops.dora.DoRAScale`; a DoRA
            member's output is ``g ⊙ Z + bias`` (``g = m / ‖W + s B A‖``, ``Z`` the LoRA output without bias)
            and its magnitude gets a gradient (module docstring). DoRA members take no dropout and no
            ``hand_over`` on down; the op then runs outside compiled graphs.
        kept_down: with DoRA on down, in a checkpoint recomputation: the (..., H) output this op returned in the
            layer's forward (:mod:`loralei.ops.kept_outputs`). It is returned again and kept for ``dm_d`` instead
            of forming down's product once more; the backward is unchanged.

    Returns:
        (..., H) output in the base weights' dtype, or ``(Y₀, U'_d)`` with ``hand_over``.

    Raises:
        ValueError: unknown activation.
        LoraleiError: a trainable base, mismatched projections or input, a mask of the wrong shape,
            ``hand_over`` under ``torch.compile`` with a quantized base, a DoRA member with dropout (or on down
            with ``hand_over``), or ``kept_down`` without DoRA on down or of another shape.
    """
    activation_code(activation)
    for name, w in (("gate", gate), ("up", up), ("down", down)):
        check_fusable(w, f"lora_mlp {name}")
    _check_shapes(x, gate, up, down)
    masks = masks if masks is not None else (None, None, None)
    if kept_down is not None:
        mlp_dora.check_kept_down(kept_down, down, scales, (*x.shape[:-1], down.shape[0]))
    if scales is not None and any(sc is not None for sc in scales):
        mlp_dora.check(gate, up, down, scales, hand_over)
        return _dora_node(x, (gate, up, down), activation, masks, hand_over, scales, kept_down)
    if torch.compiler.is_compiling() and any(w.quant is not None for w in (gate, up, down)):
        if hand_over:
            raise LoraleiError(
                "lora_mlp: hand_over is not available under torch.compile with a quantized base"
            )
        # compiled with a quantized base: the group and single-projection custom ops, which take it (this node
        # would be traced, and with it the shared dequantization buffer as a value saved for backward)
        g, u = lora_group(x, [gate, up], list(masks[:2]))
        return lora_w(reference.gated_activation(g, u, activation), down, masks[2])
    return _node(x, (gate, up, down), activation, masks, hand_over, (None, None, None))


def _node(
    x: torch.Tensor,
    projections: tuple[LoRAWeights, LoRAWeights, LoRAWeights],
    activation: str,
    masks: Masks,
    hand_over: bool,
    scales: Scales,
    kept_down: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The fused autograd node on checked arguments (:func:`lora_mlp`'s)."""
    gate, up, down = projections
    spec = _MLPSpec(
        gate=_frozen(gate, masks[0], x.shape, x.device),
        up=_frozen(up, masks[1], x.shape, x.device),
        down=_frozen(down, masks[2], torch.Size((*x.shape[:-1], down.shape[1])), x.device),
        activation=activation,
        defer_output=recompute.may_defer() and not hand_over and scales[2] is None,
        hand_over=hand_over,
        norms=tuple(None if sc is None else sc.norm for sc in scales),
    )
    magnitudes = [None if sc is None else sc.magnitude for sc in scales]
    y = _LoRAMLPFunction.apply(x, gate.A, gate.B, up.A, up.B, down.A, down.B, spec, *magnitudes, kept_down)
    if spec.defer_output:
        recompute.settle()
    return y


# DoRA members: the node always, outside compiled graphs (as the single DoRA op; a graph break under compile)
_dora_node = torch.compiler.disable(_node)
