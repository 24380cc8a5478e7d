"""What quantized bases share: the protocol's defaults for bases whose products run as dense GEMMs
(:class:`DenseProducts`), and the properties of one held as a TorchAO tensor subclass, which reports the dense
weight's shape, dtype and device itself (:class:`PackedTensor`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ...ops.weights import register_quant


class DenseProducts:
    """Defaults of :class:`loralei.ops.weights.QuantizedWeight` for a base whose products are dense GEMMs (on a
    dequantized copy or in a fused kernel): they accumulate into ``out`` for free, and each member of a group
    multiplies on its own."""

    accumulates = True

    def __new__(cls, *args: object, **kwargs: object) -> DenseProducts:
        base = super().__new__(cls)
        register_quant(base)  # numbered as it is made, so compiled graphs find it numbered
        return base

    def __getstate__(self) -> dict:
        """Copied or pickled without its number: the copy is numbered as it is made."""
        return {k: v for k, v in self.__dict__.items() if k != "_loralei_handle"}

    def joint_grad_mm(self, dys: Sequence[Tensor], others: Sequence[object]) -> Tensor | None:
        return None

    def row_factors(self) -> Tensor | None:
        return None


class PackedTensor(DenseProducts):
    """The shape, dtype and device properties of :class:`loralei.ops.weights.QuantizedWeight` for a weight
    held as one tensor subclass (``NF4Tensor``, tile-packed int4).

    Args:
        tensor: the packed weight (a frozen Parameter of the module).
    """

    def __init__(self, tensor: Tensor) -> None:
        self.tensor = tensor
        # read once: on a tensor subclass each read goes through its __torch_function__ (microseconds), and the
        # ops read them for every projection of every step (the module makes a new wrapper when it moves)
        self._dense = (tensor.shape, tensor.dtype)
        # the device is where the codes are now: a subclass fixes its own device when made, but the inner
        # tensors of a layer that streams (training.layer_offloading) point at the device buffers
        self._codes = getattr(tensor, tensor.__tensor_flatten__()[0][0])

    @property
    def shape(self) -> torch.Size:
        return self._dense[0]

    @property
    def dtype(self) -> torch.dtype:
        return self._dense[1]

    @property
    def device(self) -> torch.device:
        return self._codes.device
