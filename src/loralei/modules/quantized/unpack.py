"""Unpacking the 4-bit codes of pre-quantized checkpoints in plain PyTorch (any device).

Two families, each a formula over whole tensors:

- integer codes with a zero point and a scale per group of input features (GPTQ, AWQ): eight 4-bit codes per
  int32 word, the low bits first; word ``w``'s code ``k`` stands at position ``8·w + order[k]`` of the packed
  axis (GPTQ: ``order[k] = k``; AWQ's GEMM layout interleaves them, 0 2 4 6 1 3 5 7). The dense weight is
  ``W[o, i] = (q[i, o] - (z[g(i), o] + zero_offset)) · s[g(i), o]``, with ``g`` the group of input ``i``.
- e2m1 floating-point codes (NVFP4): two codes per byte, the low nibble first; bit 3 is the sign and bits 0-2
  index the magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6; ``W = e2m1(code) · float(block_scale) · global_scale``, one
  block scale per 16 inputs, one global scale per weight (per expert projection in an expert bank).

Every product is formed in float32 (exact: a 4-bit integer or an e2m1 value times a float16 or e4m3 scale fits
float32's mantissa) and rounded once to the compute dtype, so the result is the format's value bit for bit.
"""

from __future__ import annotations

import torch
from torch import Tensor

CODES_PER_WORD = 8  # 4-bit codes per int32
CODES_PER_BYTE = 2  # e2m1 codes per uint8
NVFP4_BLOCK = 16  # inputs per NVFP4 block scale
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def unpack_words(packed: Tensor, dim: int, order: tuple[int, ...]) -> Tensor:
    """The 4-bit codes of int32 words, eight per word along ``dim``, as int32 in their logical order.

    Args:
        packed: int32 words, any shape.
        dim: the axis the codes were packed along (it grows eightfold).
        order: ``order[k]`` is the position, within its word's eight, of the code in bits ``4k .. 4k+3``.

    Returns:
        The codes (0..15), ``packed``'s shape with ``dim`` eight times longer.
    """
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    codes = (packed.unsqueeze(-1) >> shifts) & 0xF  # (..., 8): code k of each word, in bit order
    if order != tuple(range(CODES_PER_WORD)):
        slot_of = sorted(range(CODES_PER_WORD), key=order.__getitem__)  # the bit slot of each position
        codes = codes[..., slot_of]
    dim = dim % packed.dim()
    return codes.movedim(-1, dim + 1).flatten(dim, dim + 1)


def int4_groups(
    codes: Tensor, zeros: Tensor, scales: Tensor, group: Tensor, zero_offset: int, dtype: torch.dtype
) -> Tensor:
    """``W[o, i] = (codes[i, o] - (zeros[group[i], o] + zero_offset)) · scales[group[i], o]`` as (out, in).

    Args:
        codes: (in, out) integer codes.
        zeros: (groups, out) integer zero points as stored.
        scales: (groups, out) scales.
        group: (in,) the group of each input feature (int64).
        zero_offset: added to each stored zero point (1 for GPTQ's v1 format, which stores ``z - 1``).
        dtype: the dense weight's dtype.

    Returns:
        The dense (out, in) weight, contiguous.
    """
    shifted = (codes - (zeros + zero_offset)[group]).float()
    return (shifted * scales.float()[group]).to(dtype).t().contiguous()


def e2m1_values(codes: Tensor) -> Tensor:
    """The float32 values of e2m1 codes (uint8, 0..15)."""
    magnitudes = torch.tensor(E2M1_MAGNITUDES, device=codes.device)
    table = torch.cat((magnitudes, -magnitudes))
    return table[codes.long()]


def unpack_bytes(packed: Tensor) -> Tensor:
    """The two 4-bit codes of each byte along the last axis, the low nibble first (uint8)."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)


def nvfp4(weight: Tensor, block_scale: Tensor, global_scale: Tensor, dtype: torch.dtype) -> Tensor:
    """The dense NVFP4 tensor ``e2m1(code) · float(block_scale) · global_scale``.

    Args:
        weight: (..., out, in/2) uint8, two codes per byte.
        block_scale: (..., out, in/16) float8_e4m3fn.
        global_scale: float32: a scalar for one weight; for an expert bank (E, S), one scale for each of S equal
            runs of rows of each expert (the per-expert projections fused into the bank, e.g. gate then up).
        dtype: the dense tensor's dtype.

    Returns:
        The dense (..., out, in) tensor, contiguous.
    """
    values = e2m1_values(unpack_bytes(weight))
    blocks = block_scale.float().repeat_interleave(NVFP4_BLOCK, dim=-1)
    runs = global_scale.float().reshape(*weight.shape[:-2], -1)  # (..., S)
    rows = runs.repeat_interleave(weight.shape[-2] // runs.shape[-1], dim=-1)[..., None]
    return (values * blocks * rows).to(dtype)
