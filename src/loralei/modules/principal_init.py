"""PiSSA and OLoRA: the adapter starts as the base weight's principal part and the base keeps the residual.

For a projection ``W`` (out×in) and the LoRA scale ``s``, in FP32 as PEFT computes them:

- ``"pissa"`` (Meng et al., 2024): ``W = U·diag(S)·Vᵀ`` (full SVD); with the r largest singular values,
  ``A0 = diag(sqrt(S_r / s))·V_rᵀ`` (r×in) and ``B0 = U_r·diag(sqrt(S_r / s))`` (out×r), so ``s·B0·A0 =
  U_r·diag(S_r)·V_rᵀ``. ``"pissa_niter_K"``: the same from ``torch.svd_lowrank`` with K subspace iterations
  (fast, approximate, random: seeded from the global RNG).
- ``"olora"`` (Büyükakyüz, 2024): ``W = Q·R`` (reduced QR); ``A0 = R[:r]``, ``B0 = Q[:, :r]``.

The factors are rounded to the LoRA dtype first, and the residual ``W_res = W − s·B0·A0`` is computed in FP32
from those rounded factors and rounded once to the base's dtype, so ``W_res + s·B0·A0`` equals ``W`` up to that
one rounding. With ``quantize_base`` the residual, not ``W``, is packed. The factors are kept on the module as
the buffers ``lora_A_init`` / ``lora_B_init`` (not in its ``state_dict``): the PEFT export subtracts them to give
a plain LoRA on the original base, and the native format saves them so a load rebuilds the same residual from the
original base without a second decomposition (:func:`initial_factors_to_come`, :func:`start_from`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from ..config import PRINCIPAL_INIT
from ..errors import InjectionError
from .quantized import quantize_weight

if TYPE_CHECKING:
    from .lora_linear import LoRALinear

INIT_A, INIT_B = "lora_A_init", "lora_B_init"
# Set while a load injects: the modules wait for their saved initial factors instead of decomposing W.
_TO_COME: ContextVar[bool] = ContextVar("loralei_initial_factors_to_come", default=False)


def is_principal(init: bool | str) -> bool:
    """Whether ``init`` (a ``LoRAConfig.init_lora_weights`` value) is PiSSA or OLoRA."""
    return isinstance(init, str) and PRINCIPAL_INIT.fullmatch(init) is not None


def principal_factors(weight: Tensor, init: str, r: int, scale: float) -> tuple[Tensor, Tensor]:
    """``(A0, B0)`` in FP32 (r×in, out×r) for ``weight`` (out×in) as the module docstring defines them."""
    w = weight.float()
    if init == "olora":
        q, rr = torch.linalg.qr(w)
        return rr[:r].contiguous(), q[:, :r].contiguous()
    if init == "pissa":
        u, s, vh = torch.linalg.svd(w, full_matrices=False)
        u, s, vh = u[:, :r], s[:r], vh[:r]
    else:
        u, s, v = torch.svd_lowrank(w, q=r, niter=int(init.rsplit("_", 1)[1]))
        vh = v.T
    root = (s / scale).sqrt()
    return (root[:, None] * vh).contiguous(), (u * root[None, :]).contiguous()


def residual(weight: Tensor, a0: Tensor, b0: Tensor, scale: float) -> Tensor:
    """``weight − scale·b0·a0`` computed in FP32 and rounded once to ``weight``'s dtype."""
    return (weight.float() - scale * (b0.float() @ a0.float())).to(weight.dtype)


def check_principal(name: str, base: nn.Module, init: bool | str, r: int) -> None:
    """Fails before injection changes anything if module ``name`` cannot start from its principal components.

    Raises:
        InjectionError: the base weight is not a dense FP32/FP16/BF16 tensor (loaded quantized: it cannot be
            rewritten as the residual), or ``r`` exceeds its smaller dimension.
    """
    if not is_principal(init):
        return
    weight = getattr(base, "weight", None)
    dense = type(weight) in (nn.Parameter, Tensor) and weight.dtype in (
        torch.float32,
        torch.float16,
        torch.bfloat16,
    )
    if not dense:
        kind = type(weight).__name__ if type(weight) not in (nn.Parameter, Tensor) else str(weight.dtype)
        raise InjectionError(
            f"lora.init_lora_weights={init!r}: '{name}' has a base loaded quantized ({kind}), which cannot be "
            "rewritten as the residual W - s·B0·A0; load the base in bf16/fp16/fp32 (add lora.quantize_base: true to "
            "pack the residual), or use init_lora_weights: true"
        )
    if r > min(weight.shape):
        raise InjectionError(
            f"lora.init_lora_weights={init!r}: r={r} exceeds the smaller dimension of '{name}' "
            f"({tuple(weight.shape)}), which has only {min(weight.shape)} principal components; lower lora.r"
        )


@contextmanager
def initial_factors_to_come() -> Iterator[None]:
    """Inside the block, LoRA modules with a PiSSA/OLoRA init keep their base as it is (dense, not packed) and
    wait for :func:`start_from` with saved initial factors, instead of decomposing the weight."""
    token = _TO_COME.set(True)
    try:
        yield
    finally:
        _TO_COME.reset(token)


def start_from_principal(module: LoRALinear) -> None:
    """Decomposes ``module``'s dense base weight and starts the module from it (see :func:`start_from`); does
    nothing inside :func:`initial_factors_to_come`.

    Raises:
        InjectionError: the module already starts from initial factors (its base is a residual already).
    """
    if _TO_COME.get():
        return
    if getattr(module, INIT_A, None) is not None:
        raise InjectionError(
            "this LoRA module's base is already the PiSSA/OLoRA residual; decomposing it again would remove the "
            "principal part twice: inject into the original base instead"
        )
    a0, b0 = principal_factors(
        _working_weight(module), module.config.init_lora_weights, module.r, module.scale
    )
    start_from(module, a0, b0)


def _working_weight(module: LoRALinear) -> Tensor:
    """``module``'s dense base weight on the device it will be packed on (``quantization_device``), else where
    it lives: decomposed and turned into the residual there."""
    config = module.config
    if config.quantize_base and config.quantization_device is not None:
        return module.weight.to(config.quantization_device)
    return module.weight


@torch.no_grad()
def start_from(module: LoRALinear, a0: Tensor, b0: Tensor) -> None:
    """Sets ``module``'s factors and initial-factor buffers to ``a0`` / ``b0`` (rounded to the LoRA dtype) and
    replaces its dense base weight by the residual: in place, or packed when the config quantizes the base."""
    dtype = module.lora_A.weight.dtype
    a0, b0 = a0.to(dtype=dtype), b0.to(dtype=dtype)
    weight = _working_weight(module)
    res = residual(weight, a0.to(weight.device), b0.to(weight.device), module.scale)
    if module.config.quantize_base:
        module.weight = quantize_weight(res, module.config)
    else:
        module.weight.copy_(res)
    device = module.weight.device
    module.lora_A.to(device).weight.copy_(a0)
    module.lora_B.to(device).weight.copy_(b0)
    module.register_buffer(INIT_A, a0.to(device).clone(), persistent=False)
    module.register_buffer(INIT_B, b0.to(device).clone(), persistent=False)


def initial_factors(module: nn.Module) -> tuple[Tensor, Tensor] | None:
    """``(A0, B0)`` a PiSSA/OLoRA module started from, or ``None`` for another init."""
    a0 = getattr(module, INIT_A, None)
    return None if a0 is None else (a0, getattr(module, INIT_B))
