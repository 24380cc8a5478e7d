"""The AdamW update shared by SkipStepAdamW and PoLoRA, written so that it never reads a value on the host.

The arithmetic follows ``torch.optim.AdamW`` (decoupled weight decay, bias-corrected moments) operation by
operation, so with the same inputs the results agree bit for bit on CPU. The difference is where the step
count lives: torch's default path reads it on the host to form the bias corrections, here the counts are
float64 tensors on the parameters' device and the corrections are computed there. Float64 keeps the same
rounding as torch's Python-float arithmetic.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

STEP_DTYPE = torch.float64


class AdamWHyper(NamedTuple):
    """The hyper-parameters of one parameter group."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float

    @classmethod
    def of(cls, group: dict[str, Any]) -> AdamWHyper:
        """Reads them from a torch optimizer parameter group."""
        beta1, beta2 = group["betas"]
        return cls(group["lr"], beta1, beta2, group["eps"], group["weight_decay"])


class AdamWState(NamedTuple):
    """Per-parameter lists of moments and step counts (float64 0-dim tensors on each parameter's device)."""

    exp_avgs: list[Tensor]
    exp_avg_sqs: list[Tensor]
    steps: list[Tensor]


def adamw_state(state: dict[Tensor, dict[str, Tensor]], params: list[Tensor]) -> AdamWState:
    """Gathers (creating on first use, as zeros) the AdamW state of ``params`` from an optimizer's state."""
    for p in params:
        slot = state[p]
        if not slot:
            slot["step"] = torch.zeros((), dtype=STEP_DTYPE, device=p.device)
            slot["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            slot["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return AdamWState(
        [state[p]["exp_avg"] for p in params],
        [state[p]["exp_avg_sq"] for p in params],
        [state[p]["step"] for p in params],
    )


def place_steps(optimizer: torch.optim.Optimizer) -> None:
    """Moves every ``step`` count to its parameter's device as float64.

    ``Optimizer.load_state_dict`` leaves step counts where the checkpoint had them (CPU after
    ``map_location="cpu"``); here they must sit with the parameters so that no step reads them on the host.
    """
    for group in optimizer.param_groups:
        for p in group["params"]:
            slot = optimizer.state.get(p)
            if slot and "step" in slot:
                slot["step"] = torch.as_tensor(slot["step"], dtype=STEP_DTYPE).to(p.device)


def _bias_terms(steps: list[Tensor], hp: AdamWHyper) -> tuple[list[Tensor], list[Tensor]]:
    """Per parameter: ``-lr / (1 - beta1**t)`` and ``sqrt(1 - beta2**t)``, as 0-dim tensors on its device."""
    neg_step_sizes: list[Tensor] = [steps[0]] * len(steps)
    bc2_sqrts: list[Tensor] = [steps[0]] * len(steps)
    by_device: dict[torch.device, list[int]] = {}
    for i, step in enumerate(steps):
        by_device.setdefault(step.device, []).append(i)
    for indices in by_device.values():
        t = torch.stack([steps[i] for i in indices])  # one small vector per device instead of per-tensor ops
        neg_sizes = (hp.lr / (1 - hp.beta1**t)).neg()
        bc2_sqrt = (1 - hp.beta2**t).sqrt()
        for j, i in enumerate(indices):
            neg_step_sizes[i] = neg_sizes[j]
            bc2_sqrts[i] = bc2_sqrt[j]
    return neg_step_sizes, bc2_sqrts


def adamw_candidates(
    params: list[Tensor], grads: list[Tensor], state: AdamWState, steps: list[Tensor], hp: AdamWHyper
) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
    """One AdamW step computed out of place: the new parameters, first and second moments.

    With ``m, v`` the moments, ``g`` the gradient and ``t`` the step count after this step::

        p' = p * (1 - lr * wd) - lr / (1 - beta1**t) * m' / (sqrt(v') / sqrt(1 - beta2**t) + eps)
        m' = m + (1 - beta1) * (g - m)          v' = beta2 * v + (1 - beta2) * g * g

    Args:
        params: parameters (not modified).
        grads: their gradients, same shapes and dtypes.
        state: their current moments (not modified).
        steps: the step counts to use for the bias corrections (float64 0-dim tensors).
        hp: the group's hyper-parameters.

    Returns:
        Lists of new parameter values, new first moments and new second moments.
    """
    new_params = torch._foreach_mul(params, 1.0 - hp.lr * hp.weight_decay)
    new_avgs = torch._foreach_lerp(state.exp_avgs, grads, 1.0 - hp.beta1)
    new_sqs = torch._foreach_mul(state.exp_avg_sqs, hp.beta2)
    torch._foreach_addcmul_(new_sqs, grads, grads, value=1.0 - hp.beta2)
    neg_step_sizes, bc2_sqrts = _bias_terms(steps, hp)
    denoms = torch._foreach_sqrt(new_sqs)
    torch._foreach_div_(denoms, bc2_sqrts)
    torch._foreach_add_(denoms, hp.eps)
    # addcdiv's multiplier must be a host number; pre-scaling the numerator by the (device) step size instead
    # rounds the same way, since torch's kernel also forms (value * m) / denom before adding it.
    numerators = torch._foreach_mul(new_avgs, neg_step_sizes)
    new_params = torch._foreach_addcdiv(new_params, numerators, denoms)
    return new_params, new_avgs, new_sqs
