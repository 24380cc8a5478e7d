"""Gated MLP fusion: the MLP module's ``forward`` (an instance attribute) calls the fused ``lora_mlp`` op.

The class's own forward is untouched; removing the instance attribute restores it. Whenever a projection cannot
run fused at call time (merged, disabled, unloaded, trainable base), the replacement calls the three projections'
own forwards and joins them with the gated-activation kernel (one pass over gate and up instead of the class
forward's activation and product): DPO's reference pass, with the adapters off, runs there.

Dropout: ``lora_mlp`` draws one bool keep-mask per projection, in the plain path's order (gate and up over x, then
down over the activation output), with the same draw as ``ops.dropout.draw_keep_mask``, so fused and plain runs
agree under the same RNG seed (the model-level tests check exactly this).

A pre-norm decoder layer whose residual adds run in the norm kernels (``fusion.residual``) calls
:func:`forward_with_residual` for ``h + mlp(x)``: the op hands over its base output and down's ``U'_d``, and the add
takes down's LoRA term (``ops.lowrank_sum``); not where down has DoRA (its output is scaled per column after the
term).

DoRA members run inside the op (their magnitudes and this step's row norms passed as ``scales``) unless a DoRA
projection has active dropout (PEFT's rule keeps those on their own op: ``LoRALinear.can_run_fused``). A DoRA
down's output is what a checkpoint keeps for the layer's recomputation where its keeper takes down
(:mod:`loralei.train.kept_dora`): its magnitude's gradient reads it, and it is not formed again there.
"""

from __future__ import annotations

import torch
from torch import nn

from ..kernels.activations import gated_act_forward
from ..modules.dora import fused_scale
from ..modules.lora_linear import LoRALinear
from ..ops import kept_outputs, lowrank_sum
from ..ops.lora_mlp import lora_mlp
from .forwards import hooked, is_partial_of, replace_forward, replaced_by, restore_forward
from .specs import FamilySpec


def _fusable_projections(mlp: nn.Module, spec: FamilySpec) -> list[LoRALinear] | None:
    """The gate, up and down projections when all three can run fused now, else None."""
    projections = [getattr(mlp, name) for name in (spec.gate, spec.up, spec.down)]
    if not all(isinstance(p, LoRALinear) and p.can_run_fused() for p in projections):
        return None
    return projections


def fused_mlp_forward(mlp: nn.Module, spec: FamilySpec, activation: str, x: torch.Tensor) -> torch.Tensor:
    """``down(act(gate(x)) * up(x))`` through ``lora_mlp``, or through the projections' own forwards when it cannot
    run fused."""
    projections = _fusable_projections(mlp, spec)
    if projections is None:
        gate, up, down = (getattr(mlp, name) for name in (spec.gate, spec.up, spec.down))
        return down(gated_act_forward(gate(x), up(x), activation))
    weights = [p.lora_weights() for p in projections]
    scales = _scales(projections, weights)
    if scales is None or scales[2] is None:
        return lora_mlp(x, *weights, activation, scales=scales)
    # a DoRA down: a checkpoint's recomputation may have the output the layer's forward kept (ops.kept_outputs)
    return kept_outputs.run(
        projections[2:],
        lambda: [lora_mlp(x, *weights, activation, scales=scales)],
        lambda kept: [lora_mlp(x, *weights, activation, scales=scales, kept_down=kept[0])],
    )[0]


def _scales(projections: list[LoRALinear], weights: list) -> tuple | None:
    """The DoRA members' scales (:func:`~loralei.modules.dora.fused_scale`), or None when none has DoRA."""
    if all(p.lora_magnitude_vector is None for p in projections):
        return None
    return tuple(fused_scale(p, w) for p, w in zip(projections, weights, strict=True))


def forward_with_residual(mlp: nn.Module, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """``residual + mlp(x)``; where ``mlp`` runs the fused op, has no hooks and the sum's kernel runs here, down's
    LoRA term joins the residual add (:mod:`loralei.ops.lowrank_sum`: one pass instead of the term's write, the
    base GEMM's read of it and the add)."""
    forward = vars(mlp).get("forward")
    if not is_partial_of(forward, fused_mlp_forward) or hooked(mlp):
        return residual + mlp(x)
    _, spec, activation = forward.args
    projections = _fusable_projections(mlp, spec)
    down = projections[2] if projections is not None else None
    flat = residual.reshape(-1, residual.shape[-1])
    if (
        down is None
        or down.lora_magnitude_vector is not None
        or not lowrank_sum.usable(flat.new_empty(0, down.r), down.lora_B.weight, flat)
    ):
        return residual + mlp(x)
    weights = [p.lora_weights() for p in projections]
    scales = _scales(projections, weights)  # DoRA on gate/up only: down (plain) still hands its term over
    base, u = lora_mlp(x, *weights, activation, hand_over=True, scales=scales)
    return lowrank_sum.lowrank_sum(u, down.lora_B.weight, base.view_as(flat), flat).view_as(residual)


def install(mlp: nn.Module, spec: FamilySpec, activation: str) -> None:
    """Makes ``mlp`` run the fused op (instance-attribute ``forward``; hooks on ``mlp`` itself still run)."""
    replace_forward(mlp, fused_mlp_forward, spec, activation)


def is_installed(mlp: nn.Module) -> bool:
    """Whether ``mlp.forward`` is the fused forward that :func:`install` set."""
    return replaced_by(mlp, fused_mlp_forward)


def uninstall(mlp: nn.Module) -> None:
    """Restores the class forward of ``mlp`` if :func:`install` replaced it."""
    restore_forward(mlp, fused_mlp_forward)
