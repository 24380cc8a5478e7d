"""DoRA on a ``LoRALinear``: the magnitude's first value, the cached base row norms, a forward's norms of
``W + s B A`` that its recomputation takes again (:func:`step_norms`), the path a forward takes, the scales the
fused gated MLP and shared-input groups take (:func:`fused_scale`; those paths run a DoRA projection without
active dropout inside them) and the rescaling of a merged weight (the math is in :mod:`loralei.ops.dora`).

The magnitude is the module's Parameter ``lora_magnitude_vector`` (out,), PEFT's name minus the adapter segment,
so a PEFT export is ``base_model.model.<path>.lora_magnitude_vector`` as PEFT itself writes it.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ..ops import recompute, reference
from ..ops.dora import DoRAScale, dora_w, dora_w_dropout, row_norms, squared_row_norms
from ..ops.dropout import draw_keep_mask, scaled_mask
from ..ops.weights import LoRAWeights

if TYPE_CHECKING:
    from .lora_linear import LoRALinear

CACHE = "_dora_base_norms"  # module attribute: (weak reference to the weight, its version, ‖W‖²_row)
# module attribute: (weak references to A and B, their versions, the last forward's ‖W + s B A‖_row)
STEP_CACHE = "_dora_step_norms"


def initial_magnitude(w: LoRAWeights, dtype: torch.dtype) -> Tensor:
    """``‖W + s B A‖_row`` (out,) in ``dtype``: PEFT's initial magnitude, so the first forward equals LoRA's."""
    return row_norms(w, squared_row_norms(w)).to(dtype)


def base_squared_norms(module: LoRALinear, w: LoRAWeights) -> Tensor:
    """``‖W‖²_row`` of the module's frozen base, computed once (from the dequantized weight for a quantized one)
    and kept until the weight changes: another tensor, an in-place write (merging), or a move (the module's
    ``_apply`` clears it)."""
    weight = module.weight
    cached = getattr(module, CACHE, None)
    if cached is not None and cached[0]() is weight and cached[1] == weight._version:
        return cached[2]
    norms = squared_row_norms(w)
    object.__setattr__(module, CACHE, (weakref.ref(weight), weight._version, norms))
    return norms


def clear_cache(module: LoRALinear) -> None:
    """Forgets the cached row norms, the base's and the last forward's (the module moved or changed)."""
    object.__setattr__(module, CACHE, None)
    object.__setattr__(module, STEP_CACHE, None)


def _factors_key(w: LoRAWeights) -> tuple:
    return (w.A._version, w.B._version)


def step_norms(module: LoRALinear, w: LoRAWeights) -> Tensor:
    """``‖W + s B A‖_row`` (out,) for this forward. A forward computes them (and keeps them on the module); a
    checkpoint's recomputation, which runs after its own forward and before any optimizer step, takes the
    forward's instead of computing them again, as long as the factors are the same tensors, unchanged since.

    A forward never takes kept norms: under CUDA graphs, a captured forward must record the launches that compute
    them, or its replays would read norms of factors the optimizer has changed since; a recomputation in the
    same capture reads the tensor that the forward's replayed launches fill."""
    kept = getattr(module, STEP_CACHE, None)
    if (
        recompute.in_recomputation()
        and kept is not None
        and kept[0]() is w.A
        and kept[1]() is w.B
        and kept[2] == _factors_key(w)
    ):
        return kept[3]
    norms = row_norms(w, base_squared_norms(module, w))
    object.__setattr__(module, STEP_CACHE, (weakref.ref(w.A), weakref.ref(w.B), _factors_key(w), norms))
    return norms


@torch.compiler.disable  # the norm cache is host state; DoRA projections run outside compiled graphs
def dora_forward(module: LoRALinear, x: Tensor) -> Tensor:
    """The module's DoRA output where no fused MLP or group computed it: the fused op (:func:`~loralei.ops.dora.dora_w`, with active dropout
    :func:`~loralei.ops.dora.dora_w_dropout`) where the module runs fused with a frozen base, otherwise the plain
    twin (PEFT's formula). Both draw the dropout mask alike, so they agree under the same RNG seed."""
    w = module.lora_weights()
    magnitude = module.lora_magnitude_vector
    fused = module.fused and not module.base_trainable
    if fused and w.dropout_p == 0:
        return dora_w(x, w, magnitude, base_squared_norms(module, w), norm=step_norms(module, w))
    mask = scaled_mask(draw_keep_mask(x.shape, x.device, w.dropout_p), w.dropout_p, w.dtype)
    if fused:
        return dora_w_dropout(x, w, magnitude, base_squared_norms(module, w), mask)
    return reference.dora_linear(x, w, magnitude, dropout_mask=mask)


@torch.compiler.disable  # reads the norm cache (host state), as dora_forward
def fused_scale(module: LoRALinear, w: LoRAWeights) -> DoRAScale | None:
    """What the fused gated MLP and shared-input groups take for ``module`` (its ``lora_weights()`` ``w``): the
    magnitude and this step's row norms, or None without DoRA."""
    magnitude = module.lora_magnitude_vector
    if magnitude is None:
        return None
    return DoRAScale(magnitude, step_norms(module, w))


@torch.no_grad()
def rescale_merged_(merged: Tensor, magnitude: Tensor) -> Tensor:
    """``merged ← (m / ‖merged‖_row) ⊙ merged`` in place for ``merged = W + s B A`` in FP32: DoRA's merged
    weight, as PEFT merges it."""
    norms = torch.linalg.vector_norm(merged, dim=1)
    return merged.mul_((magnitude.to(merged.dtype) / norms).unsqueeze(1))
