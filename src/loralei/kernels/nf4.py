r"""NF4 (QLoRA's 4-bit NormalFloat with double-quantized block scales): the packed layout and dequantization.

Layout (TorchAO's ``NF4Tensor``, which loralei stores): a weight of ``n`` elements, row-major over (out, in),
is cut into ``n / block`` blocks of ``block`` consecutive elements; the blocks into ``n / (block · sblock)``
scaler blocks. Per element a 4-bit code, two per byte (``data``, uint8, ``n / 2``: the even element in the
high nibble); per block an int8 ``scalers[b]``; per scaler block a ``factors[c]`` and one ``mean`` for the
tensor, both in the weight dtype. Dequantization, each step rounded to the weight dtype as TorchAO does::

    scale_b = round(round(scalers[b] / factors[b // sblock]) + mean)
    W[i]    = round(lut[code_i] · scale_{i // block})

:func:`dequantize` runs a Triton kernel that follows these steps in fp32 with the same roundings (and a correctly
rounded division), so it is bit-identical to :func:`dequantize_torch` for fp32, fp16 and bf16; each program
turns 2048 packed bytes into 4096 consecutive elements. Where Triton cannot run (no triton, or a CPU tensor
without ``TRITON_INTERPRET=1``) it calls :func:`dequantize_torch`. :func:`nf4_weight_tile` is the tile loader of
the fused product (:mod:`loralei.kernels.nf4_matmul`).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
from torch import Tensor

# tl: a jit helper's annotations need it (activations supplies a stand-in where triton is missing)
from .activations import build_kernel, interpret_requested, jit_helper, tl, triton_usable
from .gated_mlp_launch import interpreter_runs_loops

_BYTES = 2048  # packed bytes per dequantization program: 4096 weights, 8 KB of bf16 written


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
def nf4_weight_tile(
    data_ptr, scalers_ptr, factors_ptr, mean, lut_ptr, rows, row_ok, col0, n_cols, sblock, dtype,
    BLOCK: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr, KB: tl.constexpr, SUB: tl.constexpr,
):  # fmt: skip
    """W[rows, col0 : col0 + COLS] of the weight viewed as (·, n_cols), in ``dtype``, as dequantize_torch has it.

    ``SUB = min(BLOCK, COLS)`` columns share a scale, ``KB = COLS / SUB`` scales per row; ``n_cols`` is a multiple
    of ``BLOCK``. Each step is rounded to ``dtype`` as TorchAO rounds it, and the division is the correctly
    rounded one (``div_rn``): plain ``/`` compiles to an approximate division on NVIDIA GPUs. The product of two
    values of a ≤16-bit-mantissa dtype is exact in fp32, so it is rounded once, as in torch. Rows with
    ``row_ok`` false come out finite (the mean times a code), for callers that mask them elsewhere.
    """
    rows = rows.to(tl.int64)
    blocks = rows[:, None] * (n_cols // BLOCK) + (col0 + tl.arange(0, KB) * SUB)[None, :] // BLOCK
    ok = row_ok[:, None]
    scalers = tl.load(scalers_ptr + blocks, mask=ok, other=0).to(tl.float32)
    factors = tl.load(factors_ptr + blocks // sblock, mask=ok, other=1.0).to(tl.float32)
    scales = (tl.math.div_rn(scalers, factors).to(dtype).to(tl.float32) + mean).to(dtype).to(tl.float32)
    byte_offs = rows[:, None] * (n_cols // 2) + (col0 // 2 + tl.arange(0, COLS // 2))[None, :]
    packed = tl.load(data_ptr + byte_offs, mask=ok, other=0).to(tl.int32)
    # join + row-major reshape interleaves the nibbles: element 2j is byte j's high nibble, 2j + 1 its low one
    codes = tl.reshape(tl.join(packed >> 4, packed & 15), (ROWS, COLS))
    values = tl.reshape(tl.load(lut_ptr + codes).to(tl.float32), (ROWS, KB, SUB)) * scales[:, :, None]
    return tl.reshape(values, (ROWS, COLS)).to(dtype)


def _dequantize_kernel(
    data_ptr, scalers_ptr, factors_ptr, mean_ptr, lut_ptr, out_ptr, n_bytes, n_values,
    HALF_BLOCK: tl.constexpr, SCALER_BLOCK: tl.constexpr, BYTES: tl.constexpr,
):  # fmt: skip
    """One program: ``BYTES`` packed bytes -> ``2 * BYTES`` contiguous weights, rounded as TorchAO rounds.
    Offsets in int64, and ``n_values = 2 * n_bytes`` passed in (an int32 ``n_bytes`` doubled here would wrap): a
    whole expert bank can hold more than 2^31 weights."""
    program = tl.program_id(0).to(tl.int64)
    offs = program * BYTES + tl.arange(0, BYTES)
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
    outs = 2 * program * BYTES + tl.arange(0, 2 * BYTES)
    tl.store(out_ptr + outs, pairs, mask=outs < n_values)


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
        ``TRITON_INTERPRET=1`` (see :func:`loralei.kernels.activations.triton_usable`) and an interpreter that
        runs the fused product's loop (Triton 3.6's cannot under numpy >= 2.4).
    """
    if not triton_usable(x):
        return False
    return not interpret_requested() or interpreter_runs_loops()


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

    Runs the Triton kernel where Triton can run on ``out`` (:func:`loralei.kernels.activations.triton_usable`);
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
    if not triton_usable(out):
        return dequantize_torch(p, out)
    n_bytes = p.data.numel()
    grid = ((n_bytes + _BYTES - 1) // _BYTES,)
    _dequantize_launcher(interpret_requested())[grid](
        p.data, p.scalers, p.factors, p.mean, p.lut, out, n_bytes, 2 * n_bytes,
        HALF_BLOCK=p.block_size // 2, SCALER_BLOCK=p.scaler_block_size, BYTES=_BYTES,
    )  # fmt: skip
    return out
