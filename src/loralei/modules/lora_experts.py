"""LoRAExperts: an MoE experts module (3-D expert banks) with per-expert LoRA factors on chosen banks.

Transformers 5 keeps a layer's experts as 3-D parameters of one module (``gate_up_proj``: E×2I×H,
``down_proj``: E×H×I, or their transposes) called as ``experts(hidden_states, top_k_index, top_k_weights)``.
:class:`LoRAExperts` replaces such a module, keeps its parameters and children under the same names, and adds
``lora_A.<bank>`` (E×r×in) and ``lora_B.<bank>`` (E×out×r) for each adapted bank. It only gathers tensors and
calls an op: the fused grouped op (set by ``apply_fused_kernels``) or its plain expert-by-expert twin.
"""

from __future__ import annotations

import inspect
from typing import NamedTuple

import torch
from torch import nn

from ..config import LoRAConfig
from ..ops import reference
from ..ops.lora_experts import lora_experts
from ..ops.weights import ExpertBank, QuantizedBank
from .lora_linear import init_factors
from .quantized import as_quantized_bank, quantize_bank, refuse_dtype_cast

_CALL = ("hidden_states", "top_k_index", "top_k_weights")


class ExpertsLayout(NamedTuple):
    """How an experts module stores and combines its banks (Transformers' ``use_experts_implementation`` flags).

    Attributes:
        up: name of the first bank: ``"gate_up_proj"`` (gated) or ``"up_proj"``.
        down: name of the second bank.
        gated: the first bank holds gate and up rows, combined by the module's ``_apply_gate``.
        concatenated: gate rows then up rows (not interleaved).
        transposed: banks are stored (E, in, out).
        bias: name suffix of per-expert biases (``<bank>_bias``) when the module has them.
        post_norm: the module normalises each expert's output (``post_expert_norm``).
    """

    up: str
    down: str
    gated: bool
    concatenated: bool
    transposed: bool
    bias: bool
    post_norm: bool


def experts_layout(module: nn.Module) -> ExpertsLayout | None:
    """The layout of ``module`` when it is an experts module with Transformers' contract, else ``None``."""
    params = dict(module.named_parameters(recurse=False))
    up = "gate_up_proj" if "gate_up_proj" in params else "up_proj"
    if not {up, "down_proj"} <= params.keys() or params[up].dim() != 3 or params["down_proj"].dim() != 3:
        return None
    if tuple(inspect.signature(module.forward).parameters)[:3] != _CALL:
        return None
    return ExpertsLayout(
        up=up,
        down="down_proj",
        gated=bool(getattr(module, "has_gate", up == "gate_up_proj")),
        concatenated=bool(getattr(module, "is_concatenated", True)),
        transposed=bool(getattr(module, "is_transposed", False)),
        bias=bool(getattr(module, "has_bias", False)),
        post_norm=bool(getattr(module, "has_post_expert_norm", False)),
    )


def bank_in_out(param: torch.Tensor | QuantizedBank, layout: ExpertsLayout) -> tuple[int, int]:
    """(in, out) features of one expert of a 3-D bank (dense, or quantized: its dense shape)."""
    _, d1, d2 = param.shape
    return (d1, d2) if layout.transposed else (d2, d1)


class LoRAExperts(nn.Module):
    """Replaces an experts module; its banks and children keep their names (``gate_up_proj``, ``act_fn``...).

    Attributes:
        adapted: names of the banks with LoRA factors, in the module's parameter order.
        layout: the :class:`ExpertsLayout` read from the replaced module.
        merged: the updates are folded into the banks.
        disabled: the forward computes the base experts only.
        fused: the forward runs the fused grouped op (set by ``loralei.apply_fused_kernels``).
    """

    def __init__(self, base: nn.Module, adapted: tuple[str, ...], config: LoRAConfig) -> None:
        super().__init__()
        self.layout = experts_layout(base)
        self.num_experts = base.gate_up_proj.shape[0] if self.layout.gated else base.up_proj.shape[0]
        for name, param in base.named_parameters(recurse=False):
            setattr(self, name, param)
        for name, child in base.named_children():
            setattr(self, name, child)
        # the replaced module: its _apply_gate (and other attributes) define the gating, and unloading puts
        # it back; not registered, so its parameters (the same objects as ours) are not listed twice
        object.__setattr__(self, "base_layer", base)
        self.adapted = adapted
        self.config = config
        self.r, self.scale = config.r, config.scale
        self.lora_A, self.lora_B = nn.ParameterDict(), nn.ParameterDict()
        for name in adapted:
            bank = getattr(self, name)
            in_f, out_f = bank_in_out(bank, self.layout)
            dtype = torch.float32 if config.lora_fp32_gradients else self.bank_dtype(name)
            factory = {"device": bank.device, "dtype": dtype}
            self.lora_A[name] = nn.Parameter(torch.empty(self.num_experts, config.r, in_f, **factory))
            self.lora_B[name] = nn.Parameter(torch.empty(self.num_experts, out_f, config.r, **factory))
        if config.quantize_base:  # the dense banks are dropped from the replaced module too, to free them
            for name in (self.layout.up, self.layout.down):
                setattr(self, name, quantize_bank(getattr(self, name), config))
                base._parameters.pop(name)
        self.merged = self.disabled = self.fused = False
        self.activation: str | None = None  # the gated activation the fused op computes (with ``fused``)
        self.reset_lora_parameters(config.init_lora_weights)

    def reset_lora_parameters(self, init: bool | str) -> None:
        """Initialises every expert's A and B as ``LoRAConfig.init_lora_weights`` describes (as ``LoRALinear``
        does one projection's)."""
        for name in self.adapted:
            for e in range(self.num_experts):
                init_factors(self.lora_A[name][e], self.lora_B[name][e], init, self.r)

    def quant(self, name: str) -> QuantizedBank | None:
        """Bank ``name`` as a quantized bank, or ``None`` for a dense one."""
        return as_quantized_bank(getattr(self, name), self.num_experts)

    def bank_dtype(self, name: str) -> torch.dtype:
        """The compute dtype of bank ``name`` (a packed bank reports its dense dtype)."""
        return getattr(self, name).dtype

    def host_reads(self) -> str | None:
        """Why this module's training step reads a device value on the host (so no CUDA graph can record it), or
        None: the fused op on bf16 banks with 16-byte-aligned widths sorts, gathers and multiplies on the device
        alone (grouped GEMMs over device offsets), and dequantizes a quantized bank whole for a training batch
        (:func:`loralei.ops.lora_experts._dense`); the loops over the experts that received rows read the expert
        counts on the host."""
        if not self.fused or self.merged or self.disabled:
            return "MoE experts off the fused op loop over the experts on the host"
        banks = (self.layout.up, self.layout.down)
        dtypes = {self.bank_dtype(name) for name in banks}
        # a packed bank's shape is its dense (E, d1, d2) one, not its storage's
        shaped = [q if (q := self.quant(name)) is not None else getattr(self, name) for name in banks]
        widths = {self.r, *(w for bank in shaped for w in bank_in_out(bank, self.layout))}
        if not hasattr(torch, "_grouped_mm") or dtypes != {torch.bfloat16} or any(w % 8 for w in widths):
            return (
                "MoE experts loop over the experts on the host unless their banks are bf16 with widths and rank "
                f"in multiples of 8 (here {sorted(map(str, dtypes))}, widths {sorted(widths)})"
            )
        return None

    def _apply(self, fn, recurse: bool = True):
        """``Module.to`` / ``.half()``: packed banks may move between devices but never change dtype."""
        refuse_dtype_cast(
            fn, [q for q in map(self.quant, (self.layout.up, self.layout.down)) if q is not None]
        )
        return super()._apply(fn, recurse)

    def bank(self, name: str) -> ExpertBank:
        """Bank ``name`` with its factors (``None`` when not adapted) for an op."""
        quant = self.quant(name)
        lora = name in self.adapted
        return ExpertBank(
            W=None if quant is not None else getattr(self, name),
            quant=quant,
            A=self.lora_A[name] if lora else None,
            B=self.lora_B[name] if lora else None,
            scale=self.scale,
            bias=getattr(self, f"{name}_bias", None) if self.layout.bias else None,
            transposed=self.layout.transposed,
        )

    def delta_weight(self, name: str) -> torch.Tensor:
        """``scale * B[e] @ A[e]`` for every expert in FP32, in the bank's storage layout (what merging adds)."""
        delta = torch.bmm(self.lora_B[name].float(), self.lora_A[name].float()) * self.scale
        return delta.transpose(-2, -1) if self.layout.transposed else delta

    def apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The replaced module's gating of a gate_up output (its ``_apply_gate``), or ``act_fn`` ungated."""
        if not self.layout.gated:
            return self.act_fn(gate_up)
        own = getattr(self.base_layer, "_apply_gate", None)
        if own is not None:
            return own(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act_fn(gate) * up

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        up, down = self.bank(self.layout.up), self.bank(self.layout.down)
        lora = not (self.merged or self.disabled)
        if lora and self.fused:
            return lora_experts(hidden_states, top_k_index, top_k_weights, up, down, self.activation)
        post = self.post_expert_norm if self.layout.post_norm else None
        return reference.lora_experts(
            hidden_states, top_k_index, top_k_weights, up, down, self.apply_gate, post, lora=lora
        )

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, adapted={list(self.adapted)}, r={self.r}, scale={self.scale:g}, "
            f"merged={self.merged}"
        )
