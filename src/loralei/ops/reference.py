"""Plain-PyTorch twins of every op. They define the semantics; fused ops are tested against them.

Numerics shared by all ops: the compute dtype is the base weight's; an input of another dtype is cast once
(autograd returns dX in the caller's dtype); LoRA factors kept in another dtype (FP32 with
``lora_fp32_gradients``) are cast to the compute dtype for the matmuls, so no full-size FP32 activation copy is
made and their gradients still land in FP32.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from .weights import ExpertBank, LoRAWeights, QuantizedWeight, run_eager


def lora_delta(x: torch.Tensor, w: LoRAWeights, dropout_mask: torch.Tensor | None = None) -> torch.Tensor:
    """LoRA branch ``scale * (dropout(x) @ Aᵀ) @ Bᵀ`` for ``x`` already in the compute dtype.

    Args:
        x: (..., in) input in the compute dtype.
        w: the projection's weights.
        dropout_mask: optional (..., in) mask already divided by the keep probability; when ``None`` and
            ``w.dropout_p > 0`` in training, a fresh mask is drawn by ``F.dropout``.

    Returns:
        (..., out) update.
    """
    if dropout_mask is not None:
        x = x * dropout_mask
    elif w.dropout_p > 0:
        x = F.dropout(x, p=w.dropout_p, training=True)
    a = w.A.to(x.dtype)
    b = w.B.to(x.dtype)
    return F.linear(F.linear(x, a), b) * w.scale


class _DequantizedLinear(torch.autograd.Function):
    """``X Wᵀ + bias`` for a quantized W: a fresh dequantization for each product, none kept for backward
    (keeping one would hold every layer's dense weight until its backward, which QLoRA exists to avoid)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, quant: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.quant = quant
        return F.linear(x, quant.dequantize(), bias)

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> tuple:
        dx = dy @ ctx.quant.dequantize() if ctx.needs_input_grad[0] else None
        dbias = dy.reshape(-1, dy.shape[-1]).sum(0) if ctx.needs_input_grad[2] else None
        return dx, None, dbias


def frozen_linear(x: torch.Tensor, quant: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """``X Wᵀ (+ bias)`` for a quantized frozen W, in its compute dtype (``x`` cast once), with no dense copy
    kept for the backward; outside compiled graphs, like the fused ops with quantized bases."""
    return run_eager(_DequantizedLinear.apply, x.to(quant.dtype), quant, bias)


def lora_linear(
    x: torch.Tensor, w: LoRAWeights, dropout_mask: torch.Tensor | None = None, lora: bool = True
) -> torch.Tensor:
    """``Y = X Wᵀ (+ bias) + scale * dropout(X) Aᵀ Bᵀ`` in the base weight's dtype.

    Args:
        x: (..., in) input of any floating dtype; cast once to the base's dtype.
        w: the projection's weights; a quantized base is dequantized for each product (its plain twin).
        dropout_mask: see :func:`lora_delta`.
        lora: ``False`` computes the base projection only.

    Returns:
        (..., out) output in ``W.dtype``.
    """
    x = x.to(w.dtype)
    out = F.linear(x, w.W, w.bias) if w.quant is None else frozen_linear(x, w.quant, w.bias)
    if lora:
        out = out + lora_delta(x, w, dropout_mask)
    return out


def dora_linear(
    x: torch.Tensor, w: LoRAWeights, magnitude: torch.Tensor, dropout_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """DoRA as PEFT defines it: ``Y = X Wᵀ + bias + (g - 1) ⊙ D(X) Wᵀ + g ⊙ s D(X) Aᵀ Bᵀ``.

    ``g = m / ‖W + s B A‖`` per output row, the norm detached (not differentiated, as in the DoRA paper) and
    computed from the dense ``W + s B A`` in at least FP32. Without dropout this is ``g ⊙ (X Wᵀ + s X Aᵀ Bᵀ) +
    bias``; with dropout the base term sees the undropped input (PEFT's rule).

    Args:
        x: (..., in) input of any floating dtype; cast once to the base's dtype.
        w: the projection's weights; a quantized base is dequantized.
        magnitude: (out,) the trainable magnitude ``m``.
        dropout_mask: see :func:`lora_delta`; drawn by ``F.dropout`` when ``None`` and ``w.dropout_p > 0``.

    Returns:
        (..., out) output in the base's dtype.
    """
    x = x.to(w.dtype)
    weight = w.W if w.quant is None else w.quant.dequantize()
    acc = torch.promote_types(weight.dtype, torch.float32)
    with torch.no_grad():
        delta = w.B.to(acc) @ w.A.to(acc) * w.scale
        norm = torch.linalg.vector_norm(weight.to(acc) + delta, dim=1)
    g = magnitude.to(acc) / norm
    if dropout_mask is None and w.dropout_p > 0:
        dropout_mask = F.dropout(torch.ones_like(x), p=w.dropout_p, training=True)
    xd = x if dropout_mask is None else x * dropout_mask
    out = g * (F.linear(xd, weight) + lora_delta(xd, w._replace(dropout_p=0.0)))
    if dropout_mask is not None:
        out = out + (F.linear(x, weight) - F.linear(xd, weight))
    if w.bias is not None:
        out = out + w.bias
    return out.to(w.dtype)


# --- gated MLP ---

_GATED_ACTIVATIONS = {
    "silu": F.silu,
    "gelu": lambda g: F.gelu(g, approximate="none"),
    "gelu_tanh": lambda g: F.gelu(g, approximate="tanh"),
}


def gated_activation(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    """``act(gate) * up`` with torch.nn.functional's activations.

    Args:
        gate: gate projection output.
        up: up projection output, same shape.
        activation: "silu" (SwiGLU), "gelu" (GeGLU, exact erf) or "gelu_tanh" (GeGLU, tanh approximation).

    Returns:
        ``h``, same shape as the inputs.

    Raises:
        ValueError: for an unknown activation; the message lists the supported ones.
    """
    if activation not in _GATED_ACTIVATIONS:
        raise ValueError(
            f"activation={activation!r} is not supported; use one of {sorted(_GATED_ACTIVATIONS)}"
        )
    return _GATED_ACTIVATIONS[activation](gate) * up


def lora_mlp(
    x: torch.Tensor,
    gate: LoRAWeights,
    up: LoRAWeights,
    down: LoRAWeights,
    activation: str,
    masks: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None] | None = None,
) -> torch.Tensor:
    """Gated MLP ``down(act(gate(x)) * up(x))`` where every projection is a :func:`lora_linear`.

    Args:
        x: (..., hidden) input of any floating dtype.
        gate: gate projection weights (inter×hidden base).
        up: up projection weights (inter×hidden base).
        down: down projection weights (hidden×inter base); its input is ``h``.
        activation: see :func:`gated_activation`.
        masks: optional dropout masks (gate's and up's on ``x``, down's on ``h``), each already divided by
            the keep probability; ``None`` entries draw fresh masks when that projection's ``dropout_p > 0``.

    Returns:
        (..., hidden) output in the base weights' dtype.
    """
    gate_mask, up_mask, down_mask = masks if masks is not None else (None, None, None)
    h = gated_activation(lora_linear(x, gate, gate_mask), lora_linear(x, up, up_mask), activation)
    return lora_linear(h, down, down_mask)


# --- shared-input group ---


def lora_group(
    x: torch.Tensor, ws: Sequence[LoRAWeights], dropout_masks: Sequence[torch.Tensor | None] | None = None
) -> tuple[torch.Tensor, ...]:
    """Twin of ``ops.shared_input.lora_group``: each member's :func:`lora_linear` on the same input.

    Args:
        x: (..., in) input of any floating dtype.
        ws: the members.
        dropout_masks: one mask (or ``None``) per member, in :func:`lora_delta`'s convention.

    Returns:
        One (..., out_i) output per member.
    """
    masks = list(dropout_masks) if dropout_masks is not None else [None] * len(ws)
    return tuple(lora_linear(x, w, m) for w, m in zip(ws, masks, strict=True))


# --- MoE experts ---


def dense_bank(bank: ExpertBank) -> torch.Tensor:
    """The bank's dense (storage-layout) tensor; a quantized bank is dequantized whole into a new tensor."""
    if bank.quant is None:
        return bank.W
    out = torch.empty(bank.quant.shape, dtype=bank.dtype, device=bank.quant.device)
    return bank.quant.dequantize(list(range(bank.quant.shape[0])), out)


def expert_linear(x: torch.Tensor, bank: ExpertBank, dense: torch.Tensor, e: int, lora: bool) -> torch.Tensor:
    """Expert ``e``'s projection of rows ``x``: ``x W[e]ᵀ (+ bias[e]) + scale (x A[e]ᵀ) B[e]ᵀ``."""
    y = x @ bank.in_out(dense)[e]
    if bank.bias is not None:
        y = y + bank.bias[e].to(y.dtype)
    if lora and bank.adapted:
        y = y + F.linear(F.linear(x, bank.A[e].to(x.dtype)), bank.B[e].to(x.dtype)) * bank.scale
    return y


def lora_experts(
    x: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    up: ExpertBank,
    down: ExpertBank,
    apply_gate: Callable[[torch.Tensor], torch.Tensor],
    post: Callable[[torch.Tensor], torch.Tensor] | None = None,
    lora: bool = True,
) -> torch.Tensor:
    """An MoE experts module's forward with each expert's LoRA update, expert by expert (Transformers' eager
    loop with the delta added). A quantized bank is dequantized whole for the call.

    Args:
        x: (T, H) hidden states of any floating dtype; cast once to the banks' dtype.
        top_k_index: (T, K) experts of each token.
        top_k_weights: (T, K) routing weights.
        up: the gate_up (or up) bank; its output goes through ``apply_gate``.
        down: the down bank.
        apply_gate: (rows, out_up) → (rows, I): the module's gating (e.g. ``act(gate) * up``).
        post: optional per-expert post-norm applied to each expert's down output.
        lora: ``False`` computes the base experts only.

    Returns:
        (T, H) in the banks' dtype.
    """
    x = x.to(up.dtype)
    dense_up, dense_down = dense_bank(up), dense_bank(down)
    out = torch.zeros(x.shape[0], down.in_out(dense_down).shape[-1], dtype=x.dtype, device=x.device)
    for e in top_k_index.unique().tolist():
        token, slot = torch.where(top_k_index == e)
        h = apply_gate(expert_linear(x[token], up, dense_up, e, lora))
        y = expert_linear(h, down, dense_down, e, lora)
        if post is not None:
            y = post(y)
        out = out.index_add(0, token, (y * top_k_weights[token, slot, None]).to(out.dtype))
    return out


def _head_logits(hidden: torch.Tensor, weight: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """``hidden @ weightᵀ`` in the weight's dtype, then FP32 and soft-capped when ``softcap`` is set."""
    logits = (hidden.to(weight.dtype) @ weight.t()).float()
    return softcap * torch.tanh(logits / softcap) if softcap is not None else logits


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int = -100,
    softcap: float | None = None,
) -> torch.Tensor:
    """Twin of ``ops.linear_cross_entropy``: full logits in the weight's dtype, FP32 cross entropy, summed."""
    logits = _head_logits(hidden, weight, softcap)
    return F.cross_entropy(logits, targets, ignore_index=ignore_index, reduction="sum")


def linear_token_losses(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int = -100,
    softcap: float | None = None,
) -> torch.Tensor:
    """Twin of ``ops.linear_token_losses``: full logits in the weight's dtype, FP32 cross entropy per row."""
    logits = _head_logits(hidden, weight, softcap)
    return F.cross_entropy(logits, targets, ignore_index=ignore_index, reduction="none")


# --- quantization-aware LoRA ---


def qat_linear(
    x: torch.Tensor, w: LoRAWeights, quantize: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """Twin of :func:`loralei.ops.qat.qat_linear` in autograd's terms: ``W_m = W + scale·B·A`` (FP32, with the
    factors' graph), ``W_q = W_m + (Q(W_m) - W_m)`` with the parenthesis detached (the straight-through
    estimator), ``Y = X W_qᵀ + bias`` in ``W``'s dtype."""
    x = x.to(w.W.dtype)
    merged = w.W.float() + (w.B.float() @ w.A.float()) * w.scale
    rounded = quantize(merged.detach().to(w.W.dtype)).float()
    w_q = merged + (rounded - merged).detach()
    return F.linear(x, w_q.to(w.W.dtype), w.bias)
