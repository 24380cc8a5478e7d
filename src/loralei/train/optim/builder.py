"""build_optimizer: the optimizer named in the YAML config, over a model's trainable parameters."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from ...errors import ConfigError, did_you_mean
from ...inject import lora_modules
from .options import OptionError, check_adam_hyper, check_bool
from .polora import PoLoRA
from .skipstep import SkipStepAdamW


class _Common(NamedTuple):
    lr: float
    weight_decay: float
    betas: tuple[float, float]
    eps: float


def _trainable(model: nn.Module) -> list[Tensor]:
    """Trainable parameters, each once, in module order."""
    return list({id(p): p for p in model.parameters() if p.requires_grad}.values())


def _b_factors(model: nn.Module) -> set[int]:
    """The ids of the LoRA B factors (projections' and expert banks')."""
    return {id(p) for name, p in model.named_parameters() if ".lora_B." in f".{name}."}


def _groups(model: nn.Module, lr: float, b_lr_ratio: float | None) -> list[dict[str, Any]]:
    """The trainable parameters in one group, or with LoRA+ (``b_lr_ratio``) the B factors in a second group at
    ``b_lr_ratio`` times the learning rate."""
    return _groups_of(_trainable(model), _b_factors(model), lr, b_lr_ratio)


def _groups_of(
    params: list[Tensor], b: set[int], lr: float, b_lr_ratio: float | None
) -> list[dict[str, Any]]:
    """``params`` in one group, or with LoRA+ those whose id is in ``b`` in a second group at ``b_lr_ratio``
    times ``lr``; empty groups are left out."""
    if b_lr_ratio is None:
        return [{"params": params}] if params else []
    groups = [
        {"params": [p for p in params if id(p) not in b]},
        {"params": [p for p in params if id(p) in b], "lr": lr * b_lr_ratio},
    ]
    return [g for g in groups if g["params"]]


def _adamw(
    model: nn.Module, common: _Common, ratio: float | None, kwargs: dict[str, Any]
) -> torch.optim.Optimizer:
    params = _trainable(model)
    check_adam_hyper(common.lr, common.betas, common.eps, common.weight_decay)
    if "amsgrad" in kwargs:
        check_bool("amsgrad", kwargs["amsgrad"])
    # The fused kernel needs every parameter on CUDA; elsewhere the multi-tensor path is the fast one.
    fast = {"fused": True} if all(p.is_cuda for p in params) else {"foreach": True}
    return torch.optim.AdamW(_groups(model, common.lr, ratio), **common._asdict(), **fast, **kwargs)


def _skipstepadamw(
    model: nn.Module, common: _Common, ratio: float | None, kwargs: dict[str, Any]
) -> torch.optim.Optimizer:
    return SkipStepAdamW(_groups(model, common.lr, ratio), **common._asdict(), **kwargs)


def _polora(
    model: nn.Module, common: _Common, ratio: float | None, kwargs: dict[str, Any]
) -> torch.optim.Optimizer:
    """PoLoRA with one pair group per LoRA scale and the other trainable parameters in a plain group; with LoRA+
    (``ratio``) each pair's B steps at ``ratio`` times the learning rate, and the other B factors (expert banks')
    in a group of their own at that rate."""
    by_scale: dict[float, list[tuple[Tensor, Tensor]]] = {}
    paired: set[int] = set()
    for _, module in lora_modules(model):
        a, b = module.lora_A.weight, module.lora_B.weight
        if a.requires_grad and b.requires_grad:
            by_scale.setdefault(module.scale, []).append((a, b))
            paired.update((id(a), id(b)))
    if not by_scale:
        raise ConfigError(
            'optimizer.name: "polora" preconditions LoRA factor pairs, but the model has no trainable LoRA '
            'modules; inject LoRA first or use "adamw"'
        )
    b_lr = {} if ratio is None else {"b_lr_ratio": ratio}
    groups: list[dict[str, Any]] = [
        {"pairs": pairs, "scale": scale, **b_lr} for scale, pairs in by_scale.items()
    ]
    others = [p for p in _trainable(model) if id(p) not in paired]
    for group in _groups_of(others, _b_factors(model), common.lr, ratio):
        groups.append(group)
    return PoLoRA(groups, **common._asdict(), **kwargs)


class _Entry(NamedTuple):
    build: Callable[[nn.Module, _Common, float | None, dict[str, Any]], torch.optim.Optimizer]
    kwargs: tuple[str, ...]  # the options ``optimizer.kwargs`` may set


_REGISTRY: dict[str, _Entry] = {
    "adamw": _Entry(_adamw, ("amsgrad",)),
    "skipstepadamw": _Entry(_skipstepadamw, ("sigma", "window", "warmup")),
    "polora": _Entry(_polora, ("delta", "scale_invariant", "mode", "momentum")),
}
OPTIMIZERS: tuple[str, ...] = tuple(_REGISTRY)


def build_optimizer(
    model: nn.Module,
    name: str,
    *,
    lr: float,
    weight_decay: float = 0.0,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    loraplus_lr_ratio: float | None = None,
    kwargs: dict[str, Any] | None = None,
) -> torch.optim.Optimizer:
    """Builds optimizer ``name`` over the trainable parameters of ``model``.

    Args:
        model: the model (for ``polora``, with LoRA injected: pairs come from ``loralei.lora_modules``).
        name: one of ``OPTIMIZERS``.
        lr: learning rate.
        weight_decay: decoupled weight decay.
        betas: Adam moment decay rates.
        eps: Adam epsilon.
        loraplus_lr_ratio: LoRA+: the LoRA B factors learn at this multiple of ``lr`` (a second parameter
            group; ``polora``: each pair's B steps at that multiple after preconditioning); ``None``: one
            learning rate.
        kwargs: optimizer-specific options (``adamw``: amsgrad; ``skipstepadamw``: sigma, window, warmup;
            ``polora``: delta, scale_invariant, mode, momentum).

    Returns:
        The optimizer. ``adamw`` is ``torch.optim.AdamW``, fused when every parameter is on CUDA.

    Raises:
        ConfigError: unknown name or option, an invalid value, or no trainable parameters; the message names
            the setting (``optimizer.name``, ``optimizer.lr``, ``optimizer.kwargs.<option>``).
    """
    if name not in _REGISTRY:
        raise ConfigError(
            f"optimizer.name: unknown optimizer {name!r}{did_you_mean(str(name), OPTIMIZERS)}; "
            f"choose one of {', '.join(OPTIMIZERS)}"
        )
    entry, kwargs = _REGISTRY[name], dict(kwargs or {})
    unknown = [
        f"optimizer.kwargs.{key}: unknown option for {name!r}{did_you_mean(str(key), entry.kwargs)}; "
        f"it accepts {', '.join(entry.kwargs)}"
        for key in kwargs
        if key not in entry.kwargs
    ]
    if unknown:
        raise ConfigError("\n".join(unknown))
    if not _trainable(model):
        raise ConfigError(f"optimizer: the model has no trainable parameters for {name!r}; inject LoRA first")
    try:
        return entry.build(model, _Common(lr, weight_decay, betas, eps), loraplus_lr_ratio, kwargs)
    except OptionError as err:
        where = f"optimizer.kwargs.{err.field}" if err.field in kwargs else f"optimizer.{err.field}"
        raise ConfigError(f"{where}: {err.need} (got {err.value!r})") from None
