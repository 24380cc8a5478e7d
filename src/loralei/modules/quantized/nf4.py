"""NF4 bases: the frozen weight is a TorchAO ``NF4Tensor`` (QLoRA's 4-bit NormalFloat, double-quantized scales).

Products run on the dequantize backend (:mod:`.buffers`) or, with ``nf4_kernel="triton"``, on loralei's fused
NF4 dequant-matmul, which reads the packed weight directly (:mod:`loralei.kernels.nf4`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...errors import InjectionError
from ...kernels import nf4 as nf4_kernels
from ...kernels import nf4_matmul
from ...quiet import import_quietly
from .buffers import dequantized_mm
from .tensor import PackedTensor

# Where TorchAO keeps NF4: current releases first, then the path of releases before 0.15.
_TORCHAO_NF4_MODULES = ("torchao.quantization.quantize_.workflows.nf4.nf4_tensor", "torchao.dtypes.nf4tensor")


def torchao_nf4():
    """TorchAO's NF4 module (``NF4Tensor``, ``to_nf4``).

    Raises:
        InjectionError: TorchAO is not installed or has no NF4 support.
    """
    for name in _TORCHAO_NF4_MODULES:
        try:
            return import_quietly(name)
        except ImportError:
            continue
    raise InjectionError(
        "quantize_base=True with quantization_type='nf4' needs TorchAO's NF4Tensor: pip install 'torchao>=0.10' "
        "(or loralei[qlora])"
    )


def check_nf4_shape(name: str, shape: torch.Size, block_size: int, scaler_block_size: int) -> None:
    """Refuses a weight TorchAO cannot store as NF4 with these blocks, before anything is changed.

    Raises:
        InjectionError: the element count does not divide by ``block_size * scaler_block_size``.
    """
    group = block_size * scaler_block_size
    if shape.numel() % group:
        raise InjectionError(
            f"module '{name}': weight {tuple(shape)} has {shape.numel()} elements, not a multiple of "
            f"nf4_block_size * nf4_scaler_block_size = {block_size} * {scaler_block_size} = {group}; choose "
            "smaller blocks (e.g. nf4_scaler_block_size=8 for tiny models) or exclude the module"
        )


def quantize_nf4(weight: Tensor, block_size: int, scaler_block_size: int) -> Tensor:
    """``weight`` (out, in) as an ``NF4Tensor`` on the same device."""
    return torchao_nf4().to_nf4(weight.detach().contiguous(), block_size, scaler_block_size)


class NF4Weight(PackedTensor):
    """An ``NF4Tensor`` seen through the quantized-base protocol (:class:`loralei.ops.weights.QuantizedWeight`).

    Args:
        tensor: the ``NF4Tensor`` (a frozen Parameter of the module).
        kernel: ``"dequantize"`` or ``"triton"`` (``LoRAConfig.nf4_kernel``).
        autotune: search the Triton kernel's tiles (``LoRAConfig.nf4_autotune``).
    """

    def __init__(self, tensor: Tensor, kernel: str = "dequantize", autotune: bool = True) -> None:
        super().__init__(tensor)
        self.kernel, self.autotune = kernel, autotune

    @property
    def packed(self) -> nf4_kernels.NF4Packed:
        """The packed tensors as the kernels take them."""
        t = self.tensor
        return nf4_kernels.NF4Packed(
            t.quantized_data, t.quantized_scalers, t.quantization_factor, t.scaler_mean, t.nf4,
            tuple(t.shape), t.block_size, t.scaler_block_size,
        )  # fmt: skip

    @property
    def nbytes(self) -> int:
        p = self.packed
        return sum(x.numel() * x.element_size() for x in (p.data, p.scalers, p.factors, p.mean, p.lut))

    def _unfused_reason(self) -> str | None:
        """Why the products do not run the fused Triton kernel: ``None`` when they do, ``""`` when the dequantize
        backend was chosen, else the reason ``nf4_kernel="triton"`` could not be honoured."""
        if self.kernel != "triton":
            return ""
        if not nf4_kernels.usable(self.tensor.nf4):
            return (
                f"nf4_kernel='triton' asked, but Triton cannot run on this {self.device} {self.dtype} weight"
            )
        reason = nf4_matmul.unsupported_weight(self.packed)
        return f"nf4_kernel='triton' asked, but {reason}" if reason else None

    @property
    def backend(self) -> str:
        reason = self._unfused_reason()
        if reason is None:
            return "NF4, fused Triton NF4 dequant-matmul (forward and input gradient)"
        return "NF4, dequantized into a shared buffer for dense GEMMs" + (f" ({reason})" if reason else "")

    def dequantize(self, out: Tensor | None = None) -> Tensor:
        if out is None:
            out = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        return nf4_kernels.dequantize(self.packed, out)

    def _product(self, x: Tensor, out: Tensor | None, transpose: bool) -> Tensor:
        if self._unfused_reason() is None:
            return nf4_matmul.nf4_matmul(x, self.packed, out, transpose, self.autotune)
        return dequantized_mm(self, x, out, transpose)

    def mm(self, x: Tensor, out: Tensor | None = None) -> Tensor:
        return self._product(x, out, transpose=False)

    def grad_mm(self, dy: Tensor, out: Tensor | None = None) -> Tensor:
        return self._product(dy, out, transpose=True)
