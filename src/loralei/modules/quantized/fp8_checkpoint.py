"""Fine-grained FP8 checkpoints as FP8 bases, without a bf16 round trip.

A model loaded with Transformers' fine-grained FP8 (``FineGrainedFP8Config``: the Qwen3 "-FP8" releases,
DeepSeek-V3) holds each quantized linear as an ``FP8Linear``: ``weight`` float8_e4m3fn codes (out, in),
``weight_scale_inv`` float32 scales, one per 128x128 block (⌈out/128⌉, ⌈in/128⌉; dequantized
``W = code · scale``), ``block_size`` (128, 128), ``activation_scheme`` "dynamic", maybe a bias.

``inject_lora`` adopts such a module as it is, whatever ``quantize_base`` says (as it does bitsandbytes 4-bit
bases): :func:`as_linear` turns it into an ``nn.Linear`` whose frozen weight is a TorchAO ``Float8Tensor`` wrapping
the module's own two tensors (``block_size`` [128, 128], scale the same multiplier as ``weight_scale_inv``, dtype
the model's compute dtype), which :class:`.fp8.FP8Weight` computes with; nothing is dequantized or re-rounded.
Transformers' module is recognised only if Transformers already uses it.
"""

from __future__ import annotations

import sys
from collections import Counter

import torch
from torch import nn

from ...errors import InjectionError
from .fp8 import BLOCKS, float8_tensor
from .fp8_blocks import block_grid
from .fp8_gemm import E4M3

_FP8_MODULE = "transformers.integrations.finegrained_fp8"
_FIX = (
    "exclude the module (exclude_modules), or load the model dequantized (FineGrainedFP8Config(dequantize=True)) "
    "and let loralei pack it (quantize_base=True, quantization_type='fp8')"
)


def is_fp8_linear(module: nn.Module) -> bool:
    """Whether ``module`` is Transformers' ``FP8Linear`` itself (its grouped subclass computes otherwise)."""
    fp8 = sys.modules.get(_FP8_MODULE)
    return fp8 is not None and type(module) is getattr(fp8, "FP8Linear", None)


def _problem(module: nn.Module) -> str | None:
    """What keeps loralei from taking ``module`` (an ``FP8Linear``) as it is; ``None`` when nothing does."""
    block = module.block_size
    if block is None or tuple(block) != BLOCKS:
        return f"block_size={block!r}, but loralei computes with 128x128 block scales only (block_size=(128, 128))"
    if module.activation_scheme != "dynamic":
        return (
            f"activation_scheme={module.activation_scheme!r}, but loralei quantizes activations on the fly only "
            "(activation_scheme='dynamic')"
        )
    weight, scale = module.weight, module.weight_scale_inv
    shape = (module.out_features, module.in_features)
    if weight.dtype != E4M3 or tuple(weight.shape) != shape:
        return (
            f"weight {tuple(weight.shape)} of {weight.dtype}, but loralei takes float8_e4m3fn codes {shape}"
        )
    grid = block_grid(weight.shape)
    if scale.dtype != torch.float32 or tuple(scale.shape) != grid:
        return (
            f"weight_scale_inv {tuple(scale.shape)} of {scale.dtype}, but a {shape} weight's 128x128 block scales "
            f"are float32 {grid}"
        )
    return None


def check_fp8_linear(name: str, module: nn.Module) -> None:
    """Refuses, before anything changes, an ``FP8Linear`` that loralei cannot take as it is.

    Raises:
        InjectionError: a block size other than (128, 128), static activation scales, codes that are not e4m3,
            or scales that are not float32 or not one per 128x128 block (e.g. ``scale_fmt="ue8m0"``).
    """
    problem = _problem(module)
    if problem is not None:
        raise InjectionError(f"module {name!r} (a fine-grained FP8Linear): {problem}; {_FIX}")


def compute_dtype(model: nn.Module) -> torch.dtype:
    """The dtype ``model`` computes in: that of most elements of its floating-point parameters of two bytes or
    more outside its ``FP8Linear`` modules (embeddings, norms, head).

    Raises:
        InjectionError: ``model`` has no such parameter.
    """
    fp8 = {id(p) for m in model.modules() if is_fp8_linear(m) for p in m.parameters(recurse=False)}
    elements: Counter[torch.dtype] = Counter()
    for p in model.parameters():
        if id(p) not in fp8 and p.is_floating_point() and p.element_size() > 1:
            elements[p.dtype] += p.numel()
    if not elements:
        raise InjectionError(
            "cannot tell the compute dtype of this FP8 model: it has no floating-point parameters outside its "
            "FP8Linear modules; the LoRA factors take that dtype"
        )
    return elements.most_common(1)[0][0]


def as_linear(module: nn.Module, dtype: torch.dtype) -> nn.Linear:
    """An ``FP8Linear`` as an ``nn.Linear`` whose frozen weight is a ``Float8Tensor`` of the module's codes and
    block scales (the same tensors, not copies) computing in ``dtype``, and whose bias is the module's."""
    linear = nn.Linear(module.in_features, module.out_features, bias=False, device="meta")
    weight = float8_tensor()(
        module.weight.detach(), module.weight_scale_inv.detach(), block_size=list(BLOCKS), dtype=dtype
    )
    linear.weight = nn.Parameter(weight, requires_grad=False)
    linear.bias = module.bias
    return linear
