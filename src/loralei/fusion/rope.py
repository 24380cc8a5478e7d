"""The attention's rotary embedding runs loralei's RoPE kernel (``loralei.kernels.rope``).

Transformers' attention classes call their modeling module's ``apply_rotary_pos_emb`` by name, so the function
is replaced in that module: for the process, in every model of the family, as Liger does. The replacement
calls the original function whenever the kernel cannot run on its arguments (the CPU outside the Triton
interpreter, bf16 in the interpreter, partial rotary dimensions, other layouts or extra arguments), and it
computes the same values where it runs, so other models of the family lose nothing.

A family's function is replaced only when it gives the same bits as the half-split formula
(``rope_reference``) on a random probe; one that matches nothing (interleaved pairs, another formula, or a
function another library installed) is kept and reported.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Iterator
from types import ModuleType

import torch
from torch import nn

from ..kernels.rope import apply_rope, rope_reference, usable
from .forwards import is_partial_of

NAME = "apply_rotary_pos_emb"


def fused_apply_rotary_pos_emb(original: Callable, q, k, cos, sin, *args, **kwargs):
    """loralei's kernel for ``original(q, k, cos, sin)``; ``original`` itself for anything else."""
    if args or kwargs or not usable(q, k, cos, sin):
        return original(q, k, cos, sin, *args, **kwargs)
    return apply_rope(q, k, cos, sin)


def is_installed(fn: object) -> bool:
    return is_partial_of(fn, fused_apply_rotary_pos_emb)


def matches(fn: Callable) -> bool:
    """Whether ``fn(q, k, cos, sin)`` gives exactly the half-split formula on a random probe."""
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 3, 5, 8, generator=gen), torch.randn(2, 1, 5, 8, generator=gen)
    cos, sin = torch.randn(2, 5, 8, generator=gen), torch.randn(2, 5, 8, generator=gen)
    try:
        got = fn(q, k, cos, sin)
    except Exception:  # another signature, or a kernel that cannot run here: not one to replace
        return False
    want = rope_reference(q, k, cos, sin)
    return isinstance(got, tuple) and len(got) == 2 and all(map(torch.equal, got, want))


def _modeling_modules(model: nn.Module) -> Iterator[ModuleType]:
    """The distinct Python modules of ``model``'s classes that define an ``apply_rotary_pos_emb``."""
    seen = set()
    for module in model.modules():
        name = type(module).__module__
        if name not in seen and callable(getattr(sys.modules.get(name), NAME, None)):
            seen.add(name)
            yield sys.modules[name]


def install(model: nn.Module) -> tuple[list[str], list[str]]:
    """Replaces the RoPE function of each of ``model``'s modeling modules that matches the formula.

    Returns:
        The modules whose function runs the kernel (now or before this call), and those whose function is kept.
    """
    fused, kept = [], []
    for module in _modeling_modules(model):
        fn = getattr(module, NAME)
        if is_installed(fn):
            fused.append(module.__name__)
        elif matches(fn):
            setattr(module, NAME, functools.partial(fused_apply_rotary_pos_emb, fn))
            fused.append(module.__name__)
        else:
            kept.append(module.__name__)
    return fused, kept
