"""Pre-quantized checkpoint weights (GPTQ, AWQ, NVFP4) through the quantized-base protocol: dequantized by the
format's formula (:mod:`.unpack`, plain PyTorch on any device) into the shared per-shape buffer, then dense
GEMMs (:mod:`.buffers`), as the other bases' dequantize backend runs."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor

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
        return sum(t.numel() * t.element_size() for t in self.tensor.parts.values())

    @property
    def backend(self) -> str:
        title = FORMATS[self.tensor.spec.method].title
        return f"{title} checkpoint weight, unpacked into a shared buffer for dense GEMMs"

    def dequantize(self, out: Tensor | None = None) -> Tensor:
        dense = self.tensor.dense()
        return dense if out is None else out.copy_(dense)

    def mm(self, x: Tensor, out: Tensor | None = None) -> Tensor:
        return dequantized_mm(self, x, out, transpose=False)

    def grad_mm(self, dy: Tensor, out: Tensor | None = None) -> Tensor:
        return dequantized_mm(self, dy, out, transpose=True)
