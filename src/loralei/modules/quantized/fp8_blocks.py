"""The FP8 GEMMs of a base with 128x128 block scales (fine-grained FP8 checkpoints, ``fp8_kernel="auto"``): the
forward ``X Wᵀ`` and the input gradient ``dY W`` as ``torch.nn.functional.scaled_mm`` products with DeepSeek-style
scaling, e4m3 operands with FP32 scales, accumulated in FP32.

The activation side is quantized on the fly, one scale per row and 128 columns of the reduction dimension
(``amax(|group|) / 448``, 1 for an all-zero group; the "1x128" recipe); the weight keeps its own 128x128 scales.

- Forward: ``Y = X Wᵀ``, reduced over ``in``: ``X`` as 1x128 groups along ``in``, ``Wᵀ`` as the column-major view
  of the stored codes (nothing copied), its scale (``in/128``, ``out/128``) grid from the stored (``out/128``,
  ``in/128``) scales.
- Input gradient: ``dX = dY W``, reduced over ``out``: ``dY`` as 1x128 groups along ``out``, ``W`` transposed
  into a shared buffer (one per weight shape; :func:`.fp8_gemm.transposed_codes`) to be the column-major
  operand, its scale grid the stored scales themselves. A 128x128 block is a block of ``Wᵀ`` too, so no scale
  has to be folded into ``dY``.

PyTorch runs this scaling on CUDA GPUs of compute capability 9.x only, through cuBLASLt >= 12.9 (ATen's
``_check_deepseek_support`` in ``aten/src/ATen/native/cuda/ScaledBlas.cpp``), with both weight dimensions
multiples of 128 (the scale shapes ``torch/_meta_registrations.py`` checks: ``K // 128``, ``N // 128``) and the
weight scales' block columns padded to a multiple of 4 (cuBLAS's layout). :func:`block_gemm_problem` says why a
weight cannot take these GEMMs; such a weight computes on the dequantize backend instead.

``torch.nn.functional.scaled_mm`` (``_scaled_mm_v2``) is used, not ``torch._scaled_mm``: the older op also takes
1x128 x 128x128 scales, but unpadded, and on an H200 (PyTorch 2.11, CUDA 13.0) its products were wrong (norm-wise
error 44) wherever ⌈in/128⌉ is not a multiple of 4; the new op checks the padding, and its products matched the
fp64 products of the quantized operands to 1.3e-4 (FP32 output) and 1.7e-3 (bf16), both products, in that probe.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

from .fp8_gemm import padded_rows, quantize_rows, transposed_codes

BLOCK = 128  # the block edge of fine-grained FP8 checkpoints and of the 1x128 activation groups
SCALE_PAD = 4  # cuBLAS takes 128x128 scales with their block columns padded to a multiple of this
CUDA_NEEDED = (12, 9)  # cuBLASLt block scaling


def block_grid(shape: torch.Size) -> tuple[int, int]:
    """The shape of the 128x128 block scales of a weight of ``shape`` (out, in): ⌈out/128⌉, ⌈in/128⌉."""
    return (-(-shape[0] // BLOCK), -(-shape[1] // BLOCK))


@functools.cache
def _device_problem(device: torch.device) -> str | None:
    """Why block-scaled FP8 GEMMs do not run on ``device``; ``None`` when they do."""
    if not hasattr(F, "scaled_mm"):
        return "this PyTorch has no torch.nn.functional.scaled_mm (PyTorch >= 2.10)"
    if device.type != "cuda":
        return f"block-scaled FP8 GEMMs run on CUDA GPUs of compute capability 9.x only, and the weight is on {device}"
    capability = torch.cuda.get_device_capability(device)
    if capability[0] != 9:
        return (
            "block-scaled FP8 GEMMs run on CUDA GPUs of compute capability 9.x only (PyTorch's cuBLASLt "
            f"recipe), and {device} is {capability[0]}.{capability[1]}"
        )
    built = tuple(int(part) for part in (torch.version.cuda or "0.0").split(".")[:2])
    if built < CUDA_NEEDED:
        return f"block-scaled FP8 GEMMs need PyTorch built with CUDA >= 12.9, and this one has {torch.version.cuda}"
    return None


def block_gemm_problem(shape: torch.Size, device: torch.device) -> str | None:
    """Why a weight of ``shape`` on ``device`` cannot take the block-scaled FP8 GEMMs; ``None`` when it can."""
    problem = _device_problem(torch.device(device))
    if problem is None and any(dim % BLOCK for dim in shape):
        problem = f"weight {tuple(shape)} is not made of whole {BLOCK}x{BLOCK} blocks"
    return problem


def quantize_groups(x: Tensor) -> tuple[Tensor, Tensor]:
    """e4m3 codes of a (rows, cols) tensor, cols a multiple of 128, and its FP32 scales (rows, cols / 128), one per
    row and 128 columns: :func:`.fp8_gemm.quantize_rows` of each run of 128 columns."""
    codes, scale = quantize_rows(x.reshape(-1, BLOCK))
    return codes.view(x.shape), scale.view(x.shape[0], -1)


def _activation(x: Tensor) -> tuple[Tensor, Tensor]:
    """``x`` with its rows padded to a multiple of 16, as e4m3 codes and their 1x128 scales, the scales
    column-major (the layout the GEMM takes)."""
    codes, scale = quantize_groups(padded_rows(x))
    return codes, scale.t().contiguous().t()


def _block_scales(scales: Tensor) -> Tensor:
    """Block scales (rows / 128, reduction / 128) of an operand stored with the reduction dimension last, as the
    GEMM takes them for its column-major second operand: (reduction / 128 padded to 4, rows / 128), column-major."""
    return F.pad(scales, (0, -scales.shape[1] % SCALE_PAD)).contiguous().t()  # a zero pad keeps strides


def _scaled(
    a8: Tensor, scale_a: Tensor, b: Tensor, scale_b: Tensor, like: Tensor, out: Tensor | None
) -> Tensor:
    """``a b`` in ``like``'s dtype and rows (``a8`` has them padded), accumulated into ``out`` when given (the
    GEMM writes bf16 or FP32; other dtypes are cast from FP32)."""
    gemm_dtype = like.dtype if like.dtype in (torch.bfloat16, torch.float32) else torch.float32
    product = F.scaled_mm(
        a8,
        b,
        scale_a,
        F.ScalingType.BlockWise1x128,
        scale_b,
        F.ScalingType.BlockWise128x128,
        output_dtype=gemm_dtype,
    )
    product = product[: like.shape[0]].to(like.dtype)
    return product if out is None else out.add_(product)


def block_mm(x: Tensor, codes: Tensor, scales: Tensor, out: Tensor | None = None) -> Tensor:
    """``X Wᵀ`` (T, out) for X (T, in) and W = ``codes`` (out, in) times its 128x128 ``scales`` (out / 128,
    in / 128); accumulated into ``out`` when given."""
    a8, scale_a = _activation(x)
    return _scaled(a8, scale_a, codes.t(), _block_scales(scales), x, out)


def block_grad_mm(dy: Tensor, codes: Tensor, scales: Tensor, out: Tensor | None = None) -> Tensor:
    """``dY W`` (T, in) for dY (T, out), W as in :func:`block_mm`; accumulated into ``out`` when given."""
    a8, scale_a = _activation(dy)
    return _scaled(a8, scale_a, transposed_codes([codes]).t(), _block_scales(scales.t()), dy, out)
