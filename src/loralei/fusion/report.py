"""FusionReport: what ``apply_fused_kernels`` fused, what stays on the plain path, and why."""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Literal

UnitKind = Literal[
    "gated MLP", "shared-input group", "projection", "experts", "RMSNorm", "residual adds", "RoPE"
]


@dataclass(frozen=True)
class Fused:
    """One fused unit: a gated MLP (3 projections), a shared-input group, a single projection, an experts
    module, an RMSNorm, a decoder layer whose residual adds run in its norms, or a modeling module's RoPE function
    (the last three: no projections)."""

    kind: UnitKind
    name: str
    members: tuple[str, ...]


@dataclass(frozen=True)
class NotFused:
    """A unit that does not run as ``kind``, and why. Only ``kind == "projection"`` entries run fully plain."""

    kind: UnitKind
    name: str
    reason: str


@dataclass
class FusionReport:
    """Result of ``apply_fused_kernels``; ``print(report)`` gives counts and the reasons for everything plain."""

    fused: list[Fused] = field(default_factory=list)
    not_fused: list[NotFused] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def count(self, kind: UnitKind) -> int:
        """Number of fused units of ``kind``."""
        return sum(1 for unit in self.fused if unit.kind == kind)

    @property
    def fused_projections(self) -> list[str]:
        """Names of every LoRA projection that runs inside some fused op."""
        return [member for unit in self.fused if unit.kind != "experts" for member in unit.members]

    @property
    def plain_projections(self) -> list[str]:
        """Names of LoRA projections that run the plain path."""
        return [entry.name for entry in self.not_fused if entry.kind == "projection"]

    @property
    def plain_experts(self) -> list[str]:
        """Names of experts modules with LoRA that run the plain expert-by-expert path."""
        return [entry.name for entry in self.not_fused if entry.kind == "experts"]

    def _down_term_note(self) -> str:
        """Which of the layers whose residual adds run in the norms take their fused MLP's down LoRA term in the
        last add: only a layer whose MLP was fused has that term to hand over."""
        mlps = [unit.name for unit in self.fused if unit.kind == "gated MLP"]
        layers = [unit.name for unit in self.fused if unit.kind == "residual adds"]
        with_term = sum(any(mlp.startswith(f"{layer}.") for mlp in mlps) for layer in layers)
        if not with_term:
            return ""
        which = "" if with_term == len(layers) else f"{with_term} of them "
        return f" ({which}with the fused MLP's down LoRA term in the last add, without checkpointing)"

    def __str__(self) -> str:
        lines = [
            f"loralei fusion: {len(self.fused_projections)} LoRA projections fused "
            f"({self.count('gated MLP')} gated MLPs, {self.count('shared-input group')} shared-input groups, "
            f"{self.count('projection')} single projections); {len(self.plain_projections)} plain"
        ]
        if self.count("experts") or self.plain_experts:
            lines.append(
                f"  experts modules: {self.count('experts')} fused (grouped GEMMs over routed rows), "
                f"{len(self.plain_experts)} plain"
            )
        plain = Counter(entry.kind for entry in self.not_fused)
        if self.count("RMSNorm") or plain["RMSNorm"]:
            lines.append(
                f"  RMSNorms: {self.count('RMSNorm')} replaced (loralei's kernel where Triton runs, their class "
                f"forward elsewhere), {plain['RMSNorm']} kept"
            )
        if self.count("residual adds") or plain["residual adds"]:
            lines.append(
                f"  residual adds: inside the RMSNorm kernels in {self.count('residual adds')} decoder layers"
                f"{self._down_term_note()}, {plain['residual adds']} kept apart"
            )
        if self.count("RoPE"):
            modules = ", ".join(unit.name for unit in self.fused if unit.kind == "RoPE")
            lines.append(
                f"  RoPE: replaced for the process in {modules} (loralei's kernel where Triton runs)"
            )
        by_reason: dict[tuple[str, str], list[str]] = defaultdict(list)
        for entry in self.not_fused:
            by_reason[(entry.kind, entry.reason)].append(entry.name)
        for (kind, reason), names in by_reason.items():
            what = (
                "plain"
                if kind in ("projection", "experts", "RMSNorm", "residual adds", "RoPE")
                else f"not fused as {kind}"
            )
            example = ", ".join(names[:2]) + (f", ... ({len(names)} in all)" if len(names) > 2 else "")
            lines.append(f"  {what}: {reason}: {example}")
        lines.extend(f"  note: {note}" for note in self.notes)
        return "\n".join(lines)
