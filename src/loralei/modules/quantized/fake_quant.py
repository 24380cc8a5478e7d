"""The export formats quantization-aware LoRA simulates (``LoRAConfig.qat``): for each, ``dequantize(quantize(W))``
of a dense (out, in) weight in its own dtype, on any device, with the same quantizer the format is made with:

- int4: TorchAO's tinygemm recipe (what ``quantization_type="int4"`` packs): per group of inputs,
  ``scale = (max - min) / 15`` and a zero point in the weight's dtype, codes 0..15;
- nf4: TorchAO's ``NF4Tensor`` (what ``quantization_type="nf4"`` packs), double-quantized block scales;
- fp8: e4m3 codes with one FP32 scale per output row (what ``quantization_type="fp8"`` packs);
- nvfp4: :mod:`.nvfp4` (ModelOpt's layout), decoded by :func:`.unpack.nvfp4` as a checkpoint's weights are.

:func:`check_qat` refuses, before injection changes anything, a weight the format cannot hold and a base that is
not dense; :func:`fake_quantize_linears_` rounds a (merged) model's linear weights to the format in place, to
measure what deployment in that format keeps.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import Tensor, nn

from ...config import QATConfig
from ...errors import InjectionError
from ...quiet import import_quietly
from .fp8_gemm import quantize_rows
from .nf4 import quantize_nf4
from .nvfp4 import quantize_nvfp4
from .unpack import nvfp4

_INT4_MAX = 15  # codes 0..15


def _tinygemm() -> object:
    """TorchAO's quantization primitives (the tinygemm int4 recipe)."""
    try:
        return import_quietly("torchao.quantization.quant_primitives")
    except ImportError:
        raise InjectionError("qat.weight='int4' needs TorchAO: pip install 'torchao>=0.15'") from None


def fake_int4(weight: Tensor, group: int) -> Tensor:
    """``weight`` through TorchAO's tinygemm int4 quantization and back (scales and zeros in its dtype)."""
    p = _tinygemm()
    w, block = weight.detach(), (1, group)
    scale, zero = p._choose_qparams_affine_tinygemm(
        w,
        p.MappingType.ASYMMETRIC,
        block,
        torch.int32,
        0,
        _INT4_MAX,
        scale_dtype=w.dtype,
        zero_point_dtype=w.dtype,
    )
    codes = p._quantize_affine_tinygemm(w, list(block), scale, zero, torch.int32, 0, _INT4_MAX)
    return p._dequantize_affine_tinygemm(
        codes, list(block), scale, zero, torch.int32, 0, _INT4_MAX, output_dtype=w.dtype
    )


def fake_nf4(weight: Tensor, group: int, scaler_block: int) -> Tensor:
    """``weight`` through TorchAO's NF4 quantization and back."""
    return quantize_nf4(weight, group, scaler_block).get_original_weight().to(weight.dtype)


def fake_fp8(weight: Tensor) -> Tensor:
    """``weight`` through per-row e4m3 quantization and back (``code · scale`` in FP32, then its dtype)."""
    codes, scale = quantize_rows(weight.detach())
    return (codes.float() * scale).to(weight.dtype)


def fake_nvfp4(weight: Tensor) -> Tensor:
    """``weight`` through NVFP4 quantization and back (decoded as a checkpoint's NVFP4 weights are)."""
    t = quantize_nvfp4(weight)
    return nvfp4(t.weight, t.weight_scale, t.weight_scale_2, weight.dtype)


def fake_quantizer(config: QATConfig) -> Callable[[Tensor], Tensor]:
    """``dequantize(quantize(·))`` of the format ``config`` names, on an (out, in) weight."""
    group = config.group
    table: dict[str, Callable[[Tensor], Tensor]] = {
        "int4": lambda w: fake_int4(w, group),
        "nf4": lambda w: fake_nf4(w, group, config.scaler_block),
        "fp8": fake_fp8,
        "nvfp4": fake_nvfp4,
    }
    return table[config.weight]


def _shape_problem(shape: torch.Size, config: QATConfig) -> str | None:
    """Why the format cannot hold an (out, in) weight of ``shape``, or ``None``."""
    group, kind = config.group, config.weight
    if kind in ("int4", "nvfp4") and shape[1] % group:
        return f"in={shape[1]} is not a multiple of qat.group_size={group} ({kind} groups inputs)"
    if kind == "nf4" and shape.numel() % (group * config.scaler_block):
        return (
            f"{shape.numel()} elements are not a multiple of qat.group_size * qat.scaler_block_size = "
            f"{group} * {config.scaler_block} (e.g. scaler_block_size: 8 for tiny models)"
        )
    return None


def check_qat(name: str, base: nn.Module, config: QATConfig) -> None:
    """Refuses, before anything changes, a base that QAT cannot merge into: not dense, not floating point, or of
    a shape the format cannot hold.

    Raises:
        InjectionError: naming the module, the problem and the fix.
    """
    weight = base.weight
    if (
        type(weight) not in (nn.Parameter, Tensor)
        or not weight.dtype.is_floating_point
        or weight.itemsize < 2
    ):
        raise InjectionError(
            f"module '{name}': qat needs a dense bf16/fp16/fp32 base weight to merge into, but it was loaded "
            f"quantized ({type(weight).__name__}, {weight.dtype}); load the unquantized model for QAT, or drop qat"
        )
    problem = _shape_problem(weight.shape, config)
    if problem is not None:
        raise InjectionError(
            f"module '{name}': weight {tuple(weight.shape)}: {problem}; or exclude the module"
        )


@torch.no_grad()
def fake_quantize_linears_(linears: Iterable[tuple[str, nn.Module]], config: QATConfig) -> None:
    """Rounds each named linear's dense weight to the format in place (its values as the deployed model would
    hold them), e.g. the adapted projections of a model after ``merge_and_unload_lora``; every weight is checked
    before the first changes.

    Raises:
        InjectionError: a weight the format cannot hold (see :func:`check_qat`).
    """
    linears = list(linears)
    for name, linear in linears:
        check_qat(name, linear, config)
    quantize = fake_quantizer(config)
    for _, linear in linears:
        linear.weight.copy_(quantize(linear.weight))
