"""Pre-quantized checkpoint weights (GPTQ, AWQ, NVFP4) through the quantized-base protocol: dequantized into the
shared per-shape buffer, then dense GEMMs (:mod:`.buffers`), as the other bases' dequantize backend runs. The
buffer is written by the format's Triton kernel where Triton runs on it
(:mod:`loralei.kernels.checkpoint_dequant`, in one pass), elsewhere by the format's formula in plain PyTorch
(:mod:`.unpack`); both give the same bits."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ...kernels import checkpoint_dequant
from .buffers import dequantized_mm
from .checkpoint_formats import FORMATS
from .tensor import PackedTensor

if TYPE_CHECKING:
    from .checkpoint_tensor import CheckpointTensor


class CheckpointWeight(PackedTensor):
    """A :class:`.checkpoint_tensor.CheckpointTensor` seen through
    :class:`loralei.ops.weights.QuantizedWeight`."""

    tensor: CheckpointTensor

    @property
    def nbytes(self) -> int:
        return self.tensor.stored_bytes

    @property
    def backend(self) -> str:
        title = FORMATS[self.tensor.spec.method].title
        return f"{title} checkpoint weight, unpacked into a shared buffer for dense GEMMs"

    def dequantize(self, out: Tensor | None = None) -> Tensor:
        t = self.tensor
        # without ``out`` (a linear without LoRA) a new tensor, written by the kernel where it runs as well
        target = torch.empty(t.shape, dtype=t.dtype, device=t.device) if out is None else out
        if checkpoint_dequant.usable(target):
            return FORMATS[t.spec.method].write(t.parts, t.spec, target)
        dense = t.dense()
        return dense if out is None else out.copy_(dense)

    def mm(self, x: Tensor, out: Tensor | None = None) -> Tensor:
        return dequantized_mm(self, x, out, transpose=False)

    def grad_mm(self, dy: Tensor, out: Tensor | None = None) -> Tensor:
        return dequantized_mm(self, dy, out, transpose=True)
