"""The expert banks of an NVFP4 checkpoint: per-expert linears in the files, packed banks in the model.

ModelOpt stores each expert's projections as linears of their own (``<experts>.<e>.gate_proj.weight``, its
``weight_scale``, ``weight_scale_2``, ``input_scale``); Transformers 5 models hold an experts module's projections
as packed 3-D banks (``<experts>.gate_up_proj`` (E, 2I, H): each expert's gate rows then its up rows;
``<experts>.down_proj`` (E, H, I)). Which per-expert projections make each bank, in row order, is read from
Transformers' own checkpoint conversion mapping for the model type (the rule it fuses unquantized checkpoints by).

:func:`plan_banks` checks every expert's tensors against the format before anything is read; :func:`stack_bank`
stacks one bank's stored tensors along a new expert axis, as they are (still 4-bit packed), into the 3-D
:class:`loralei.modules.quantized.checkpoint_tensor.CheckpointTensor` that
:class:`loralei.modules.quantized.checkpoint_bank.CheckpointBank` computes with.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn

from ..errors import ConfigError
from ..modules.lora_experts import experts_layout
from ..modules.quantized.checkpoint_checks import TensorMeta, check_linear
from ..modules.quantized.checkpoint_formats import FORMATS, Dims, QuantSpec, groups_of
from ..modules.quantized.checkpoint_tensor import CheckpointTensor

# Transformers' operations that fuse per-expert linears into a bank: stack the experts, then concatenate the
# projections along the rows
_MERGE_OPS = {("MergeModulelist",), ("MergeModulelist", "Concatenate")}


class BankPlan(NamedTuple):
    """One bank of a checkpoint's experts module.

    Attributes:
        experts: E.
        projections: the per-expert projections fused into the bank's rows, in order (``gate_proj``, ``up_proj``).
    """

    experts: int
    projections: tuple[str, ...]

    def linears(self, bank: str) -> list[str]:
        """The stored per-expert linears of bank ``bank`` (``<experts>.<bank>``), expert by expert, each expert's
        in row order."""
        module = bank.rpartition(".")[0]
        return [f"{module}.{e}.{proj}" for e in range(self.experts) for proj in self.projections]


def bank_projections(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """Bank name -> the per-expert projections fused into it, in row order, from Transformers' conversion mapping
    for the model type (``{"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}`` for
    Qwen2/3-MoE); empty when Transformers fuses no per-expert linears into banks for it."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    out: dict[str, tuple[str, ...]] = {}
    for rule in get_checkpoint_conversion_mapping(getattr(model.config, "model_type", "")) or []:
        ops = tuple(type(op).__name__ for op in getattr(rule, "operations", ()))
        targets, sources = rule.target_patterns, rule.source_patterns
        if (
            ops not in _MERGE_OPS
            or len(targets) != 1
            or not targets[0].rpartition(".")[0].endswith("experts")
        ):
            continue
        projections = [s.partition("experts.*.")[2].removesuffix(".weight") for s in sources]
        if all(p and "." not in p for p in projections):
            out[targets[0].rpartition(".")[2]] = tuple(projections)
    return out


def _unreadable(spec: QuantSpec, module: nn.Module, projections: dict[str, tuple[str, ...]]) -> str | None:
    """Why loralei cannot read the quantized experts of ``module`` as banks, or ``None``."""
    if spec.method != "nvfp4":
        return f"it reads {FORMATS[spec.method].title} checkpoints' linears only"
    if experts_layout(module).transposed:
        return "this model stores its banks transposed"
    if not projections:
        return "Transformers fuses no per-expert linears into this model's banks"
    return None


def plan_banks(
    model: nn.Module,
    names: set[str],
    metadata: Callable[[list[str]], dict[str, TensorMeta]],
    spec: QuantSpec,
    source: str,
) -> dict[str, BankPlan]:
    """The quantized expert banks of the checkpoint, each expert's tensors checked against ``spec``.

    Args:
        model: the model built from the config (on the meta device).
        names: every tensor name of the checkpoint.
        metadata: the shapes and dtypes of named tensors, from the files' headers.
        spec: the checkpoint's quantization settings.
        source: how messages name the checkpoint.

    Returns:
        Bank name (``<experts>.<bank>``) -> its :class:`BankPlan`, for each experts module whose experts the
        checkpoint stores quantized.

    Raises:
        ConfigError: quantized experts of a format other than NVFP4, or of banks stored transposed; an expert
            projection without its tensors; or tensors that do not follow the config (``check_linear``).
    """
    marker = FORMATS[spec.method].marker
    # <experts>.<e>.<projection>.<marker>: the experts modules whose experts are stored quantized
    quantized = {n.rsplit(".", 3)[0] for n in names if n.endswith(f".{marker}") and n.count(".") >= 3}
    projections = bank_projections(model)
    plans: dict[str, BankPlan] = {}
    for name, module in model.named_modules():
        if name not in quantized or (layout := experts_layout(module)) is None:
            continue
        if (why := _unreadable(spec, module, projections)) is not None:
            raise ConfigError(
                f"{source}: the checkpoint stores the experts of {name!r} quantized, but loralei reads quantized "
                f"expert banks from NVFP4 checkpoints of packed-bank models only ({why}); use the model's "
                "unquantized weights"
            )
        for bank in (layout.up, layout.down):
            plans[f"{name}.{bank}"] = _plan_bank(
                module, name, bank, projections, names, metadata, spec, source
            )
    return plans


def _plan_bank(
    module: nn.Module,
    name: str,
    bank: str,
    projections: dict[str, tuple[str, ...]],
    names: set[str],
    metadata: Callable[[list[str]], dict[str, TensorMeta]],
    spec: QuantSpec,
    source: str,
) -> BankPlan:
    """One bank's plan, every expert projection's tensors present and checked."""
    fmt = FORMATS[spec.method]
    experts, rows, inp = getattr(module, bank).shape
    projs = projections.get(bank)
    if projs is None or rows % len(projs):
        raise ConfigError(
            f"{source}: {name!r} has a bank {bank!r} that Transformers does not fuse from per-expert linears; "
            "loralei reads NVFP4 expert banks it does (gate_up_proj, down_proj)"
        )
    dims = Dims(rows // len(projs), inp, groups_of(spec, inp))
    plan = BankPlan(experts, projs)
    held = {
        linear: [p.name for p in fmt.parts if f"{linear}.{p.name}" in names]
        for linear in plan.linears(f"{name}.{bank}")
    }
    metas = metadata([f"{linear}.{p}" for linear, parts in held.items() for p in parts])  # one header read
    for linear, parts in held.items():
        check_linear(source, linear, spec, dims, {p: metas[f"{linear}.{p}"] for p in parts})
    return plan


def stack_bank(
    read: dict[str, torch.Tensor],
    bank: str,
    plan: BankPlan,
    shape: torch.Size,
    spec: QuantSpec,
    dtype: torch.dtype,
) -> CheckpointTensor:
    """One bank's stored tensors stacked into its 3-D frozen weight: each expert's projections concatenated along
    the rows (their one-element global scales side by side, (E, S)), the experts along a new first axis.

    Args:
        read: the kept parts of the bank's per-expert linears, by full name (``<linear>.<part>``).
        bank: ``<experts>.<bank>``.
        plan: the bank's plan.
        shape: the dense (E, d1, d2).
        spec: the checkpoint's settings.
        dtype: the compute dtype.
    """
    linears, width = plan.linears(bank), len(plan.projections)
    parts = {}
    for part in dict.fromkeys(n.rpartition(".")[2] for n in read):
        stored = [read[f"{linear}.{part}"] for linear in linears]
        experts = [
            stored[at : at + width] for at in range(0, len(stored), width)
        ]  # each expert's projections
        scalar = stored[0].numel() == 1  # a global scale: one per projection, kept side by side
        parts[part] = torch.stack(
            [torch.stack([t.reshape(()) for t in x]) if scalar else torch.cat(x) for x in experts]
        )
    return CheckpointTensor(parts, spec, shape, dtype)
