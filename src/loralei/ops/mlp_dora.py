"""DoRA members of the fused gated MLP (:mod:`loralei.ops.lora_mlp` has the math): their column factors ``g``, the
MLP kernels' per-column rows, the torch path's scaled sums and gradients, the magnitudes' gradients from column
dots, and the refusals."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..errors import LoraleiError
from .dora import DoRAScale
from .weights import LoRAWeights


def factors(norms: Sequence[torch.Tensor | None], magnitudes: Sequence) -> list[torch.Tensor | None]:
    """``g = m / ‖W + s B A‖`` of gate, up and down (None for a plain LoRA member)."""
    return [None if m is None else DoRAScale(m, n).factor() for m, n in zip(magnitudes, norms, strict=True)]


def kernel_columns(pair: Sequence[LoRAWeights], gs: Sequence[torch.Tensor | None]) -> torch.Tensor | None:
    """The MLP kernels' (4, I) fp32 ``f_g, b_g, f_u, b_u`` when gate or up has DoRA, else None. A DoRA member's
    ``Z`` is kept without its bias, which the kernels add; a plain member's (ones, zeros) keeps it."""
    if gs[0] is None and gs[1] is None:
        return None
    rows = []
    for w, f in zip(pair, gs[:2], strict=True):
        ones = torch.ones(w.shape[0], device=w.A.device, dtype=torch.float32)
        rows.append(ones if f is None else f.float())
        rows.append(torch.zeros_like(ones) if f is None or w.bias is None else w.bias.float())
    return torch.stack(rows)


def scaled(z: torch.Tensor, f: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
    """A DoRA member's output ``f ⊙ Z + bias`` as a new tensor (``Z`` itself for a plain member, whose ``Z`` has
    its bias)."""
    if f is None:
        return z
    y = torch.mul(z, f, out=torch.empty_like(z))
    return y if bias is None else y.add_(bias)


def magnitude_grad(dots: torch.Tensor, norm: torch.Tensor, magnitude: torch.Tensor) -> torch.Tensor:
    """``dm = Σ_t dY ⊙ Z / ‖W + s B A‖`` from the column dots ``Σ_t dY ⊙ Z``, in the magnitude's dtype."""
    return (dots.to(norm.dtype) / norm).to(magnitude.dtype)


def unscaled_grad(
    d_out: torch.Tensor,
    z: torch.Tensor,
    f: torch.Tensor | None,
    norm: torch.Tensor | None,
    magnitude: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The torch path's ``(dZ, dm)`` of a gate/up member from its output's gradient ``d_out``: ``f ⊙ d_out``
    written over ``Z`` (not read again) and dm for a DoRA member; ``(d_out, None)`` for a plain one."""
    if f is None:
        return d_out, None
    dm = magnitude_grad(torch.sum(d_out * z, dim=0, dtype=f.dtype), norm, magnitude)
    return torch.mul(d_out, f, out=z), dm


def check(
    gate: LoRAWeights, up: LoRAWeights, down: LoRAWeights, scales: Sequence[DoRAScale | None], hand_over: bool
) -> None:
    """DoRA members of the fused MLP: no dropout (PEFT's rule needs the undropped base term), not down with
    ``hand_over`` (its output is scaled per column after the LoRA term).

    Raises:
        LoraleiError: either.
    """
    for name, w, sc in zip(("gate", "up", "down"), (gate, up, down), scales, strict=True):
        if sc is not None and w.dropout_p > 0:
            raise LoraleiError(
                f"lora_mlp {name}: DoRA with dropout_p={w.dropout_p} does not run in the fused MLP (PEFT applies "
                "DoRA's base term to the undropped input); run the projections on their own, or lora_dropout: 0.0"
            )
    if hand_over and scales[2] is not None:
        raise LoraleiError("lora_mlp: hand_over with DoRA on down; its output is scaled after the LoRA term")


def check_kept_down(
    kept_down: torch.Tensor,
    down: LoRAWeights,
    scales: Sequence[DoRAScale | None] | None,
    out_shape: Sequence[int],
) -> None:
    """A kept output of down (a recomputation's, :mod:`loralei.ops.kept_outputs`) only for a DoRA down, shaped like
    the op's output (``out_shape``, in down's dtype).

    Raises:
        LoraleiError: either.
    """
    if scales is None or scales[2] is None:
        raise LoraleiError(
            "lora_mlp: kept_down is the output of a DoRA down projection, but down has no DoRA"
        )
    if tuple(kept_down.shape) != tuple(out_shape) or kept_down.dtype != down.dtype:
        raise LoraleiError(
            f"lora_mlp: kept_down is {tuple(kept_down.shape)} {kept_down.dtype}, but this call's output is "
            f"{tuple(out_shape)} {down.dtype}"
        )
