"""Per-family fusion specs (data): where attention and MLP modules keep the projections that fuse.

A spec names children of an attention module (``qkv``, ``o``) and of a gated MLP module (``gate``, ``up``,
``down`` and the activation attribute ``act``). Modules are found by these child names, so one spec covers every
family that uses them; a family with other names (or fused projections) gets its own entry.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn
from transformers.activations import GELUActivation, GELUTanh, NewGELUActivation, SiLUActivation

from ..kernels.activations import ACTIVATIONS as KERNEL_ACTIVATIONS


@dataclass(frozen=True)
class FamilySpec:
    """Child names of the fusable parts of one model family; ``None`` where the family has no such part."""

    qkv: tuple[str, ...] | None = ("q_proj", "k_proj", "v_proj")
    o: str | None = "o_proj"
    gate: str | None = "gate_proj"
    up: str | None = "up_proj"
    down: str | None = "down_proj"
    act: str = "act_fn"
    # the attention's projections, whose outputs a checkpointed layer may keep for its recomputation
    # (loralei.train.kept_attention)
    attention: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")

    def role(self, leaf: str) -> str:
        """Which ``apply_fused_kernels`` switch governs a projection with this leaf name."""
        if self.qkv and leaf in self.qkv:
            return "qkv"
        if leaf == self.o:
            return "o"
        return "mlp" if leaf in (self.gate, self.up, self.down) else "other"


LLAMA_LIKE = FamilySpec()
# Phi-3 fuses q/k/v into one qkv_proj and gate/up into gate_up_proj: each runs as a single projection.
PHI3 = FamilySpec(qkv=None, gate=None, up=None, down=None, attention=("qkv_proj", "o_proj"))

SPECS: dict[str, FamilySpec] = {
    "llama": LLAMA_LIKE,
    "mistral": LLAMA_LIKE,
    "qwen2": LLAMA_LIKE,
    "qwen3": LLAMA_LIKE,
    "gemma": LLAMA_LIKE,
    "gemma2": LLAMA_LIKE,
    "gemma3": LLAMA_LIKE,
    "gemma3_text": LLAMA_LIKE,
    "phi3": PHI3,
}

# Activation modules the fused MLP op implements, by type. GELUActivation computes the exact (erf) GELU in both
# its C and Python variants; GELUTanh and NewGELUActivation both compute the tanh approximation.
ACTIVATIONS: dict[type[nn.Module], str] = {
    nn.SiLU: "silu",
    SiLUActivation: "silu",
    GELUActivation: "gelu",
    GELUTanh: "gelu_tanh",
    NewGELUActivation: "gelu_tanh",
}
TORCH_GELU = {"none": "gelu", "tanh": "gelu_tanh"}  # nn.GELU(approximate=...)
SUPPORTED_ACTIVATIONS = tuple(KERNEL_ACTIVATIONS)  # the names the fused kernel implements


def spec_for(model: nn.Module) -> FamilySpec:
    """The spec of ``model``'s family (by ``config.model_type``); unknown families get the Llama-like names."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    return SPECS.get(model_type, LLAMA_LIKE)


def activation_name(act: nn.Module | None) -> str | None:
    """``"silu"``, ``"gelu"`` or ``"gelu_tanh"`` for a supported activation module, else ``None``."""
    if isinstance(act, nn.GELU):
        return TORCH_GELU.get(act.approximate)
    return ACTIVATIONS.get(type(act))
