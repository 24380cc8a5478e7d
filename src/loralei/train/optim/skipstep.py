"""SkipStepAdamW: AdamW that leaves everything untouched on a step whose loss or gradient norm is a spike."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from . import outliers
from .adamw_math import FusedAdamWBase, adamw_step
from .options import OptionError, check_adam_hyper, check_int, check_number

# The skip detector's key in ``state_dict()`` and in ``extra_state()``. It is not parameter state, so it stays out of
# ``self.state``: torch.distributed.checkpoint maps every key there to a parameter's name.
_SKIP_KEY = "skip_detector"
_METRICS = ("loss", "grad_norm")


class SkipStepAdamW(FusedAdamWBase):
    """AdamW that skips the update when the loss or the global gradient norm is an outlier.

    Each metric keeps a rolling window of its last ``window`` accepted values. A step is skipped when either
    metric is not finite, or, once its window holds ``warmup`` values, lies more than ``sigma`` standard
    deviations above the window's mean. A skipped step changes nothing: parameters, moments and step counts
    keep their values (the fused AdamW kernel reads the verdict on the device and writes nothing, so a NaN
    gradient cannot leak in), and its loss and gradient norm stay out of the windows. The test and the choice
    run on the device: ``step`` never waits for it. When nothing is skipped, parameters and state equal
    ``torch.optim.AdamW(fused=True)``'s bit for bit (and the other torch AdamW variants' to rounding).

    Args:
        params: parameters or parameter groups, as for any torch optimizer.
        lr: learning rate.
        betas: decay rates of the first and second moments.
        eps: added to the second-moment root.
        weight_decay: decoupled weight decay (default as ``torch.optim.AdamW``'s).
        sigma: spike threshold in standard deviations.
        window: how many accepted values each rolling window keeps.
        warmup: how many accepted values a window needs before it may call a spike (non-finite values are
            skipped from the first step).

    Raises:
        OptionError: an option is out of range.
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        sigma: float = 6.0,
        window: int = 128,
        warmup: int = 16,
    ) -> None:
        defaults = check_adam_hyper(lr, betas, eps, weight_decay)
        self.sigma = check_number("sigma", sigma, low=0.0, low_open=True)
        self.window = check_int("window", window, low=2)
        self.warmup = check_int("warmup", warmup, low=2)
        if self.warmup > self.window:
            raise OptionError("warmup", warmup, f"must be <= window ({window}): the window holds the history")
        super().__init__(params, defaults)
        self._skip: dict[str, Any] | None = None  # the rolling windows and counters, made at the first step

    @property
    def skipped_steps(self) -> int:
        """How many steps were skipped so far (reads the device counter: call it when logging, not per step)."""
        return int(self._skip["skipped"].item()) if self._skip else 0

    @property
    def last_step_skipped(self) -> Tensor | None:
        """Whether the latest step was skipped, as a 0-dim bool tensor on the device (``None`` before any)."""
        return self._skip["last"] if self._skip else None

    def extra_state(self) -> dict[str, Any]:
        """The state that belongs to no parameter: the skip detector (empty before the first step). Checkpoints
        that keep parameter state by parameter name save it beside (``loralei.train.state``)."""
        return {_SKIP_KEY: self._skip} if self._skip else {}

    def load_extra_state(self, extra: dict[str, Any]) -> None:
        """Takes :meth:`extra_state`'s answer: a copy of the skip detector on the parameters' device (the windows
        are updated in place, so never the given tensors themselves)."""
        detector = extra.get(_SKIP_KEY)
        device = self.param_groups[0]["params"][0].device
        self._skip = _to_device(detector, device) if detector else None

    def state_dict(self) -> dict[str, Any]:
        """torch's optimizer state, plus the skip detector under its own key."""
        return {**super().state_dict(), **self.extra_state()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads as ``FusedAdamWBase`` does, and the skip detector (also from an older loralei's checkpoint, which
        kept it among the parameters' state)."""
        state_dict = dict(state_dict)
        detector = state_dict.pop(_SKIP_KEY, None)
        super().load_state_dict(state_dict)
        detector = self.state.pop(_SKIP_KEY, detector)
        self.load_extra_state({_SKIP_KEY: detector} if detector else {})

    def _detector(self, device: torch.device) -> dict[str, Any]:
        if self._skip is None:
            self._skip = {
                **{name: outliers.new_window(self.window, device) for name in _METRICS},
                "skipped": torch.zeros((), dtype=torch.long, device=device),
                "last": torch.zeros((), dtype=torch.bool, device=device),
            }
        return self._skip

    def _decide(self, observed: dict[str, Tensor], device: torch.device) -> Tensor:
        """Tests each observed metric, records the accepted ones, and returns the skip verdict."""
        detector = self._detector(device)
        skip = torch.zeros((), dtype=torch.bool, device=device)
        for name, value in observed.items():
            skip = skip | outliers.is_outlier(detector[name], value, sigma=self.sigma, warmup=self.warmup)
        for name, value in observed.items():
            outliers.push(detector[name], value, ~skip)
        detector["skipped"].add_(skip.long())
        detector["last"].copy_(skip)
        return skip

    @torch.no_grad()
    def step(
        self,
        closure: Callable[[], Tensor] | None = None,
        *,
        loss: Tensor | None = None,
        grad_norm: Tensor | None = None,
    ) -> Tensor | None:
        """Performs one AdamW step unless the loss or gradient norm is an outlier.

        Args:
            closure: re-evaluates the model and returns the loss; its loss is tested when ``loss`` is not given.
            loss: this step's loss (over the whole accumulation window); not tested when absent.
            grad_norm: the global gradient norm BEFORE clipping (what ``clip_grad_norm_`` returns). When absent
                it is computed from the gradients as they are now, which after clipping hides spikes.

        Returns:
            The closure's loss, or ``None`` without a closure.
        """
        closure_loss = self._closure_loss(closure)
        loss = closure_loss if loss is None else loss
        groups = [(g, [p for p in g["params"] if p.grad is not None]) for g in self.param_groups]
        grads = [p.grad for _, params in groups for p in params]
        if not grads:
            return closure_loss
        device = grads[0].device
        if grad_norm is None:
            grad_norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=None)
        observed = {"grad_norm": grad_norm} if loss is None else {"loss": loss, "grad_norm": grad_norm}
        skip = self._decide(observed, device)
        for group, params in groups:
            if params:
                adamw_step(self.state, group, params, [p.grad for p in params], skip)
        return closure_loss


def _to_device(tree: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """A copy of a nested dict of tensors with every tensor copied to ``device``."""
    return {
        k: _to_device(v, device) if isinstance(v, dict) else v.to(device, copy=True) for k, v in tree.items()
    }
