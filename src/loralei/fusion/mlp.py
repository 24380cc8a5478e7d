"""Gated MLP fusion: the MLP module's ``forward`` (an instance attribute) calls the fused ``lora_mlp`` op.

The class's own forward is untouched; removing the instance attribute restores it. The replacement falls back
to the class forward whenever a projection cannot run fused at call time (merged, disabled, unloaded, trainable
base). Dropout masks are drawn here, in the plain path's order (gate, up, then down on the activation output),
with the plain path's mask function, so fused and plain runs agree under the same RNG seed.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable

import torch
from torch import nn

from ..modules.lora_linear import LoRALinear
from ..ops.dropout import draw_keep_mask, scaled_mask
from ..ops.weights import LoRAWeights
from .specs import FamilySpec


def _lora_mlp_op() -> Callable[..., torch.Tensor]:
    # Imported on use: ops.lora_mlp (Triton activation kernels) is optional at import time of loralei.
    from ..ops.lora_mlp import lora_mlp

    return lora_mlp


def op_available() -> bool:
    """Whether the fused MLP op (``loralei.ops.lora_mlp``) is installed."""
    return importlib.util.find_spec("loralei.ops.lora_mlp") is not None


def _masks(x: torch.Tensor, ws: list[LoRAWeights]) -> tuple[torch.Tensor | None, ...] | None:
    """Scaled dropout masks for gate, up (over x) and down (over the activation output), in the plain order."""
    if all(w.dropout_p == 0 for w in ws):
        return None
    down_in = (*x.shape[:-1], ws[2].W.shape[1])
    shapes = (x.shape, x.shape, down_in)
    dtype = ws[0].W.dtype
    return tuple(
        scaled_mask(draw_keep_mask(shape, x.device, w.dropout_p), w.dropout_p, dtype)
        for shape, w in zip(shapes, ws, strict=True)
    )


def fused_mlp_forward(mlp: nn.Module, spec: FamilySpec, activation: str, x: torch.Tensor) -> torch.Tensor:
    """``down(act(gate(x)) * up(x))`` through ``lora_mlp``, or the class forward when it cannot run fused."""
    projections = [getattr(mlp, name) for name in (spec.gate, spec.up, spec.down)]
    if not all(isinstance(p, LoRALinear) and p.can_run_fused() for p in projections):
        return type(mlp).forward(mlp, x)
    ws = [p.lora_weights() for p in projections]
    return _lora_mlp_op()(x, *ws, activation, masks=_masks(x, ws))


def install(mlp: nn.Module, spec: FamilySpec, activation: str) -> None:
    """Makes ``mlp`` run the fused op (instance-attribute ``forward``; hooks on ``mlp`` itself still run)."""
    mlp.forward = functools.partial(fused_mlp_forward, mlp, spec, activation)


def is_installed(mlp: nn.Module) -> bool:
    """Whether ``mlp.forward`` is the fused forward that :func:`install` set."""
    forward = vars(mlp).get("forward")
    return isinstance(forward, functools.partial) and forward.func is fused_mlp_forward


def uninstall(mlp: nn.Module) -> None:
    """Restores the class forward of ``mlp`` if :func:`install` replaced it."""
    if is_installed(mlp):
        del mlp.forward
