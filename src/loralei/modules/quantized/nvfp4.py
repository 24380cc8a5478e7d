"""Quantizing a dense weight to NVFP4, the layout NVIDIA ModelOpt exports and :func:`.unpack.nvfp4` decodes.

The recipe, per (out, in) weight in FP32:

- a global scale ``g = amax(|W|) / (6 · 448)`` (6: e2m1's largest value; 448: e4m3's), 1 for an all-zero weight;
- per block of 16 inputs, a scale ``amax(|block|) / 6 / g`` rounded to the nearest e4m3 value (so a block's
  scale never exceeds 448);
- codes: ``W / (float(block scale) · g)`` rounded to the nearest e2m1 value, ties to the even code (the rounding
  of the hardware's conversions), magnitudes beyond 6 clamped to 6; a block whose scale rounds to 0 gets codes 0.

Each value then decodes as ``e2m1(code) · float(block scale) · g``: a weight made of such values comes back
exactly.
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

import torch
from torch import Tensor

from .unpack import E2M1_MAGNITUDES, NVFP4_BLOCK

E2M1_MAX = E2M1_MAGNITUDES[-1]
E4M3_MAX = 448.0
# Midpoints between consecutive e2m1 magnitudes: the rounding boundaries.
_MIDPOINTS = tuple((a + b) / 2 for a, b in itertools.pairwise(E2M1_MAGNITUDES))


class NVFP4Tensors(NamedTuple):
    """One weight as a ModelOpt NVFP4 checkpoint stores it: ``weight`` uint8 (out, in/2), two codes per byte,
    the low nibble first; ``weight_scale`` float8_e4m3fn (out, in/16); ``weight_scale_2`` float32 scalar."""

    weight: Tensor
    weight_scale: Tensor
    weight_scale_2: Tensor


def e2m1_codes(x: Tensor) -> Tensor:
    """The nearest e2m1 codes (uint8, 0..15: bit 3 the sign) of float32 values, ties to the even code, clamped
    to ±6."""
    magnitude = x.abs().clamp(max=E2M1_MAX)
    midpoints = torch.tensor(_MIDPOINTS, device=x.device)
    code = torch.bucketize(magnitude, midpoints)  # a tie goes to the lower code ...
    tie = magnitude == midpoints[code.clamp(max=len(_MIDPOINTS) - 1)]
    code = code + (tie & (code % 2 == 1)).long()  # ... unless that code is odd
    return (code | (torch.signbit(x).long() << 3)).to(torch.uint8)


def quantize_nvfp4(weight: Tensor) -> NVFP4Tensors:
    """``weight`` (out, in) as NVFP4 (the recipe: module docstring), on its device.

    Raises:
        ValueError: ``in`` is odd or not a multiple of 16 (the caller checks shapes first, naming the module).
    """
    out_features, in_features = weight.shape
    if in_features % NVFP4_BLOCK:
        raise ValueError(f"NVFP4 needs in_features a multiple of {NVFP4_BLOCK}, not {in_features}")
    w32 = weight.detach().float()
    amax = w32.abs().amax()
    global_scale = torch.where(amax > 0, amax / (E2M1_MAX * E4M3_MAX), torch.ones_like(amax))
    blocks = w32.reshape(out_features, -1, NVFP4_BLOCK)
    block_amax = blocks.abs().amax(dim=-1)
    block_scale = (block_amax / E2M1_MAX / global_scale).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
    divisor = block_scale.float() * global_scale
    scaled = torch.where(divisor[..., None] > 0, blocks / divisor[..., None], torch.zeros_like(blocks))
    codes = e2m1_codes(scaled).reshape(out_features, in_features)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return NVFP4Tensors(packed, block_scale, global_scale)
