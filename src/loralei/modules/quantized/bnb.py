"""bitsandbytes 4-bit bases: a model loaded with ``BitsAndBytesConfig(load_in_4bit=True)`` keeps its
``Linear4bit`` weights (``Params4bit`` and their ``quant_state``); the ops dequantize them on the fly."""

from __future__ import annotations

import sys

import torch
from torch import Tensor, nn

from .buffers import dequantized_mm
from .tensor import DenseProducts


def is_bnb_linear4bit(module: nn.Module) -> bool:
    """Whether ``module`` is a bitsandbytes ``Linear4bit`` (bitsandbytes is imported only if it already is)."""
    bnb = sys.modules.get("bitsandbytes")
    return bnb is not None and isinstance(module, bnb.nn.Linear4bit)


def is_params4bit(param: Tensor) -> bool:
    """Whether ``param`` is a quantized bitsandbytes ``Params4bit``."""
    bnb = sys.modules.get("bitsandbytes")
    return bnb is not None and isinstance(param, bnb.nn.Params4bit) and param.quant_state is not None


class BnbWeight(DenseProducts):
    """A ``Params4bit`` seen through the quantized-base protocol (:class:`loralei.ops.weights.QuantizedWeight`)."""

    def __init__(self, param: Tensor) -> None:
        self.param = param
        self.state = param.quant_state

    @property
    def shape(self) -> torch.Size:
        return torch.Size(self.state.shape)

    @property
    def dtype(self) -> torch.dtype:
        return self.state.dtype

    @property
    def device(self) -> torch.device:
        return self.param.device

    @property
    def nbytes(self) -> int:
        state = self.state
        scales = [state.absmax, *((state.state2.absmax, state.state2.code) if state.nested else ())]
        return sum(t.numel() * t.element_size() for t in (self.param.data, *scales))

    @property
    def backend(self) -> str:
        return "bitsandbytes 4-bit, dequantized into a shared buffer for dense GEMMs"

    def dequantize(self, out: Tensor | None = None) -> Tensor:
        import bitsandbytes.functional as bnbf

        if out is not None and self.device.type == "cuda":
            return bnbf.dequantize_4bit(self.param.data, self.state, out=out)
        dense = bnbf.dequantize_4bit(self.param.data, self.state)  # the out= variant is CUDA-only
        return dense if out is None else out.copy_(dense)

    def mm(self, x: Tensor, out: Tensor | None = None) -> Tensor:
        return dequantized_mm(self, x, out, transpose=False)

    def grad_mm(self, dy: Tensor, out: Tensor | None = None) -> Tensor:
        return dequantized_mm(self, dy, out, transpose=True)
