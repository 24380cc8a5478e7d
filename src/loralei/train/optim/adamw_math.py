"""The AdamW update shared by SkipStepAdamW and PoLoRA: torch's fused AdamW kernel, skippable on the device.

``torch._fused_adamw_`` is the kernel behind ``torch.optim.AdamW(fused=True)`` (CPU, CUDA, MPS, XPU): one
launch updates every tensor of a device and dtype. Its ``found_inf`` argument, a 0-dim float tensor that
GradScaler uses for overflowed steps, makes the kernel return without writing anything when it holds 1; the
flag is read on the device, so a skipped step needs neither a host read nor a per-tensor select, and a NaN
gradient of a skipped step never reaches a parameter or a moment. Step counts are float32 0-dim tensors on
each parameter's device, as torch's fused AdamW keeps them, and advance only on steps that are kept. With
the same inputs the results equal ``torch.optim.AdamW(fused=True)``'s bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor

STEP_DTYPE = torch.float32  # what the fused kernel reads its step counts as


class AdamWState(NamedTuple):
    """Per-parameter lists of moments and step counts (float32 0-dim tensors on each parameter's device)."""

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


class FusedAdamWBase(torch.optim.Optimizer):
    """What SkipStepAdamW and PoLoRA share around ``adamw_step``: state placement on load and the closure."""

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads as torch does, then gives every parameter's state its own tensors on the parameter's device.

        ``Optimizer.load_state_dict`` keeps the given tensors where they already fit, so an optimizer loaded
        from another's live ``state_dict`` would share (and, updating in place, corrupt) its moments; and it
        leaves step counts where the checkpoint had them (CPU after ``map_location="cpu"``, float64 from older
        checkpoints). Each tensor is copied here, steps as float32 on the parameter's device.
        """
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            for p in group["params"]:
                slot = self.state.get(p, {})
                for key, value in slot.items():
                    if key == "step":
                        slot[key] = torch.as_tensor(value).to(device=p.device, dtype=STEP_DTYPE, copy=True)
                    elif isinstance(value, Tensor):
                        slot[key] = value.to(device=p.device, copy=True)

    @staticmethod
    def _closure_loss(closure: Callable[[], Tensor] | None) -> Tensor | None:
        """Runs ``step``'s closure with gradients on (``step`` itself runs under ``no_grad``); None without one."""
        if closure is None:
            return None
        with torch.enable_grad():
            return closure()


def adamw_step(
    state: dict[Tensor, dict[str, Tensor]],
    group: dict[str, Any],
    params: list[Tensor],
    grads: list[Tensor],
    skip: Tensor | None = None,
) -> None:
    """One AdamW step of ``params`` driven by ``grads``, in place, unless ``skip`` holds true.

    Args:
        state: the optimizer's per-parameter state (moments and step counts are created on first use).
        group: the parameter group, for ``lr``, ``betas``, ``eps`` and ``weight_decay``.
        params: the parameters to update.
        grads: what drives the update, one per parameter, same shape, dtype and device.
        skip: a 0-dim bool tensor; when it is true nothing changes (step counts included). Never read on the
            host.
    """
    beta1, beta2 = group["betas"]
    buckets: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, p in enumerate(params):
        buckets.setdefault((p.device, p.dtype), []).append(i)
    for (device, _), indices in buckets.items():
        ps, gs = [params[i] for i in indices], [grads[i] for i in indices]
        slots = adamw_state(state, ps)
        found_inf = None if skip is None else skip.to(device=device, dtype=torch.float32)
        if found_inf is None:
            torch._foreach_add_(slots.steps, 1.0)
        else:
            # A list of the one flag rather than the flag itself: the latter reads it on the host on CPU.
            keep = 1.0 - found_inf
            torch._foreach_add_(slots.steps, [keep] * len(slots.steps))
        torch._fused_adamw_(
            ps,
            gs,
            slots.exp_avgs,
            slots.exp_avg_sqs,
            [],
            slots.steps,
            lr=group["lr"],
            beta1=beta1,
            beta2=beta2,
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            amsgrad=False,
            maximize=False,
            grad_scale=None,
            found_inf=found_inf,
        )
