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

# tl: a jit helper's annotations need it (activations supplies a stand-in where triton is missing)
from .activations import build_kernel, interpret_requested, jit_helper, tl, triton_usable

# Elements each dequantization program writes (4096: 2 KiB of codes, 8 KiB of bf16 out): enough bytes per program
# for a memory-bound pass, few enough programs' scale loads to be noise.
_ELEMENTS_PER_PROGRAM = 4096


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


@jit_helper
def nf4_block_scales(scalers_ptr, factors_ptr, mean, blocks, ok, sblock, dtype):
    """The scales of ``blocks`` as fp32 holding ``dtype`` values, rounded after each step as TorchAO rounds them.

    The division is the correctly rounded one (``div_rn``): plain ``/`` compiles to an approximate division on
    NVIDIA GPUs, which would break the bit-identity with :func:`dequantize_torch`.
    """
    scalers = tl.load(scalers_ptr + blocks, mask=ok, other=0).to(tl.float32)
    factors = tl.load(factors_ptr + blocks // sblock, mask=ok, other=1.0).to(tl.float32)
    quotient = tl.math.div_rn(scalers, factors).to(dtype).to(tl.float32)
    return (quotient + mean).to(dtype).to(tl.float32)


@jit_helper
def nf4_codes(data_ptr, byte_offs, mask, ROWS: tl.constexpr, COLS: tl.constexpr):
    """The (ROWS, COLS) int32 codes whose (ROWS, COLS / 2) bytes lie at ``byte_offs`` (high nibble first)."""
    packed = tl.load(data_ptr + byte_offs, mask=mask, other=0).to(tl.int32)
    # join + row-major reshape interleaves the nibbles: element 2j is byte j's high nibble, 2j + 1 its low one
    return tl.reshape(tl.join(packed >> 4, packed & 15), (ROWS, COLS))


def _dequantize_kernel(
    data_ptr, scalers_ptr, factors_ptr, mean_ptr, lut_ptr, out_ptr, n_blocks, sblock,
    BLOCK: tl.constexpr, NB: tl.constexpr,
):  # fmt: skip
    """Program ``pid``: blocks ``[pid · NB, pid · NB + NB)``, one scale each, written as (NB, BLOCK) elements."""
    dtype = out_ptr.dtype.element_ty
    blocks = tl.program_id(0).to(tl.int64) * NB + tl.arange(0, NB)
    ok = blocks < n_blocks
    mean = tl.load(mean_ptr).to(tl.float32)
    scales = nf4_block_scales(scalers_ptr, factors_ptr, mean, blocks, ok, sblock, dtype)
    byte_offs = blocks[:, None] * (BLOCK // 2) + tl.arange(0, BLOCK // 2)[None, :]
    codes = nf4_codes(data_ptr, byte_offs, ok[:, None], NB, BLOCK)
    # the product of two values of a ≤16-bit-mantissa dtype is exact in fp32, so it is rounded once, as in torch
    values = (tl.load(lut_ptr + codes).to(tl.float32) * scales[:, None]).to(dtype)
    offs = blocks[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    tl.store(out_ptr + offs, values, mask=ok[:, None])


@functools.cache
def _dequantize_launcher(interpret: bool):
    """The dequantization kernel compiled for the GPU or wrapped for the interpreter, built once per mode."""
    return build_kernel(_dequantize_kernel, interpret)


def usable(x: Tensor) -> bool:
    """Whether the NF4 Triton kernels can run for a weight of ``x``'s dtype and device.

    Args:
        x: a tensor of the compute dtype on the device the kernels would run on (e.g. the LUT or the input).

    Returns:
        True where Triton is importable and ``x`` is an fp32/fp16/bf16 CUDA tensor, or an fp32/fp16 tensor with
        ``TRITON_INTERPRET=1`` (see :func:`loralei.kernels.activations.triton_usable`).
    """
    return triton_usable(x)


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _check_out(p: NF4Packed, out: Tensor) -> None:
    if tuple(out.shape) != tuple(p.shape) or out.dtype != p.dtype or not out.is_contiguous():
        raise ValueError(
            f"out is {tuple(out.shape)} {out.dtype} (contiguous: {out.is_contiguous()}); dequantize needs a "
            f"contiguous {tuple(p.shape)} buffer of {p.dtype}"
        )
    if out.device != p.data.device:
        raise ValueError(f"out is on {out.device} but the weight is on {p.data.device}")


def dequantize(p: NF4Packed, out: Tensor) -> Tensor:
    """Writes the dense (out, in) weight into ``out``, bit-identical to :func:`dequantize_torch`.

    Runs the Triton kernel where :func:`usable` holds for the weight (and its block size is a power of two);
    elsewhere :func:`dequantize_torch`.

    Args:
        p: the packed weight.
        out: contiguous (out, in) buffer of ``p.dtype`` on the weight's device.

    Returns:
        ``out``, holding the weight.

    Raises:
        ValueError: ``out`` has the wrong shape, dtype, device or layout.
    """
    _check_out(p, out)
    if not usable(p.lut) or not _power_of_two(p.block_size) or p.block_size < 2:
        return dequantize_torch(p, out)
    n_blocks = p.scalers.numel()
    if n_blocks == 0:
        return out
    per_program = max(1, _ELEMENTS_PER_PROGRAM // p.block_size)
    grid = ((n_blocks + per_program - 1) // per_program,)
    _dequantize_launcher(interpret_requested())[grid](
        p.data, p.scalers, p.factors, p.mean, p.lut, out, n_blocks, p.scaler_block_size,
        BLOCK=p.block_size, NB=per_program,
    )  # fmt: skip
    return out
