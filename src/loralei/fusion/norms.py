"""RMSNorm modules run loralei's RMSNorm kernels (``loralei.kernels.rms_norm``) through an instance-attribute
``forward``, like the fused MLP; removing the attribute restores the class forward.

Which form a class computes is not looked up by its name: each known ``NormForm`` is run in torch beside the
class's own forward on a random input and a random weight, and a module is fused only when one form gives the
same bits. A class that matches none (another formula, or one already patched by another library) keeps its
forward and is reported with the reason. At call time the fused forward falls back to the class forward where
the kernels cannot run (a CPU tensor outside the Triton interpreter, bf16 in the interpreter, a row too wide).
"""

from __future__ import annotations

import torch
from torch import nn

from ..kernels.rms_norm import NormForm, rms_norm, rms_norm_reference, usable
from .forwards import is_partial_of, replace_forward, restore_forward

# Llama / Qwen / Mistral / Phi-3 (w · x̂ rounded first), Gemma ((1 + w) in fp32), OLMo 2 (w in fp32)
FORMS = (NormForm(0.0, True), NormForm(1.0, False), NormForm(0.0, False))
_EPS_NAMES = ("variance_epsilon", "eps")


def eps_of(module: nn.Module) -> float | None:
    """The norm's ε (its ``variance_epsilon`` or ``eps``), or None."""
    return next((v for n in _EPS_NAMES if isinstance(v := getattr(module, n, None), float)), None)


def is_rms_norm(module: nn.Module) -> bool:
    """Whether ``module`` looks like an RMSNorm: the class name says so, one 1-D weight, an epsilon, no children."""
    weight = getattr(module, "weight", None)
    return (
        "RMSNorm" in type(module).__name__
        and isinstance(weight, nn.Parameter)
        and weight.dim() == 1
        and eps_of(module) is not None
        and next(module.children(), None) is None
    )


def form_of(module: nn.Module) -> NormForm | None:
    """The form whose torch twin gives the class forward's exact output on a random probe, or None."""
    weight = module.weight
    if weight.is_meta:
        return None
    gen = torch.Generator(device=weight.device).manual_seed(0)
    n = weight.shape[0]
    x = torch.randn(4, n, generator=gen, device=weight.device).to(weight.dtype)
    w = (1 + torch.randn(n, generator=gen, device=weight.device) / 2).to(weight.dtype)
    with torch.no_grad():
        try:
            want = torch.func.functional_call(module, {"weight": w}, (x,))
        except Exception:  # a forward that needs more than the input: not an RMSNorm this module knows
            return None
        for form in FORMS:
            got = rms_norm_reference(x, w, eps_of(module), form)
            if got.dtype == want.dtype and torch.equal(got, want):
                return form
    return None


def fused_rms_norm_forward(module: nn.Module, form: NormForm, x: torch.Tensor) -> torch.Tensor:
    """The kernels' RMSNorm, or the class forward where they cannot run on ``x``."""
    if not usable(x, module.weight):
        return type(module).forward(module, x)
    return rms_norm(x, module.weight, eps_of(module), form)


def install(module: nn.Module, form: NormForm) -> None:
    """Makes ``module`` run :func:`fused_rms_norm_forward` in ``form`` (instance-attribute ``forward``)."""
    replace_forward(module, fused_rms_norm_forward, form)


def installed_form(module: nn.Module) -> NormForm | None:
    """The form :func:`install` gave ``module``, or None where its forward is not loralei's."""
    forward = vars(module).get("forward")
    return forward.args[1] if is_partial_of(forward, fused_rms_norm_forward) else None


def uninstall(module: nn.Module) -> None:
    """Restores the class forward of ``module`` if :func:`install` replaced it."""
    restore_forward(module, fused_rms_norm_forward)
