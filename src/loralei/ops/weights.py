"""Small typed bundles that ops take instead of long positional argument lists."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch


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
