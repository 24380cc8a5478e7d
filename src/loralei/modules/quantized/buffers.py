"""The dequantize backend shared by every quantized base: dequantize into a reused buffer, then a dense GEMM.

One buffer per (shape, dtype, device) serves every layer of that shape: the ops use a dequantized weight for
one GEMM and are done with it, so a model holds its packed weights plus one dense copy per distinct projection
shape (Llama-3-8B: four shapes, about 0.3 GB in bf16) instead of a dense copy per layer.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...ops.weights import QuantizedWeight

_BUFFERS: dict[tuple[torch.Size, torch.dtype, torch.device], Tensor] = {}


def shared_buffer(shape: torch.Size, dtype: torch.dtype, device: torch.device) -> Tensor:
    """The reused (out, in) buffer for weights of this shape, dtype and device (its contents are scratch)."""
    key = (torch.Size(shape), dtype, torch.device(device))
    buf = _BUFFERS.get(key)
    if buf is None:
        buf = _BUFFERS[key] = torch.empty(shape, dtype=dtype, device=device)
    return buf


def release_buffers() -> None:
    """Frees every dequantization buffer (they are made again on the next use)."""
    _BUFFERS.clear()


def dequantized_mm(q: QuantizedWeight, x: Tensor, out: Tensor | None, transpose: bool) -> Tensor:
    """``X Wᵀ`` (``transpose=False``) or ``X W`` with W dequantized into the shared buffer first.

    Args:
        q: the quantized weight.
        x: (T, in) input, or (T, out) output gradient with ``transpose``.
        out: accumulate into this tensor (``out += ...``); a new tensor when ``None``.
        transpose: multiply by W instead of Wᵀ (the input gradient).

    Returns:
        The product (``out`` when given).
    """
    w = q.dequantize(shared_buffer(q.shape, q.dtype, q.device))
    w = w if transpose else w.t()
    return torch.mm(x, w) if out is None else out.addmm_(x, w)
