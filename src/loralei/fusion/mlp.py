"""Gated MLP fusion: the MLP module's ``forward`` (an instance attribute) calls the fused ``lora_mlp`` op.

The class's own forward is untouched; removing the instance attribute restores it. The replacement falls back
to the class forward whenever a projection cannot run fused at call time (merged, disabled, unloaded, trainable
base). Dropout: ``lora_mlp`` draws one bool keep-mask per projection, in the plain path's order (gate and up
over x, then down over the activation output), with the same draw as ``ops.dropout.draw_keep_mask``, so fused
and plain runs agree under the same RNG seed (the model-level tests check exactly this).
"""

from __future__ import annotations

import torch
from torch import nn

from ..modules.lora_linear import LoRALinear
from ..ops.lora_mlp import lora_mlp
from .forwards import replace_forward, replaced_by, restore_forward
from .specs import FamilySpec


def fused_mlp_forward(mlp: nn.Module, spec: FamilySpec, activation: str, x: torch.Tensor) -> torch.Tensor:
    """``down(act(gate(x)) * up(x))`` through ``lora_mlp``, or the class forward when it cannot run fused."""
    projections = [getattr(mlp, name) for name in (spec.gate, spec.up, spec.down)]
    if not all(isinstance(p, LoRALinear) and p.can_run_fused() for p in projections):
        return type(mlp).forward(mlp, x)
    return lora_mlp(x, *(p.lora_weights() for p in projections), activation)


def install(mlp: nn.Module, spec: FamilySpec, activation: str) -> None:
    """Makes ``mlp`` run the fused op (instance-attribute ``forward``; hooks on ``mlp`` itself still run)."""
    replace_forward(mlp, fused_mlp_forward, spec, activation)


def is_installed(mlp: nn.Module) -> bool:
    """Whether ``mlp.forward`` is the fused forward that :func:`install` set."""
    return replaced_by(mlp, fused_mlp_forward)


def uninstall(mlp: nn.Module) -> None:
    """Restores the class forward of ``mlp`` if :func:`install` replaced it."""
    restore_forward(mlp, fused_mlp_forward)
