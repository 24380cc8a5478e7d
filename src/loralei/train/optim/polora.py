"""PoLoRA: Riemannian-preconditioned LoRA (Zhang & Pilanci, ICML 2024, "scaled GD" / "scaled AdamW").

For a pair (A: r×in, B: out×r) whose module computes ``W0 + s·B·A`` (``s`` the LoRA scale), each factor's
gradient is preconditioned by the other factor's r×r Gram matrix::

    Ĝ_A = (c·BᵀB + δI)⁻¹ · ∇A        Ĝ_B = ∇B · (c·AAᵀ + δI)⁻¹        c = s² if scale_invariant else 1

and the preconditioned gradients then drive an ordinary update:

- ``mode="adamw"`` (the paper's scaled AdamW, its choice for language models): AdamW moments, bias
  corrections and decoupled weight decay exactly as ``torch.optim.AdamW``, fed with Ĝ instead of ∇.
- ``mode="sgd"`` (the paper's scaled GD, plus optional heavy-ball momentum as ``torch.optim.SGD`` does it):
  ``buf = momentum·buf + Ĝ``, ``p ← p·(1 − lr·wd) − lr·buf``.

Why: with ``G = ∂f/∂W``, ``∇A = s·BᵀG`` and ``∇B = s·G·Aᵀ``, so a scaled-GD step changes the product by
``ΔW = s(ΔB·A + B·ΔA) = −lr·(s²/c)·(P_B·G + G·P_A) + O(lr²)`` (δ → 0), where ``P_B`` projects onto B's column
space and ``P_A`` onto A's row space. Those spaces do not change when the product is split differently
(A → M·A, B → B·M⁻¹ for any invertible r×r M), so neither does ΔW; with ``c = s²`` it does not depend on ``s``
either. δ > 0 is needed because B starts at zero; it perturbs the invariance by O(δ / σ_min²).
LoRA+ (``b_lr_ratio`` λ): B's preconditioned step is taken at λ·lr, so ``ΔW = −lr·(s²/c)·(P_B·G + λ·G·P_A)``:
the row-space part of the update weighted λ times the column-space part; the projections, and so the
invariance, are unchanged.
Adam's element-wise normalisation is not equivariant under M, so in ``adamw`` mode only the preconditioned
gradient itself transforms covariantly (Ĝ_A → M·Ĝ_A); the exact invariance of ΔW holds in ``sgd`` mode.

Both preconditioners are built from the factors as they were before the step (a simultaneous update, which
the analysis above assumes). Pairs of one shape are preconditioned together by batched matmuls, and Gram
inverses are taken in float64 by one batched Cholesky factorisation per rank without error checks, so a
step never waits for the device; δ > 0 keeps the Gram matrices positive definite. The AdamW mode runs torch's
fused AdamW kernel on the preconditioned gradients.
Parameters given as ``params`` (not in a pair) get the same update without preconditioning.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from .adamw_math import FusedAdamWBase, adamw_step
from .options import OptionError, check_adam_hyper, check_bool, check_choice, check_number
from .precondition import Pair, preconditioned_grads

MODES = ("adamw", "sgd")


class PoLoRA(FusedAdamWBase):
    """Optimizer for paired LoRA factors that preconditions each factor by the other's Gram matrix.

    Args:
        params: ``(A, B)`` pairs (A: r×in, B: out×r), or parameter groups: dicts with either ``"pairs"``
            (a list of such pairs) or ``"params"`` (tensors updated without preconditioning), plus any option
            below to override it for that group (e.g. a group per LoRA ``scale``).
        lr: learning rate.
        betas: moment decay rates (``adamw`` mode).
        eps: added to the second-moment root (``adamw`` mode).
        weight_decay: decoupled weight decay.
        delta: damping δ added to the Gram matrices, > 0.
        scale_invariant: fold the LoRA scale into the Gram matrices so that the product's update does not
            depend on ``scale`` (exactly so in ``sgd`` mode).
        scale: the LoRA scale ``s`` of the pairs (``lora_alpha / r``, or ``/ sqrt(r)`` with rsLoRA).
        mode: ``"adamw"`` or ``"sgd"``.
        momentum: heavy-ball momentum in ``sgd`` mode, in [0, 1).
        b_lr_ratio: LoRA+: the B factors of the pairs step at this multiple of ``lr`` (> 0; 1: one rate).

    Raises:
        OptionError: an option is out of range, or a pair's shapes do not fit ``s·B·A``.
    """

    def __init__(
        self,
        params: Iterable[Pair] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        delta: float = 1e-6,
        scale_invariant: bool = False,
        scale: float = 1.0,
        mode: str = "adamw",
        momentum: float = 0.0,
        b_lr_ratio: float = 1.0,
    ) -> None:
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay, "delta": delta}
        defaults |= {"scale_invariant": scale_invariant, "scale": scale, "mode": mode, "momentum": momentum}
        defaults |= {"b_lr_ratio": b_lr_ratio}
        items = list(params)
        groups = items if all(isinstance(item, dict) for item in items) else [{"pairs": items}]
        super().__init__(groups, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Adds a group of ``"pairs"`` or of plain ``"params"``; checks its options and pair shapes.

        Raises:
            OptionError: a group has both or neither of ``pairs`` / ``params``, a bad pair, or a bad option.
        """
        group = dict(param_group)
        if ("pairs" in group) == ("params" in group):
            raise OptionError("params", sorted(group), 'each group needs exactly one of "pairs" or "params"')
        group["paired"] = "pairs" in group
        if group["paired"]:
            group["params"] = [factor for pair in _checked_pairs(group.pop("pairs")) for factor in pair]
        super().add_param_group(group)
        added = self.param_groups[-1]
        added.update(check_adam_hyper(added["lr"], added["betas"], added["eps"], added["weight_decay"]))
        added.update(_check_polora_options(added))

    @torch.no_grad()
    def step(self, closure: Callable[[], Tensor] | None = None) -> Tensor | None:
        """Performs one preconditioned step on every group.

        Args:
            closure: re-evaluates the model and returns the loss.

        Returns:
            The closure's loss, or ``None`` without a closure.
        """
        loss = self._closure_loss(closure)
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            directions = preconditioned_grads(group) if group["paired"] else {p: p.grad for p in params}
            for part, part_group in _by_learning_rate(group, params):
                _UPDATES[group["mode"]](self.state, part_group, part, [directions[p] for p in part])
        return loss


def _by_learning_rate(
    group: dict[str, Any], params: list[Tensor]
) -> list[tuple[list[Tensor], dict[str, Any]]]:
    """``params`` of ``group`` split by learning rate: with LoRA+ the pairs' B factors (every second parameter
    of a paired group) step at ``b_lr_ratio`` times ``lr`` (a tensor ``lr`` stays a tensor)."""
    ratio = group["b_lr_ratio"]
    if not group["paired"] or ratio == 1.0:
        return [(params, group)]
    b_ids = {id(p) for p in group["params"][1::2]}
    a = [p for p in params if id(p) not in b_ids]
    b = [p for p in params if id(p) in b_ids]
    parts = [(a, group), (b, {**group, "lr": group["lr"] * ratio})]
    return [(part, g) for part, g in parts if part]


def _sgd_update(state: dict, group: dict[str, Any], params: list[Tensor], directions: list[Tensor]) -> None:
    if group["momentum"] > 0:
        for p in params:
            if "momentum_buffer" not in state[p]:
                state[p]["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        buffers = [state[p]["momentum_buffer"] for p in params]
        torch._foreach_mul_(buffers, group["momentum"])
        torch._foreach_add_(buffers, directions)
        directions = buffers
    torch._foreach_mul_(params, 1.0 - group["lr"] * group["weight_decay"])
    torch._foreach_add_(params, directions, alpha=-group["lr"])


_UPDATES: dict[str, Callable[[dict, dict[str, Any], list[Tensor], list[Tensor]], None]] = {
    "adamw": adamw_step,
    "sgd": _sgd_update,
}


def _check_polora_options(group: dict[str, Any]) -> dict[str, Any]:
    return {
        "delta": check_number("delta", group["delta"], low=0.0, low_open=True),
        "scale_invariant": check_bool("scale_invariant", group["scale_invariant"]),
        "scale": check_number("scale", group["scale"], low=0.0, low_open=True),
        "mode": check_choice("mode", group["mode"], MODES),
        "momentum": check_number("momentum", group["momentum"], low=0.0, high=1.0, high_open=True),
        "b_lr_ratio": check_number("b_lr_ratio", group["b_lr_ratio"], low=0.0, low_open=True),
    }


def _checked_pairs(pairs: Iterable[Pair]) -> list[Pair]:
    """Checks that each pair is (A: r×in, B: out×r) with the same r."""
    checked = []
    for i, pair in enumerate(pairs):
        if not isinstance(pair, tuple | list) or len(pair) != 2:
            raise OptionError(f"pairs[{i}]", type(pair).__name__, "must be an (A, B) pair of tensors")
        a, b = pair
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            shapes = (tuple(a.shape), tuple(b.shape))
            raise OptionError(f"pairs[{i}]", shapes, "must be A (r×in) and B (out×r) with the same r")
        checked.append((a, b))
    if not checked:
        raise OptionError("pairs", [], "must hold at least one (A, B) pair")
    return checked
