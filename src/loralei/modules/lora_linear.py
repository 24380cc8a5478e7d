"""LoRALinear: a frozen base projection plus a trainable low-rank update."""

from __future__ import annotations

import math
import weakref
from typing import Protocol

import torch
from torch import nn

from ..config import LoRAConfig
from ..errors import LoraleiError
from ..ops import reference
from ..ops.dropout import draw_keep_mask, scaled_mask
from ..ops.lora_w import lora_w
from ..ops.qat import qat_linear
from ..ops.weights import LoRAWeights, QuantizedWeight
from .quantized import as_quantized, quantize_weight, refuse_dtype_cast
from .quantized.fake_quant import fake_quantizer


class GroupOutputs(Protocol):
    """A shared-input group (set up by ``loralei.fusion``) that may already hold a member's output."""

    def output_for(self, member: LoRALinear, x: torch.Tensor) -> torch.Tensor | None:
        """The member's output for input ``x``, or ``None`` when the member must compute it itself."""


@torch.no_grad()
def init_factors(a: torch.Tensor, b: torch.Tensor, init: bool | str, r: int) -> None:
    """Initialises one projection's A (r×in) and B (out×r) in place as ``LoRAConfig.init_lora_weights`` says:
    ``True``: Kaiming-uniform A, zero B; ``"gaussian"``: normal A (std 1/r), zero B; ``False``: both random."""
    if init == "gaussian":
        nn.init.normal_(a, std=1.0 / r)
    else:
        nn.init.kaiming_uniform_(a, a=math.sqrt(5))
    if init is False:
        nn.init.kaiming_uniform_(b, a=math.sqrt(5))
    else:
        nn.init.zeros_(b)


class LoRALinear(nn.Module):
    """Replaces an ``nn.Linear`` (or a bitsandbytes ``Linear4bit``; a fine-grained ``FP8Linear`` arrives as an
    ``nn.Linear`` holding its codes and block scales as a ``Float8Tensor``); keeps its ``weight`` and ``bias``
    Parameters under the same names. With ``quantize_base``, or a base loaded quantized, the ``weight`` Parameter
    holds the packed weight (an ``NF4Tensor``, a ``Float8Tensor``, ...) and the ops compute with it through
    :attr:`quant`.

    State-dict names are ``<path>.weight``, ``<path>.bias`` (the base's, unchanged) and
    ``<path>.lora_A.weight`` (r×in), ``<path>.lora_B.weight`` (out×r), as in PEFT minus the adapter segment.
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
        # a base loaded quantized (bitsandbytes, a fine-grained FP8 checkpoint) stays as it is
        repack = config.quantize_base and as_quantized(base.weight) is None
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

    def reset_lora_parameters(self, init: bool | str) -> None:
        """Initialises A and B as ``LoRAConfig.init_lora_weights`` describes."""
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
        """Pickled without the cached wrapper (it holds a weak reference, which does not pickle)."""
        return {**self.__dict__, "_quant_cache": None}

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
        """Whether the fused ops may compute this projection now: LoRA active, the base frozen, no QAT."""
        return not (self.base_trainable or self.merged or self.disabled or self.config.qat is not None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.merged or self.disabled:
            return reference.lora_linear(x, self.lora_weights(), lora=False)
        if self.group is not None:
            out = self.group.output_for(self, x)
            if out is not None:
                return out
        w = self.lora_weights()
        if self.config.qat is not None:
            if self.base_trainable:
                raise LoraleiError(
                    "lora.qat trains the LoRA factors only, but this projection's base weight or bias requires "
                    "grad; freeze the base, or drop qat"
                )
            return qat_linear(x, w, fake_quantizer(self.config.qat))
        if self.fused and not self.base_trainable:  # merged/disabled returned above
            return lora_w(x, w)
        # Same mask draw as the fused ops, so fused and plain runs agree under the same RNG seed.
        mask = scaled_mask(draw_keep_mask(x.shape, x.device, w.dropout_p), w.dropout_p, w.dtype)
        return reference.lora_linear(x, w, dropout_mask=mask)

    def _apply(self, fn, recurse: bool = True):
        """``Module.to`` / ``.half()`` / ... : a packed weight may move between devices but never change dtype
        (casting it would silently dequantize it, or re-wrap it with a wrong dtype)."""
        refuse_dtype_cast(fn, [q for q in (self.quant,) if q is not None])
        self._quant_cache = None  # a moved weight may be the same Parameter holding new tensors
        return super()._apply(fn, recurse)

    def extra_repr(self) -> str:
        quant = self.quant
        kind = "" if quant is None else f", quantized={type(quant).__name__.removesuffix('Weight')}"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, r={self.r}, "
            f"scale={self.scale:g}, dropout={self.dropout_p}, bias={self.bias is not None}, "
            f"merged={self.merged}{kind}"
        )
