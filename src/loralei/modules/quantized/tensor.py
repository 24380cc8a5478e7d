"""What quantized bases held as one TorchAO tensor subclass share: the subclass reports the dense weight's
shape, dtype and device itself."""

from __future__ import annotations

import torch
from torch import Tensor


class PackedTensor:
    """The shape, dtype and device properties of :class:`loralei.ops.weights.QuantizedWeight` for a weight
    held as one tensor subclass (``NF4Tensor``, tile-packed int4).

    Args:
        tensor: the packed weight (a frozen Parameter of the module).
    """

    def __init__(self, tensor: Tensor) -> None:
        self.tensor = tensor

    @property
    def shape(self) -> torch.Size:
        return self.tensor.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.tensor.dtype

    @property
    def device(self) -> torch.device:
        return self.tensor.device
