r"""NF4 (QLoRA's 4-bit NormalFloat with double-quantized block scales): the packed layout and dequantization.

Layout (TorchAO's ``NF4Tensor``, which loralei stores): a weight of ``n`` elements, row-major over (out, in),
is cut into ``n / block`` blocks of ``block`` consecutive elements; the blocks into ``n / (block · sblock)``
scaler blocks. Per element a 4-bit code, two per byte (``data``, uint8, ``n / 2``: the even element in the
high nibble); per block an int8 ``scalers[b]``; per scaler block a ``factors[c]`` and one ``mean`` for the
tensor, both in the weight dtype. Dequantization, each step rounded to the weight dtype as TorchAO does::

    scale_b = round(round(scalers[b] / factors[b // sblock]) + mean)
    W[i]    = round(lut[code_i] · scale_{i // block})
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor


class NF4Packed(NamedTuple):
    """The tensors and sizes of one NF4 weight, as kernels and launchers take them (module docstring: layout).

    Attributes:
        data: uint8 (n/2,), two codes per byte, the even element in the high nibble.
        scalers: int8 (n/block,), the double-quantized block scales.
        factors: (n/(block·sblock),) in the weight dtype: scalers[b] / factors[b // sblock] undoes them.
        mean: 0-dim, weight dtype: the block scales' mean, added back after that division.
        lut: (16,) the NF4 code values in the weight dtype.
        shape: (out, in) of the dense weight.
        block_size: elements per block (TorchAO's default 64).
        scaler_block_size: blocks per scaler block (TorchAO's default 256).
    """

    data: Tensor
    scalers: Tensor
    factors: Tensor
    mean: Tensor
    lut: Tensor
    shape: tuple[int, int]
    block_size: int
    scaler_block_size: int

    @property
    def dtype(self) -> torch.dtype:
        """The dense weight's dtype (the compute dtype)."""
        return self.lut.dtype


def block_scales(p: NF4Packed) -> Tensor:
    """The (n/block,) block scales in the weight dtype, rounded step by step as TorchAO rounds them."""
    grouped = p.scalers.view(-1, p.scaler_block_size)
    return (grouped / p.factors.unsqueeze(-1)).flatten().to(p.dtype) + p.mean


def dequantize_torch(p: NF4Packed, out: Tensor | None = None) -> Tensor:
    """The dense (out, in) weight in plain torch, bit-identical to TorchAO's dequantization.

    Args:
        p: the packed weight.
        out: (out, in) buffer of ``p.dtype`` to write into; a new tensor when ``None``.

    Returns:
        ``out`` (or the new tensor) holding the weight.
    """
    codes = torch.stack((p.data >> 4, p.data & 0xF), dim=-1).view(-1, p.block_size).int()
    dense = (p.lut[codes] * block_scales(p).unsqueeze(-1)).view(p.shape)
    if out is None:
        return dense
    return out.copy_(dense)


def dequantize(p: NF4Packed, out: Tensor) -> Tensor:
    """Writes the dense weight into ``out`` ((out, in), ``p.dtype``) and returns it."""
    return dequantize_torch(p, out)
