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

import functools
from typing import NamedTuple

import torch
from torch import Tensor

from .activations import build_kernel, interpret_requested, tl, triton_usable

_BYTES = 2048  # packed bytes per program: 4096 weights, 8 KB of bf16 written


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


def _dequantize_kernel(
    data_ptr, scalers_ptr, factors_ptr, mean_ptr, lut_ptr, out_ptr, n_bytes,
    HALF_BLOCK: tl.constexpr, SCALER_BLOCK: tl.constexpr, BYTES: tl.constexpr,
):  # fmt: skip
    """One program: ``BYTES`` packed bytes -> ``2 * BYTES`` contiguous weights, rounded as TorchAO rounds."""
    offs = tl.program_id(0) * BYTES + tl.arange(0, BYTES)
    valid = offs < n_bytes
    byte = tl.load(data_ptr + offs, mask=valid, other=0).to(tl.int32)
    block = offs // HALF_BLOCK
    scaler = tl.load(scalers_ptr + block, mask=valid, other=0).to(tl.float32)
    factor = tl.load(factors_ptr + block // SCALER_BLOCK, mask=valid, other=1.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    # each step rounded to the weight dtype, as torch computes it; div_rn: a correctly rounded division
    scale = tl.math.div_rn(scaler, factor).to(dtype).to(tl.float32)
    scale = (scale + tl.load(mean_ptr).to(tl.float32)).to(dtype).to(tl.float32)
    high = (tl.load(lut_ptr + (byte >> 4)).to(tl.float32) * scale).to(dtype)
    low = (tl.load(lut_ptr + (byte & 0xF)).to(tl.float32) * scale).to(dtype)
    pairs = tl.reshape(tl.join(high, low), [2 * BYTES])  # the even element first, as packed
    outs = 2 * tl.program_id(0) * BYTES + tl.arange(0, 2 * BYTES)
    tl.store(out_ptr + outs, pairs, mask=outs < 2 * n_bytes)


@functools.cache
def _kernel(interpret: bool):
    return build_kernel(_dequantize_kernel, interpret)


def dequantize(p: NF4Packed, out: Tensor) -> Tensor:
    """Writes the dense weight into ``out`` ((out, in) contiguous, ``p.dtype``) and returns it.

    A Triton kernel where it can run (:func:`loralei.kernels.activations.triton_usable`), bit-identical to
    :func:`dequantize_torch`, which serves everywhere else.
    """
    if not (triton_usable(out) and out.is_contiguous()):
        return dequantize_torch(p, out)
    n_bytes = p.data.numel()
    grid = ((n_bytes + _BYTES - 1) // _BYTES,)
    _kernel(interpret_requested())[grid](
        p.data, p.scalers, p.factors, p.mean, p.lut, out, n_bytes,
        HALF_BLOCK=p.block_size // 2, SCALER_BLOCK=p.scaler_block_size, BYTES=_BYTES,
    )  # fmt: skip
    return out
