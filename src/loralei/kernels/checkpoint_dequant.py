r"""Dequantization of pre-quantized checkpoints' 4-bit codes (GPTQ, AWQ, NVFP4) straight into a dense buffer.

Two kernels, one per family of formats, each writing an (out, in) tile of the dense weight per program in one pass
(no int32 temporaries); what differs between the formats of a family is data the launcher passes:

- integer codes (:class:`IntWords`, GPTQ and AWQ): the code of ``W[o, i]`` sits in the int32 word
  ``qweight[i // pack_in, o // pack_out]`` (GPTQ packs eight inputs per word, AWQ eight outputs), at position
  ``i % pack_in + o % pack_out`` of the word's eight; ``slots`` says which 4-bit slot holds each position (the
  format's nibble order); zero points are packed eight outputs per word in the same order, plus ``zero_offset``;
  the group of input ``i`` is ``g_idx[i]`` or ``i // group_size``. ``W = (q - (z + zero_offset)) · s``.
- e2m1 codes (:class:`FloatCodes`, NVFP4): two per byte along the inputs, the low nibble first, each decoded from
  its bits (no table: a gather per element ran the kernel at a fifth of the integer kernel's bandwidth); one block
  scale per 16 inputs, an e4m3 byte decoded the same way; one global scale per run of rows (one run for a linear; an expert of a bank fused from
  several projections, e.g. gate then up, has one per projection). ``W = value(code) · scale(block code) · global``.

Each product is formed in float32 in the order of :mod:`loralei.modules.quantized.unpack` and rounded once to the
buffer's dtype, so the result is bit-identical to that torch unpacking. The callers decide where the kernels run
(:func:`usable`: where Triton runs on the buffer, :func:`loralei.kernels.activations.triton_usable`).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
from torch import Tensor

from .activations import build_kernel, interpret_requested, jit_helper, tl, triton_usable

_BLOCK_OUT = 32  # rows (outputs) per program
_BLOCK_IN = 128  # columns (inputs) per program: 256 contiguous bytes of bf16 written per row
_NIBBLE = 4  # bits per code
_CODES_PER_WORD = 8
_E2M1_PER_BYTE = 2
_NVFP4_BLOCK = 16  # inputs per NVFP4 block scale


class IntWords(NamedTuple):
    """A GPTQ or AWQ weight as the integer kernel reads it (module docstring: the formula).

    Attributes:
        qweight: int32 words of eight codes, (in / pack_in, out / pack_out).
        qzeros: int32 (groups, out / 8), eight zero points per word along the outputs.
        scales: (groups, out), fp16, bf16 or fp32.
        g_idx: (in,) int32/int64, the group of each input; ``None``: groups of ``group_size`` consecutive inputs.
        group_size: inputs per group when ``g_idx`` is ``None``.
        zero_offset: added to each stored zero point.
        order: ``order[k]`` is the position, within its word's eight, of the code in bits ``4k .. 4k+3``.
        packed_dim: the axis of (in, out) ``qweight`` packs eight codes along (0: GPTQ's inputs, 1: AWQ's outputs).
    """

    qweight: Tensor
    qzeros: Tensor
    scales: Tensor
    g_idx: Tensor | None
    group_size: int
    zero_offset: int
    order: tuple[int, ...]
    packed_dim: int


class FloatCodes(NamedTuple):
    """An NVFP4 weight as the e2m1 kernel reads it (module docstring: the formula).

    Attributes:
        weight: uint8 (out, in / 2), two codes per byte, the low nibble first.
        block_scale: (out, in / 16), one-byte codes (float8_e4m3fn, or uint8).
        global_scale: float32, one scale, or (S,): one for each of S equal runs of rows (the projections fused
            into an expert of a bank).
    """

    weight: Tensor
    block_scale: Tensor
    global_scale: Tensor


def slot_table(order: tuple[int, ...]) -> int:
    """The 4-bit slot of each position packed into one int: bits ``4p .. 4p+2`` hold the slot of position ``p``."""
    return sum(slot << (_NIBBLE * position) for slot, position in enumerate(order))


@jit_helper
def dequant_tile_indices(n_in, BLOCK_OUT: tl.constexpr, BLOCK_IN: tl.constexpr):
    """The outputs and inputs of this program's tile of the dense weight (int32), and the tile's element offsets
    in the row-major (out, in) weight (int64: a dense weight may exceed 2³¹ elements, its packed tensors do not)."""
    o = tl.program_id(0) * BLOCK_OUT + tl.arange(0, BLOCK_OUT)
    i = tl.program_id(1) * BLOCK_IN + tl.arange(0, BLOCK_IN)
    return o, i, o.to(tl.int64)[:, None] * n_in + i[None, :]


@jit_helper
def word_code(words, position, slots):
    """The 4-bit code at ``position`` (0..7) of int32 ``words``, its slot read from the packed ``slots``."""
    slot = (slots >> (position * 4)) & 7
    return (words >> (slot * 4)) & 15


def _int_words_kernel(
    qweight_ptr, qzeros_ptr, scales_ptr, g_idx_ptr, out_ptr, n_out, n_in, group_size, zero_offset, slots,
    WORD: tl.constexpr, PACK_IN: tl.constexpr, PACK_OUT: tl.constexpr, HAS_G_IDX: tl.constexpr,
    BLOCK_OUT: tl.constexpr, BLOCK_IN: tl.constexpr,
):  # fmt: skip
    """One program: the (BLOCK_OUT, BLOCK_IN) tile ``W[o, i] = (q - (z + zero_offset)) · s`` of a GPTQ/AWQ weight
    (row-major tensors; ``WORD`` codes per int32, ``PACK_IN · PACK_OUT = WORD``)."""
    o, i, dense_at = dequant_tile_indices(n_in, BLOCK_OUT, BLOCK_IN)
    col_ok = i < n_in
    ok = (o < n_out)[:, None] & col_ok[None, :]
    group = tl.load(g_idx_ptr + i, mask=col_ok, other=0).to(tl.int32) if HAS_G_IDX else i // group_size
    word_at = (i // PACK_IN)[None, :] * (n_out // PACK_OUT) + (o // PACK_OUT)[:, None]
    codes = word_code(
        tl.load(qweight_ptr + word_at, mask=ok, other=0),
        (i % PACK_IN)[None, :] + (o % PACK_OUT)[:, None],
        slots,
    )
    zero_at = group[None, :] * (n_out // WORD) + (o // WORD)[:, None]
    zeros = (
        word_code(tl.load(qzeros_ptr + zero_at, mask=ok, other=0), (o % WORD)[:, None], slots) + zero_offset
    )
    scales = tl.load(scales_ptr + group[None, :] * n_out + o[:, None], mask=ok, other=0).to(tl.float32)
    dense = ((codes - zeros).to(tl.float32) * scales).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + dense_at, dense, mask=ok)


@jit_helper
def e2m1_value(code):
    """The float32 value of 4-bit e2m1 codes (int32, 0..15), built from its bits: sign bit 3, exponent bits 2-1
    (bias 1), mantissa bit 0; exponent 0 is subnormal (``m · 0.5``, 0.5 having float32 exponent 126)."""
    exp, man = (code >> 1) & 3, code & 1
    bits = tl.where(exp == 0, man * (126 << 23), ((exp + 126) << 23) | (man << 22))
    return (bits.to(tl.uint32) | ((code >> 3).to(tl.uint32) << 31)).to(tl.float32, bitcast=True)


@jit_helper
def e4m3_value(byte):
    """The float32 value of float8_e4m3fn bytes (int32, 0..255): sign bit 7, exponent bits 6-3 (bias 7), mantissa
    bits 2-0; exponent 0 is subnormal (``m · 2⁻⁹``); 0x7F and 0xFF are NaN. The sign is set as a bit, not by
    negating: compiled for the GPU, ``-x`` of +0.0 gives +0.0, so 0x80 would decode as +0.0 instead of -0.0."""
    exp, man = (byte >> 3) & 15, byte & 7
    normal = (((exp + 120) << 23) | (man << 20)).to(tl.float32, bitcast=True)
    magnitude = tl.where(exp == 0, man.to(tl.float32) * 0.001953125, normal)
    magnitude = tl.where((byte & 127) == 127, float("nan"), magnitude)
    sign = (byte >> 7).to(tl.uint32) << 31
    return (magnitude.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True)


def _float_codes_kernel(
    weight_ptr, block_ptr, global_ptr, out_ptr, experts_ptr, n_out, n_in, run_rows,
    n_runs, PER_BYTE: tl.constexpr, BLOCK: tl.constexpr, BLOCK_OUT: tl.constexpr, BLOCK_IN: tl.constexpr,
):  # fmt: skip
    """One program: the (BLOCK_OUT, BLOCK_IN) tile ``W = value(code) · scale(block) · global`` of an NVFP4 weight,
    the global scale of row ``o`` that of its run, ``o // run_rows``; of expert ``experts[program_id(2)]`` of a bank
    (the tensors stacked along a leading expert axis; a lone weight is expert 0 of one)."""
    e = tl.load(experts_ptr + tl.program_id(2)).to(tl.int64)
    first_row = e * n_out  # int64: the expert's first row in the stacked tensors
    weight_ptr += first_row * (n_in // PER_BYTE)
    block_ptr += first_row * (n_in // BLOCK)
    global_ptr += e * n_runs
    out_ptr += first_row * n_in
    o, i, dense_at = dequant_tile_indices(n_in, BLOCK_OUT, BLOCK_IN)
    row_ok = o < n_out
    ok = row_ok[:, None] & (i < n_in)[None, :]
    # each byte and block scale read once, as contiguous runs of the row (in is a multiple of 16): the two codes of
    # a byte become two (BLOCK_OUT, BLOCK_IN / 2) halves, interleaved back into the tile at the end
    half: tl.constexpr = BLOCK_IN // PER_BYTE
    blocks: tl.constexpr = BLOCK_IN // BLOCK
    j = tl.program_id(1) * half + tl.arange(0, half)
    b = tl.program_id(1) * blocks + tl.arange(0, blocks)
    byte = tl.load(
        weight_ptr + o[:, None] * (n_in // PER_BYTE) + j[None, :],
        mask=row_ok[:, None] & (j < n_in // PER_BYTE)[None, :], other=0,
    ).to(tl.int32)  # fmt: skip
    scale_code = tl.load(
        block_ptr + o[:, None] * (n_in // BLOCK) + b[None, :],
        mask=row_ok[:, None] & (b < n_in // BLOCK)[None, :], other=0,
    )  # fmt: skip
    scales = e4m3_value(scale_code.to(tl.int32))
    scales = tl.reshape(
        tl.broadcast_to(scales[:, :, None], (BLOCK_OUT, blocks, BLOCK // PER_BYTE)), (BLOCK_OUT, half)
    )
    runs = tl.load(global_ptr + o // run_rows, mask=row_ok, other=0)[:, None]
    low = e2m1_value(byte & 15) * scales * runs  # left to right, as unpack.nvfp4
    high = e2m1_value(byte >> 4) * scales * runs
    dense = tl.reshape(tl.join(low, high), (BLOCK_OUT, BLOCK_IN))
    tl.store(out_ptr + dense_at, dense.to(out_ptr.dtype.element_ty), mask=ok)


@functools.cache
def _launcher(kernel: object, interpret: bool):
    """``kernel`` compiled for the GPU or wrapped for the interpreter, built once per mode."""
    return build_kernel(kernel, interpret)


def usable(out: Tensor) -> bool:
    """Whether the kernels can write ``out`` (a CUDA fp32/fp16/bf16 buffer, or fp32/fp16 under the interpreter)."""
    return triton_usable(out)


def _grid(out: Tensor, experts: int = 1) -> tuple[int, int, int]:
    rows, cols = out.shape[-2:]
    return (-(-rows // _BLOCK_OUT), -(-cols // _BLOCK_IN), experts)


def _check_out(out: Tensor, device: torch.device, dims: int = 2) -> None:
    if out.dim() != dims or not out.is_contiguous() or out.device != device:
        shape = "(out, in)" if dims == 2 else "(E, out, in)"
        raise ValueError(
            f"out is {tuple(out.shape)} on {out.device} (contiguous: {out.is_contiguous()}); the kernels write a "
            f"contiguous {shape} buffer on the weight's device, {device}"
        )


@functools.cache
def _lone_expert(device: torch.device) -> Tensor:
    """The expert list of a weight that is not a bank: expert 0 (made once per device)."""
    return torch.zeros(1, dtype=torch.int32, device=device)


def dequantize_int_words(w: IntWords, out: Tensor) -> Tensor:
    """Writes the dense (out, in) GPTQ/AWQ weight into ``out`` (its dtype), bit-identical to
    :func:`loralei.modules.quantized.unpack.int4_groups`.

    Raises:
        ValueError: ``out`` is not a contiguous 2-D buffer on the weight's device.
    """
    _check_out(out, w.qweight.device)
    pack_in, pack_out = (_CODES_PER_WORD, 1) if w.packed_dim == 0 else (1, _CODES_PER_WORD)
    g_idx = w.scales if w.g_idx is None else w.g_idx.contiguous()  # a placeholder never read without g_idx
    _launcher(_int_words_kernel, interpret_requested())[_grid(out)](
        w.qweight.contiguous(), w.qzeros.contiguous(), w.scales.contiguous(), g_idx, out, out.shape[0],
        out.shape[1], w.group_size, w.zero_offset, slot_table(w.order),
        WORD=_CODES_PER_WORD, PACK_IN=pack_in, PACK_OUT=pack_out, HAS_G_IDX=w.g_idx is not None,
        BLOCK_OUT=_BLOCK_OUT, BLOCK_IN=_BLOCK_IN,
    )  # fmt: skip
    return out


def dequantize_float_codes(w: FloatCodes, out: Tensor) -> Tensor:
    """Writes the dense (out, in) NVFP4 weight into ``out`` (its dtype), bit-identical to
    :func:`loralei.modules.quantized.unpack.nvfp4`.

    Raises:
        ValueError: ``out`` is not a contiguous 2-D buffer on the weight's device.
    """
    _check_out(out, w.weight.device)
    return _float_codes(w, out, _lone_expert(out.device), w.global_scale.numel())


def dequantize_float_bank(w: FloatCodes, out: Tensor, experts: list[int] | None) -> Tensor:
    """Writes the dense matrices of ``experts`` of an NVFP4 expert bank into ``out`` (E, out, in) in one launch,
    each bit-identical to :func:`loralei.modules.quantized.unpack.nvfp4`; the other experts' are left as they are.

    Args:
        w: the bank: ``weight`` (E, out, in/2), ``block_scale`` (E, out, in/16), ``global_scale`` (E, S).
        out: the (E, out, in) buffer.
        experts: the experts to write; ``None``: all of them, their indices made on the device (nothing copied
            from the host: a CUDA graph can record it).

    Raises:
        ValueError: ``out`` is not a contiguous 3-D buffer on the bank's device.
    """
    _check_out(out, w.weight.device, dims=3)
    if experts is None:
        chosen = torch.arange(out.shape[0], dtype=torch.int32, device=out.device)
    elif not experts:
        return out
    else:
        chosen = torch.tensor(experts, dtype=torch.int32).to(out.device, non_blocking=True)
    return _float_codes(w, out, chosen, w.global_scale[0].numel())


def _float_codes(w: FloatCodes, out: Tensor, experts: Tensor, runs: int) -> Tensor:
    """The e2m1 kernel over ``experts``' tiles of ``out``, each expert's global scales in ``runs`` runs of rows."""
    rows, cols = out.shape[-2:]
    _launcher(_float_codes_kernel, interpret_requested())[_grid(out, experts.numel())](
        w.weight.contiguous(), w.block_scale.contiguous().view(torch.uint8), w.global_scale.contiguous(), out,
        experts, rows, cols, rows // runs, runs,
        PER_BYTE=_E2M1_PER_BYTE, BLOCK=_NVFP4_BLOCK, BLOCK_OUT=_BLOCK_OUT, BLOCK_IN=_BLOCK_IN,
    )  # fmt: skip
    return out
