"""Fast by default: what the ``auto`` speed settings become on the run's device, and why.

``training.liger_kernel: auto`` (the default) applies Liger's RMSNorm and RoPE on CUDA when ``liger-kernel`` is
installed. ``training.loss: auto`` (the default) is loralei's ``linear_cross_entropy`` on CUDA (the head and the
loss in chunks, never the full logits), unless the model's head or config rules it out, and ``cross_entropy``
elsewhere. The fused LoRA kernels (``training.fused_lora``) are on by default everywhere. Explicit values are
kept as given. The lines saying what ``auto`` chose and why are the run's first lines.
"""

from __future__ import annotations

import importlib.util

import torch
from torch import nn

from .losses import head_refusal
from .schema import RunConfig


def _liger(requested: bool | str, loss: str, device: torch.device) -> tuple[bool, str | None]:
    """Whether Liger's kernels are applied, and the reason when ``auto`` chose."""
    if requested != "auto":
        return bool(requested), None
    if device.type != "cuda":
        return False, "off: no CUDA device"
    if loss == "cut_cross_entropy":
        return False, "off: training.loss cut_cross_entropy replaces Liger's loss"
    if importlib.util.find_spec("liger_kernel") is None:
        return False, "off: liger-kernel is not installed (pip install 'loralei[liger]')"
    return True, "on (RMSNorm, RoPE): CUDA and liger-kernel installed"


def _loss(model: nn.Module, device: torch.device) -> tuple[str, str]:
    """The loss ``auto`` chooses for ``model`` on ``device``, and why."""
    if device.type != "cuda":
        return "cross_entropy", f"{device.type}: the plain head and loss"
    if (refusal := head_refusal(model, "linear_cross_entropy")) is not None:
        return "cross_entropy", f"not linear_cross_entropy: {refusal.split('; use')[0]}"
    return "linear_cross_entropy", "CUDA: the head and the loss in chunks, never the full logits"


def _with(cfg: RunConfig, **training: object) -> RunConfig:
    return cfg.model_copy(update={"training": cfg.training.model_copy(update=training)})


def resolve_liger(cfg: RunConfig, device: torch.device) -> tuple[RunConfig, list[str]]:
    """``cfg`` with ``training.liger_kernel`` made concrete for ``device`` (before the model is built, which
    Liger patches), and the note saying what ``auto`` chose."""
    liger, why = _liger(cfg.training.liger_kernel, cfg.training.loss, device)
    return _with(cfg, liger_kernel=liger), [f"training.liger_kernel: auto -> {why}"] if why else []


def resolve_loss(cfg: RunConfig, model: nn.Module, device: torch.device) -> tuple[RunConfig, list[str]]:
    """``cfg`` with ``training.loss`` made concrete for ``model`` on ``device``, and the note saying what
    ``auto`` chose."""
    if cfg.training.loss != "auto":
        return cfg, []
    loss, why = _loss(model, device)
    return _with(cfg, loss=loss), [f"training.loss: auto -> {loss} ({why})"]
