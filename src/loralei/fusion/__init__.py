"""Fusion: decides, per model, which LoRA modules run fused ops; declarative family specs; a report."""

from .apply import apply_fused_kernels, remove_fused_kernels
from .report import Fused, FusionReport, NotFused
from .specs import FamilySpec, spec_for

__all__ = [
    "FamilySpec",
    "Fused",
    "FusionReport",
    "NotFused",
    "apply_fused_kernels",
    "remove_fused_kernels",
    "spec_for",
]
