"""LoRALinear: a frozen base projection plus a trainable low-rank update."""

from __future__ import annotations

import functools
import math
import weakref
from collections.abc import Callable
from typing import Protocol

import torch
from torch import nn

from ..config import LoRAConfig
from ..errors import LoraleiError
from ..ops import kept_outputs, reference
from ..ops.dropout import draw_keep_mask, scaled_mask
from ..ops.lora_w import lora_w
from ..ops.qat import qat_linear
from ..ops.weights import LoRAWeights, QuantizedWeight
from . import dora
from .principal_init import is_principal, start_from_principal
from .quantized import as_quantized, quantize_weight, refuse_dtype_cast
from .quantized.fake_quant import fake_quantizer


class GroupOutputs(Protocol):
    """A shared-input group (set up by ``loralei.fusion``) that may already hold a member's output."""

    def output_for(self, member: LoRALinear, x: torch.Tensor) -> torch.Tensor | None:
        """The member's output for input ``x``, or ``None`` when the member must compute it itself."""


def _drawn(like: torch.Tensor, draw: Callable[[torch.Tensor], object]) -> torch.Tensor:
    """Random values of ``like``'s shape drawn in FP32 on the CPU (the global CPU generator), whatever ``like``'s
    device and dtype: one seed gives the same factors on any device (a layer streamed in on the host, or injected
    on the GPU) and in any dtype (rounded once)."""
    values = torch.empty(like.shape, dtype=torch.float32)
    draw(values)
    return values


@torch.no_grad()
def init_factors(a: torch.Tensor, b: torch.Tensor, init: bool | str, r: int) -> None:
    """Initialises one projection's A (r×in) and B (out×r) in place as ``LoRAConfig.init_lora_weights`` says:
    ``True``: Kaiming-uniform A, zero B; ``"gaussian"``: normal A (std 1/r), zero B; ``False``: both random.
    Random values come from the CPU generator in FP32 (:func:`_drawn`)."""
    kaiming = functools.partial(nn.init.kaiming_uniform_, a=math.sqrt(5))
    a.copy_(_drawn(a, functools.partial(nn.init.normal_, std=1.0 / r) if init == "gaussian" else kaiming))
    if init is False:
        b.copy_(_drawn(b, kaiming))
    else:
        nn.init.zeros_(b)


class LoRALinear(nn.Module):
    """Replaces an ``nn.Linear`` (or a bitsandbytes ``Linear4bit``; a fine-grained ``FP8Linear`` arrives as an
    ``nn.Linear`` holding its codes and block scales as a ``Float8Tensor``); keeps its ``weight`` and ``bias``
    Parameters under the same names. With ``quantize_base``, or a base loaded quantized, the ``weight`` Parameter
    holds the packed weight (an ``NF4Tensor``, a ``Float8Tensor``, ...) and the ops compute with it through
    :attr:`quant`.

    State-dict names are ``<path>.weight``, ``<path>.bias`` (the base's, unchanged) and
    ``<path>.lora_A.weight`` (r×in), ``<path>.lora_B.weight`` (out×r), as in PEFT minus the adapter segment;
    with ``use_dora`` also ``<path>.lora_magnitude_vector`` (out,) (:mod:`loralei.modules.dora`).
    The module only gathers its parameters and calls an op.

    Attributes:
        merged: the update is folded into ``weight``; the forward then skips the LoRA branch.
        disabled: the forward computes the base projection only (see ``loralei.disable_lora``).
        fused: the forward runs the fused single-projection op (set by ``loralei.apply_fused_kernels``).
        group: the shared-input group this projection belongs to, if any (set by ``apply_fused_kernels``).
    """

    def __init__(self, base: nn.Linear, config: LoRAConfig) -> None:
        super().__init__()
        self.in_features = base.in_features
        self.out_features = base.out_features
        self.config = config
        # a base loaded quantized (bitsandbytes, a fine-grained FP8 checkpoint) stays as it is; a PiSSA/OLoRA
        # base is packed after its principal part is taken out (reset_lora_parameters)
        repack = config.quantize_base and as_quantized(base.weight) is None
        repack = repack and not is_principal(config.init_lora_weights)
        self.weight = quantize_weight(base.weight, config) if repack else base.weight
        self.bias = base.bias
        lora_dtype = torch.float32 if config.lora_fp32_gradients else self.compute_dtype
        factory = {"device": self.weight.device, "dtype": lora_dtype}
        self.lora_A = nn.Linear(self.in_features, config.r, bias=False, **factory)
        self.lora_B = nn.Linear(config.r, self.out_features, bias=False, **factory)
        self.r = config.r
        self.scale = config.scale
        self.dropout_p = config.lora_dropout
        self.merged = False
        self.disabled = False
        self.fused = False
        self.group: GroupOutputs | None = None
        self._original_weight: torch.Tensor | None = None
        self.reset_lora_parameters(config.init_lora_weights)
        # lora.qat fake-quantizes this projection's forward while active (from qat.start_step on)
        self.qat_active = config.qat is not None and config.qat.start_step == 0
        magnitude = dora.initial_magnitude(self.lora_weights(), lora_dtype) if config.use_dora else None
        self.register_parameter(
            "lora_magnitude_vector", None if magnitude is None else nn.Parameter(magnitude)
        )

    def reset_lora_parameters(self, init: bool | str) -> None:
        """Initialises A and B as ``LoRAConfig.init_lora_weights`` describes; PiSSA/OLoRA also rewrite the base
        as the residual (:mod:`.principal_init`)."""
        if is_principal(init):
            start_from_principal(self)
        else:
            init_factors(self.lora_A.weight, self.lora_B.weight, init, self.r)

    @property
    def quant(self) -> QuantizedWeight | None:
        """The quantized base weight, or ``None`` for a dense one.

        Its wrapper is made once per weight tensor (the ops ask for it several times a step, and making it costs
        the host a few microseconds): kept until ``weight`` is another tensor (merging, unmerging) or the module
        is moved (:meth:`_apply`).
        """
        weight = self.weight
        cached = getattr(self, "_quant_cache", None)
        if cached is None or cached[0]() is not weight:
            cached = self._quant_cache = (weakref.ref(weight), as_quantized(weight, self.config))
        return cached[1]

    def __getstate__(self) -> dict:
        """Pickled without the cached wrapper and DoRA's cached norms, the base's and the last forward's (they hold
        weak references, which do not pickle)."""
        return {**self.__dict__, "_quant_cache": None, dora.CACHE: None, dora.STEP_CACHE: None}

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype the projection computes in: the dense weight's, or the one a quantized weight restores."""
        quant = self.quant
        return self.weight.dtype if quant is None else quant.dtype

    def lora_weights(self) -> LoRAWeights:
        """Bundles this projection's tensors for an op; dropout is active only in training mode."""
        quant = self.quant
        return LoRAWeights(
            W=self.weight if quant is None else None,
            quant=quant,
            A=self.lora_A.weight,
            B=self.lora_B.weight,
            scale=self.scale,
            dropout_p=self.dropout_p if self.training else 0.0,
            bias=self.bias,
        )

    def delta_weight(self) -> torch.Tensor:
        """``scale * B @ A`` (out×in) in FP32, the update that merging folds into ``weight``."""
        return (self.lora_B.weight.float() @ self.lora_A.weight.float()) * self.scale

    @property
    def base_trainable(self) -> bool:
        """Whether the base weight or bias requires grad (fused ops give the frozen base no gradient)."""
        return self.weight.requires_grad or (self.bias is not None and self.bias.requires_grad)

    def can_run_fused(self) -> bool:
        """Whether the fused gated MLP or shared-input group may compute this projection now: LoRA active, the base
        frozen, no QAT, and for DoRA no active dropout (PEFT's rule: the fused DoRA-with-dropout composition runs
        per projection, :mod:`loralei.modules.dora`)."""
        return not (
            self.base_trainable
            or self.merged
            or self.disabled
            or (self.lora_magnitude_vector is not None and self.training and self.dropout_p > 0)
            or self.config.qat is not None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.merged or self.disabled:
            return reference.lora_linear(x, self.lora_weights(), lora=False)
        if self.group is not None:
            out = self.group.output_for(self, x)
            if out is not None:
                return out
        if self.lora_magnitude_vector is not None:
            return dora.dora_forward(self, x)
        w = self.lora_weights()
        if self.config.qat is not None and self.qat_active:
            if self.base_trainable:
                raise LoraleiError(
                    "lora.qat trains the LoRA factors only, but this projection's base weight or bias requires "
                    "grad; freeze the base, or drop qat"
                )
            return qat_linear(x, w, fake_quantizer(self.config.qat))
        if self.fused and not self.base_trainable:  # merged/disabled returned above
            # a checkpoint's recomputation may have the output kept (ops.kept_outputs)
            outs = kept_outputs.run(
                (self,), lambda: (lora_w(x, w),), lambda kept: (lora_w(x, w, kept=kept[0]),)
            )
            return outs[0]
        # Same mask draw as the fused ops, so fused and plain runs agree under the same RNG seed.
        mask = scaled_mask(draw_keep_mask(x.shape, x.device, w.dropout_p), w.dropout_p, w.dtype)
        return reference.lora_linear(x, w, dropout_mask=mask)

    def _apply(self, fn, recurse: bool = True):
        """``Module.to`` / ``.half()`` / ... : a packed weight may move between devices but never change dtype
        (casting it would silently dequantize it, or re-wrap it with a wrong dtype)."""
        refuse_dtype_cast(fn, [q for q in (self.quant,) if q is not None])
        self._quant_cache = None  # a moved weight may be the same Parameter holding new tensors
        dora.clear_cache(self)
        return super()._apply(fn, recurse)

    def extra_repr(self) -> str:
        quant = self.quant
        kind = "" if quant is None else f", quantized={type(quant).__name__.removesuffix('Weight')}"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, r={self.r}, "
            f"scale={self.scale:g}, dropout={self.dropout_p}, bias={self.bias is not None}, "
            f"merged={self.merged}, dora={self.lora_magnitude_vector is not None}{kind}"
        )
