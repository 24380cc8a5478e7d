"""FP8 row maxima of the fused gated MLP (:mod:`loralei.ops.lora_mlp`). Where the bases quantize the MLP's wide
activations to FP8 per row (:meth:`~loralei.ops.weights.QuantizedWeight.row_factors`), its kernels take the row
maxima of ``h`` (down's input) and of ``[dG·c_g dU·c_u]`` (the joint input-gradient product's, ``c`` the gate's and
up's row factors) as they write them, of the values as written (with DoRA: ``h`` of the scaled sums, ``f ⊙ dG``),
and offer them to that quantization (:func:`loralei.kernels.fp8_operands.offer_row_maxima`), which then reads those
rows once for the same codes."""

from __future__ import annotations

import torch

from ..kernels import fp8_operands, gated_mlp
from .weights import QuantizedWeight, row_factors

Base = torch.Tensor | QuantizedWeight


def h_maxima(down: Base, like: torch.Tensor) -> torch.Tensor | None:
    """(T,) FP32 zeros for the forward kernel to raise to ``h``'s row maxima (T = ``like``'s rows, on its device)
    where down quantizes ``h`` per row; else ``None``."""
    if row_factors(down) is None:
        return None
    return like.new_zeros(like.shape[0], dtype=torch.float32)


def grad_maxima(gate: Base, up: Base, like: torch.Tensor) -> gated_mlp.RowMaxima | None:
    """Where the backward kernel takes the row maxima of ``[dG dU]`` times the gate's and up's row factors: both
    bases quantize their output gradient per row (the joint FP8 product ``[dG dU] [W_g; W_u]``); else ``None``."""
    f_g, f_u = row_factors(gate), row_factors(up)
    if f_g is None or f_u is None:
        return None
    return gated_mlp.RowMaxima(like.new_empty(like.shape[0], dtype=torch.float32), f_g, f_u)


def offer_h(h: torch.Tensor, h_max: torch.Tensor | None) -> None:
    """Offers ``h``'s row maxima (:func:`h_maxima`, filled) to its quantization; nothing without them."""
    if h_max is not None:
        fp8_operands.offer_row_maxima([h], None, h_max)


def offer_grads(d_gate: torch.Tensor, d_up: torch.Tensor, maxima: gated_mlp.RowMaxima | None) -> None:
    """Offers the row maxima of ``[dG dU]`` as written (:func:`grad_maxima`, filled) to the quantization of the
    joint input-gradient product; nothing without them."""
    if maxima is not None:
        fp8_operands.offer_row_maxima([d_gate, d_up], [maxima.gate_factors, maxima.up_factors], maxima.out)
