"""Small typed bundles that ops take instead of long positional argument lists."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from ..errors import LoraleiError


class LoRAWeights(NamedTuple):
    """Everything one adapted projection contributes to an op.

    Attributes:
        W: frozen base weight, out×in (dense here; later issues allow a quantized tensor).
        quant: quantization state of ``W`` for quantized bases; ``None`` for a dense weight.
        A: LoRA down projection, r×in.
        B: LoRA up projection, out×r.
        scale: factor on ``B @ A`` (alpha/r or alpha/sqrt(r)).
        dropout_p: dropout probability on the LoRA branch input (0 disables it).
        bias: frozen base bias (out,) or ``None``.
    """

    W: torch.Tensor
    quant: Any
    A: torch.Tensor
    B: torch.Tensor
    scale: float
    dropout_p: float
    bias: torch.Tensor | None


def check_fusable(w: LoRAWeights, what: str) -> None:
    """Refuses a projection that a fused op cannot compute exactly.

    Args:
        w: the projection.
        what: how the error names it, e.g. ``"lora_group member 1"``.

    Raises:
        LoraleiError: a quantized base, or a base weight/bias that requires grad (fused ops give the frozen base
            no gradient).
    """
    if w.quant is not None:
        raise LoraleiError(
            f"{what}: quantized base weights are not supported by the fused op; use the plain path"
        )
    if w.W.requires_grad or (w.bias is not None and w.bias.requires_grad):
        raise LoraleiError(
            f"{what}: the base weight/bias requires grad, but fused ops give the frozen base no gradient; "
            "freeze it (inject_lora does) or use the plain path"
        )
