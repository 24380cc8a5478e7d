"""Pre-norm decoder layers add their residuals inside the RMSNorm kernels (``kernels.rms_norm.residual_rms_norm``).

A Llama-style layer computes ``h = x + attn(norm₁(x))`` and ``x' = h + mlp(norm₂(h))``. Its forward is replaced
(an instance attribute, like the fused MLP's) by the same composition in which ``norm₂`` forms ``h`` as it loads
``x`` and the attention's output, and the backward of each norm adds the gradient that reaches its input along the
residual path before storing ``dx``: two elementwise passes over the hidden states fewer in the forward and
backward of every layer, with the same bits as before.

Where the MLP runs loralei's fused op and the layer is not checkpointed, the last add takes the down projection's
LoRA term as well (:func:`.mlp.forward_with_residual`): the MLP hands over its base output ``Y₀`` and
``U'_d = s_d h A_dᵀ``, and one kernel writes ``h + Y₀ + U'_d B_dᵀ`` (fp32, rounded once), so the term is no longer
written in full and read back by the base GEMM. That sum rounds once where the MLP and the add rounded twice, so
such a layer's bits differ from the class forward's by that rounding; the adds in the norms keep theirs.
Checkpointed layers keep the term in the MLP (their recomputation skips the down projection, ``ops.recompute``).

Which classes compute this composition is not read from their names: the class forward is run beside the
composition with stand-ins for the four children (:data:`PRE_NORM`) on a random input, and a layer is a candidate
only when both give the same bits and the attention stand-in receives the same arguments from each (other layers,
Gemma 2's with four norms for one, are not pre-norm layers and go unreported, like MLPs that are not gated). Both
norms must run loralei's kernels (``fusion.norms``) and carry no hooks. At call time, a call that does not pass
the hidden states alone as its one positional argument, or norms that no longer run loralei's kernels, take the
class forward (where the kernels cannot run on the input, :func:`residual_rms_norm` adds and normalises in torch).

FP8 codes: where a projection that reads a norm's output (the attention's q/k/v, the MLP's gate/up: the family
spec's names) has an FP8 base whose GEMMs quantize their input per row, that norm's kernel also makes the codes of
its output and offers them to that product (``kernels.rms_norm``), which then does not read the output again;
the second norm's backward likewise makes the codes of its ``dx`` for the attention's output projection (not a DoRA
one: its input-gradient product reads ``g ⊙ dY``), and in a layer that is not checkpointed the first norm's those
of its ``dx`` for the down projection of the layer before (the next entry of the same list), whose output
gradient it is.
The projections are found once, when the layer is installed; their bases are asked at every call (a base may be
re-packed or moved between calls); the codes are the same bits either way.

Gradient checkpointing: Transformers checkpoints a layer either around its ``__call__`` (5.17) or inside its class
``forward`` (later 5.x releases wrap it); in the second case the replaced forward checkpoints itself the same way,
through the layer's ``_gradient_checkpointing_func``, except with a KV cache, which the class forward's wrapper
drops first (so it runs there).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, NamedTuple

import torch
from torch import nn

from ..kernels.rms_norm import residual_rms_norm
from ..modules.lora_linear import LoRALinear
from . import mlp as mlp_fusion
from . import norms
from .forwards import CHECKPOINTS_IN_FORWARD, hooked, replace_forward, replaced_by, restore_forward
from .specs import FamilySpec


class LayerNames(NamedTuple):
    """The children of a pre-norm decoder layer, by role."""

    first_norm: str
    attention: str
    second_norm: str
    mlp: str


# Llama, Qwen, Mistral
PRE_NORM = LayerNames("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")


class Readers(NamedTuple):
    """Projections around the norms, by path under the layer: those that read each norm's output, the one whose
    output is the second norm's branch (its output gradient is that norm's ``dx``) and the one whose output ends
    the layer (the MLP's down: its output gradient is the next layer's first norm's ``dx``)."""

    first: tuple[str, ...] = ()
    second: tuple[str, ...] = ()
    branch: str | None = None
    last: str | None = None


NO_READERS = Readers()


class _ReaderModules(NamedTuple):
    """:class:`Readers` resolved under one layer: its LoRA projections at those paths (other modules left out)."""

    first: tuple[LoRALinear, ...]
    second: tuple[LoRALinear, ...]
    branch: LoRALinear | None
    upstream: LoRALinear | None  # the layer before's ``last`` projection


class _Codes(NamedTuple):
    """Which FP8 codes the norms make (:func:`_codes`)."""

    first: bool  # of the first norm's output
    second: bool  # of the second norm's output
    branch_grad: torch.Tensor | None  # the branch projection's row scales, for the codes of the second's dx
    upstream_grad: torch.Tensor | None  # the layer before's down's row scales, for the first's dx


def norm_readers(spec: FamilySpec, names: LayerNames = PRE_NORM) -> Readers:
    """The attention's q/k/v (the first norm's readers), the MLP's gate/up (the second's), the attention's
    output projection (the second's branch) and the MLP's down (the layer's last), by the family spec's names;
    none where the family has none."""
    qkv = tuple(f"{names.attention}.{n}" for n in spec.qkv or ())
    gate_up = tuple(f"{names.mlp}.{n}" for n in (spec.gate, spec.up) if n)
    o = f"{names.attention}.{spec.o}" if spec.o else None
    return Readers(qkv, gate_up, o, f"{names.mlp}.{spec.down}" if spec.down else None)


def _lora_at(layer: nn.Module, path: str | None) -> LoRALinear | None:
    """The LoRA projection at ``path`` under ``layer``, or None (no such module, or not a LoRA projection)."""
    try:
        module = None if path is None else layer.get_submodule(path)
    except AttributeError:
        return None
    return module if isinstance(module, LoRALinear) else None


def _resolve(layer: nn.Module, readers: Readers, previous: nn.Module | None) -> _ReaderModules:
    """``readers``' LoRA projections under ``layer``, the upstream one under ``previous`` (the layer before)."""

    def found(paths: tuple[str, ...]) -> tuple[LoRALinear, ...]:
        return tuple(m for m in (_lora_at(layer, path) for path in paths) if m is not None)

    upstream = None if previous is None else _lora_at(previous, readers.last)
    return _ReaderModules(
        found(readers.first), found(readers.second), _lora_at(layer, readers.branch), upstream
    )


def _row_factors_of(module: LoRALinear | None, dora: bool = True) -> torch.Tensor | None:
    """The row factors of LoRA projection ``module`` where its FP8 GEMMs quantize per row (else ``None``; with
    ``dora=False`` also for a DoRA projection, whose input-gradient product reads ``g ⊙ dY``, not ``dY``)."""
    quant = None if module is None else module.quant
    if quant is None or (not dora and module.lora_magnitude_vector is not None):
        return None
    return quant.row_factors()


def _codes(readers: _ReaderModules, checkpointed: bool) -> _Codes:
    """The codes worth making now: a norm's output where one of its readers quantizes it per row, the second
    norm's ``dx`` where the branch projection (not a DoRA one) quantizes its output gradient per row, and the
    first's where the layer before's down does and this layer is not checkpointed (a checkpointed layer before
    runs its recomputation's norms, which offer their own codes, between this ``dx`` and that product)."""
    return _Codes(
        any(_row_factors_of(m) is not None for m in readers.first),
        any(_row_factors_of(m) is not None for m in readers.second),
        _row_factors_of(readers.branch, dora=False),
        None if checkpointed else _row_factors_of(readers.upstream, dora=False),
    )


# a KV cache's name across releases and families
_CACHE_ARGUMENTS = ("cache", "past_key_values", "layer_past")


def _children(layer: nn.Module, names: LayerNames) -> tuple[nn.Module, ...] | None:
    children = tuple(getattr(layer, n, None) for n in names)
    return children if all(isinstance(c, nn.Module) for c in children) else None


def is_pre_norm_layer(module: nn.Module, names: LayerNames = PRE_NORM) -> bool:
    """Whether ``module`` has the four children of a pre-norm decoder layer and its class forward composes them
    as one (:func:`matches`)."""
    return _children(module, names) is not None and matches(module, names)


def _attention_defaults(cls: type) -> dict[str, Any]:
    """The class forward's named parameters after the hidden states, with their defaults: what its own forward
    hands the attention when the caller leaves them out (Llama's passes each on by name)."""
    params = list(inspect.signature(cls.forward).parameters.values())[2:]
    return {p.name: p.default for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def _composed(layer: nn.Module, names: LayerNames, x: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor:
    """The pre-norm composition with the layer's children, in torch (the probe's candidate)."""
    first, attention, second, mlp = _children(layer, names)
    h = x + attention(hidden_states=first(x), **kwargs)[0]
    return h + mlp(second(h))


class _Affine(nn.Module):
    """A stand-in child: ``x · a + b``."""

    def __init__(self, a: float, b: float) -> None:
        super().__init__()
        self.a, self.b = a, b

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.a + self.b


class _AttentionStandIn(nn.Module):
    """Returns ``(2x + 1, None)`` and records the keyword arguments it received."""

    def __init__(self) -> None:
        super().__init__()
        self.received: list[dict[str, Any]] = []

    def forward(self, hidden_states: torch.Tensor, **kwargs: Any) -> tuple[torch.Tensor, None]:
        self.received.append(kwargs)
        return hidden_states * 2 + 1, None


def matches(layer: nn.Module, names: LayerNames = PRE_NORM) -> bool:
    """Whether the class forward of ``layer`` is the pre-norm composition (same bits, same attention arguments)."""
    stand_ins = [_Affine(0.5, 0.25), _AttentionStandIn(), _Affine(0.75, -0.125), _Affine(3.0, -1.0)]
    kept = {n: layer._modules[n] for n in names}
    sentinels = {name: object() for name in _attention_defaults(type(layer))} | {"loralei_probe": object()}
    x = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(0))
    modes = {m: m.training for m in layer.modules()}
    # in training mode, so that a dropout on the residual path (Phi-3's, when its p > 0) shows as a mismatch;
    # on a forked RNG, so that the probe draws nothing from the caller's
    with torch.random.fork_rng(devices=[]):
        try:
            layer._modules.update(zip(names, stand_ins, strict=True))
            layer.train()
            want = type(layer).forward(layer, x, **sentinels)
            got = _composed(layer, names, x, sentinels)
        except Exception:  # a forward that needs more than these arguments: not the composition
            return False
        finally:
            layer._modules.update(kept)
            for module, mode in modes.items():
                module.training = mode
    first, second = stand_ins[1].received
    return (
        isinstance(want, torch.Tensor)
        and torch.equal(want, got)
        and first.keys() == second.keys()
        and all(first[k] is second[k] for k in first)
    )


NormArgs = tuple[torch.Tensor, float, norms.NormForm]


def _norm_args(layer: nn.Module, names: LayerNames) -> tuple[NormArgs, NormArgs] | None:
    """Each norm's (weight, ε, form), or None when either does not run loralei's kernels (any more)."""
    pair = [getattr(layer, names.first_norm), getattr(layer, names.second_norm)]
    forms = [norms.installed_form(norm) for norm in pair]
    if None in forms:
        return None
    return tuple((norm.weight, norms.eps_of(norm), form) for norm, form in zip(pair, forms, strict=True))


def fused_layer_forward(
    layer: nn.Module,
    names: LayerNames,
    readers: _ReaderModules,
    defaults: dict[str, Any],
    *args: Any,
    **kwargs: Any,
) -> Any:
    """The pre-norm composition with the residual adds inside the norm kernels, or the class forward.

    ``readers``: each norm's readers (:func:`norm_readers`, resolved at :func:`install`). ``defaults``: the class forward's keyword arguments
    and their defaults (:func:`_attention_defaults`), which the attention gets wherever the caller leaves them
    out, as the class forward hands them on.
    """
    norm_args = _norm_args(layer, names)
    if len(args) != 1 or norm_args is None:
        return type(layer).forward(layer, *args, **kwargs)
    (x,) = args
    checkpoints = (
        getattr(layer, "gradient_checkpointing", False) and layer.training and torch.is_grad_enabled()
    )
    codes = _codes(readers, checkpoints)
    run = functools.partial(_composition, layer, names, norm_args, defaults | kwargs, not checkpoints, codes)
    if not (CHECKPOINTS_IN_FORWARD and checkpoints):
        return run(x)
    if kwargs.get("use_cache") or any(kwargs.get(name) is not None for name in _CACHE_ARGUMENTS):
        return type(layer).forward(layer, x, **kwargs)
    return layer._gradient_checkpointing_func(run, x)


def _composition(
    layer: nn.Module,
    names: LayerNames,
    norm_args: tuple[NormArgs, NormArgs],
    kwargs: dict[str, Any],
    mlp_term_in_add: bool,
    codes: _Codes,
    x: torch.Tensor,
) -> torch.Tensor:
    """The layer's output, its residual adds in the norm kernels (``norm_args``: :func:`_norm_args`) and, with
    ``mlp_term_in_add``, the down projection's LoRA term in the last add (:func:`.mlp.forward_with_residual`);
    ``codes``: the FP8 codes the norms also make (:func:`_codes`)."""
    _, attention, _, mlp = _children(layer, names)
    first_args, second_args = norm_args
    h, y = residual_rms_norm(x, None, *first_args, quantize=codes.first, grad_factors=codes.upstream_grad)
    branch = attention(hidden_states=y, **kwargs)[0]
    h, y = residual_rms_norm(h, branch, *second_args, quantize=codes.second, grad_factors=codes.branch_grad)
    return mlp_fusion.forward_with_residual(mlp, y, h) if mlp_term_in_add else h + mlp(y)


def install(
    layer: nn.Module,
    names: LayerNames = PRE_NORM,
    readers: Readers = NO_READERS,
    previous: nn.Module | None = None,
) -> None:
    """Makes ``layer`` run :func:`fused_layer_forward` (instance-attribute ``forward``); ``readers``: each norm's
    (:func:`norm_readers`), whose FP8 bases may take codes from the norms; ``previous``: the layer whose output
    is this one's input, if any (its down's output gradient is the first norm's ``dx``)."""
    modules = _resolve(layer, readers, previous)
    replace_forward(layer, fused_layer_forward, names, modules, _attention_defaults(type(layer)))


def follows(before: str, name: str) -> bool:
    """Whether the module at path ``name`` is the next entry of the list that holds the one at ``before`` (a
    decoder layer's input is then that layer's output)."""
    parent, _, index = name.rpartition(".")
    parent_before, _, index_before = before.rpartition(".")
    return (
        parent == parent_before
        and index.isdigit()
        and index_before.isdigit()
        and int(index) == int(index_before) + 1
    )


def is_installed(layer: nn.Module) -> bool:
    return replaced_by(layer, fused_layer_forward)


def uninstall(layer: nn.Module) -> None:
    """Restores the class forward of ``layer`` if :func:`install` replaced it."""
    restore_forward(layer, fused_layer_forward)


def reason_not_fused(layer: nn.Module, names: LayerNames = PRE_NORM) -> str | None:
    """Why a pre-norm ``layer`` (:func:`is_pre_norm_layer`) cannot add its residuals in its norms; None when it
    can."""
    first, _, second, _ = _children(layer, names)
    if "forward" in vars(layer):
        return "its forward is already replaced on the instance (another library patched it)"
    if _norm_args(layer, names) is None:
        return "its norms do not run loralei's RMSNorm kernels"
    if hooked(first) or hooked(second):
        return "hooks on its norms (the fused forward does not call those modules)"
    return None
