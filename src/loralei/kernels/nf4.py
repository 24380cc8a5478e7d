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
writes 4096 consecutive elements (a whole number of blocks, one scale each). Where Triton cannot run (no
triton, a CPU tensor without ``TRITON_INTERPRET=1``, or a block size that is not a power of two) it calls
:func:`dequantize_torch`. :func:`nf4_weight_tile` is the tile loader that it and the fused product
(:mod:`loralei.kernels.nf4_matmul`) share.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
from torch import Tensor

# tl: a jit helper's annotations need it (activations supplies a stand-in where triton is missing)
from .activations import build_kernel, interpret_requested, jit_helper, tl, triton_usable
from .gated_mlp import interpreter_runs_loops

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
    data_ptr, scalers_ptr, factors_ptr, mean_ptr, lut_ptr, out_ptr, n_blocks, sblock,
    BLOCK: tl.constexpr, NB: tl.constexpr,
):  # fmt: skip
    """Program ``pid``: blocks ``[pid · NB, pid · NB + NB)`` of the weight viewed as (n_blocks, BLOCK)."""
    blocks = tl.program_id(0).to(tl.int64) * NB + tl.arange(0, NB)
    ok = blocks < n_blocks
    mean = tl.load(mean_ptr).to(tl.float32)
    values = nf4_weight_tile(
        data_ptr, scalers_ptr, factors_ptr, mean, lut_ptr, blocks, ok, 0, BLOCK, sblock,
        out_ptr.dtype.element_ty, BLOCK, NB, BLOCK, 1, BLOCK,
    )  # fmt: skip
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
        ``TRITON_INTERPRET=1`` (see :func:`loralei.kernels.activations.triton_usable`) and an interpreter that
        runs the fused product's loop (Triton 3.6's cannot under numpy >= 2.4).
    """
    if not triton_usable(x):
        return False
    return not interpret_requested() or interpreter_runs_loops()


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
