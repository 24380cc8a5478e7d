"""A module's ``forward`` replaced by an instance attribute, ``functools.partial(fn, module, ...)``, and put back:
how the fused MLP and the fused RMSNorm take a module over without rewriting its class. And where Transformers
checkpoints a decoder layer, which a replaced forward must know (:data:`CHECKPOINTS_IN_FORWARD`)."""

from __future__ import annotations

import functools
from collections.abc import Callable

from torch import nn

from ..quiet import quiet_import_logs

# Transformers' modeling code imports TorchAO when it is installed; its load messages are not the user's concern.
with quiet_import_logs():
    from transformers.modeling_layers import GradientCheckpointingLayer

# Transformers checkpoints a GradientCheckpointingLayer around its ``__call__`` (5.17) or, in later 5.x releases,
# inside its class ``forward``, which it wraps: only then does a checkpoint land inside a compiled layer, and only
# then does an instance-attribute forward bypass it.
CHECKPOINTS_IN_FORWARD = "__call__" not in vars(GradientCheckpointingLayer)


def hooked(module: nn.Module) -> bool:
    """Whether ``module`` carries forward or backward hooks of its own (which a fused path calling around
    ``module.__call__`` would skip)."""
    return bool(
        module._forward_hooks
        or module._forward_pre_hooks
        or module._backward_hooks
        or module._backward_pre_hooks
    )


def is_partial_of(obj: object, fn: Callable) -> bool:
    """Whether ``obj`` is a ``functools.partial`` of ``fn``."""
    return isinstance(obj, functools.partial) and obj.func is fn


def replace_forward(module: nn.Module, fn: Callable, *args: object) -> None:
    """``module(x)`` calls ``fn(module, *args, x)`` (hooks on ``module`` itself still run)."""
    module.forward = functools.partial(fn, module, *args)


def replaced_by(module: nn.Module, fn: Callable) -> bool:
    """Whether :func:`replace_forward` gave ``module`` a forward of ``fn``."""
    return is_partial_of(vars(module).get("forward"), fn)


def restore_forward(module: nn.Module, fn: Callable) -> None:
    """The class forward of ``module`` again, if :func:`replace_forward` replaced it with one of ``fn``."""
    if replaced_by(module, fn):
        del module.forward
