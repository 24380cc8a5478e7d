"""int4 bases: TorchAO's tile-packed int4 (``Int4TilePackedTo4dTensor``: asymmetric, one bf16 scale and zero per
``int4_group_size`` inputs), whose forward runs PyTorch's tinygemm kernel (CUDA, compute capability >= 8.0).

tinygemm computes ``X Wᵀ`` only, and the tile-packed layout has no unpacking op, so the weight is recovered by
multiplying identity rows through the kernel: ``E_c Wᵀ = W[:, c]ᵀ`` for a chunk ``c`` of input features. The
input gradient and dequantization run over chunks of ``_CHUNK`` input features, so they never hold more than
one (out, chunk) slice of the dense weight; the price is ``2·in²·out`` kernel FLOPs per full pass.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...errors import InjectionError
from ...quiet import import_quietly
from .tensor import PackedTensor

_CHUNK = 2048  # input features recovered per tinygemm call


def check_int4_shape(name: str, shape: torch.Size, group_size: int) -> None:
    """Refuses a weight whose input features do not divide into ``group_size`` groups, before anything changes.

    Raises:
        InjectionError: ``in % group_size != 0``.
    """
    if shape[1] % group_size:
        raise InjectionError(
            f"module '{name}': weight {tuple(shape)} has in={shape[1]}, not a multiple of "
            f"int4_group_size={group_size}; choose a group size that divides it or exclude the module"
        )


def quantize_int4(weight: Tensor, group_size: int) -> Tensor:
    """``weight`` (out, in) as TorchAO tile-packed int4 on its (CUDA) device.

    Raises:
        InjectionError: not a CUDA tensor of compute capability >= 8.0, not bfloat16, or TorchAO too old.
    """
    if weight.device.type != "cuda" or torch.cuda.get_device_capability(weight.device)[0] < 8:
        raise InjectionError(
            f"quantization_type='int4' runs on CUDA GPUs of compute capability >= 8.0 (tinygemm); the weight is on "
            f"{weight.device}: load the model on such a GPU or set quantization_device='cuda', or use 'nf4'"
        )
    if weight.dtype != torch.bfloat16:
        raise InjectionError(
            f"quantization_type='int4' computes in bfloat16; the weight is {weight.dtype}: load the model with "
            "dtype=torch.bfloat16, or use 'nf4'"
        )
    try:
        packed = import_quietly("torchao.quantization").Int4TilePackedTo4dTensor
    except (ImportError, AttributeError):
        raise InjectionError(
            "quantization_type='int4' needs torchao>=0.15 (Int4TilePackedTo4dTensor)"
        ) from None
    return packed.from_hp(weight.detach().contiguous(), [1, group_size])


class Int4Weight(PackedTensor):
    """A tile-packed int4 tensor seen through the quantized-base protocol
    (:class:`loralei.ops.weights.QuantizedWeight`)."""

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.tensor.qdata, self.tensor.scale_and_zero))

    @property
    def backend(self) -> str:
        return f"int4 (TorchAO tile-packed), tinygemm forward, weight recovered in chunks of {_CHUNK} inputs"

    def _columns(self, start: int, stop: int) -> Tensor:
        """``W[:, start:stop]ᵀ`` ((stop - start), out) from identity rows through the kernel."""
        rows = torch.arange(stop - start, device=self.device)
        eye = torch.zeros(stop - start, self.shape[1], dtype=self.dtype, device=self.device)
        eye[rows, rows + start] = 1
        return torch.nn.functional.linear(eye, self.tensor)

    def dequantize(self, out: Tensor | None = None) -> Tensor:
        out = torch.empty(self.shape, dtype=self.dtype, device=self.device) if out is None else out
        for start in range(0, self.shape[1], _CHUNK):
            stop = min(start + _CHUNK, self.shape[1])
            out[:, start:stop] = self._columns(start, stop).t()
        return out

    def mm(self, x: Tensor, out: Tensor | None = None) -> Tensor:
        y = torch.nn.functional.linear(x, self.tensor)
        return y if out is None else out.add_(y)

    def grad_mm(self, dy: Tensor, out: Tensor | None = None) -> Tensor:
        if out is None:
            out = dy.new_zeros(dy.shape[0], self.shape[1])
        for start in range(0, self.shape[1], _CHUNK):
            stop = min(start + _CHUNK, self.shape[1])
            out[:, start:stop].addmm_(dy, self._columns(start, stop).t())
        return out
