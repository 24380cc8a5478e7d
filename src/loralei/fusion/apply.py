"""apply_fused_kernels / remove_fused_kernels: decide per module which fused op runs, and undo it.

Order of decisions: gated MLPs first (one op for gate, up, activation and down), then shared-input groups among
the projections left (q/k/v; gate/up of MLPs that could not fuse whole; user-defined groups), then every
remaining LoRA projection runs the single-projection op; then the RMSNorms whose form the kernel computes
(``norms.py``), the pre-norm decoder layers whose residual adds those norms can take (``residual.py``) and the
family's RoPE function (``rope.py``). Whatever is not eligible stays plain and is listed
in the report with the reason. Nothing is rewritten: module attributes only (DESIGN.md, fusion), the RoPE
function of the family's modeling module, and where a shared-input group's dense base weights lie (one buffer per
group, the same values: ``groups.stack_bases``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from torch import nn

from ..errors import ConfigError, InjectionError
from ..inject import lora_expert_modules, lora_modules
from ..modules.lora_experts import LoRAExperts
from ..modules.lora_linear import LoRALinear
from . import mlp as mlp_fusion
from . import norms as norm_fusion
from . import residual as residual_fusion
from . import rope as rope_fusion
from .forwards import hooked
from .groups import SharedInputGroup, stack_bases
from .report import Fused, FusionReport, NotFused
from .specs import SUPPORTED_ACTIVATIONS, FamilySpec, activation_name, spec_for

_STATE = "_loralei_fusion"  # attribute on the model holding the last FusionReport
GroupSpec = Mapping[str, Any]  # {"parent_name": str, "projection_names": [str, ...]}


def _base_reason(p: LoRALinear) -> str | None:
    if p.base_trainable:
        return "base weight/bias is trainable (fused ops give the frozen base no gradient)"
    if p.config.qat is not None:
        return "lora.qat: the forward fake-quantizes the merged weight (a dense GEMM)"
    return None


def _joint_reason(p: LoRALinear) -> str | None:
    """Why ``p`` cannot join a gated MLP or shared-input group (:func:`_base_reason`, or DoRA with dropout)."""
    if p.lora_magnitude_vector is not None and p.dropout_p > 0:
        return (
            "DoRA with lora_dropout > 0 (PEFT's rule: each such projection runs the fused DoRA op on its own)"
        )
    return _base_reason(p)


def _join(parent: str, child: str) -> str:
    return f"{parent}.{child}" if parent else child


class _Planner:
    """Walks a model once per pass, installs fused paths and fills the report."""

    def __init__(self, model: nn.Module, spec: FamilySpec) -> None:
        self.model, self.spec = model, spec
        self.loras = dict(lora_modules(model))
        self.claimed: set[str] = set()
        self.report = FusionReport()

    def _mlp_reason(self, module: nn.Module) -> str | None:
        spec = self.spec
        projections = {n: getattr(module, n) for n in (spec.gate, spec.up, spec.down)}
        plain = [n for n, p in projections.items() if not isinstance(p, LoRALinear)]
        act = getattr(module, spec.act, None)
        with_hooks = [
            n for n, p in [*projections.items(), (spec.act, act)] if isinstance(p, nn.Module) and hooked(p)
        ]
        if plain:
            return f"not every projection has LoRA (plain: {', '.join(plain)})"
        if activation_name(act) is None:
            return f"activation {type(act).__name__} is not supported (supported: {', '.join(SUPPORTED_ACTIVATIONS)})"
        if with_hooks:
            return f"hooks on {', '.join(with_hooks)} (the fused op does not call these modules)"
        if "forward" in vars(module):
            return "its forward is already replaced on the instance (another library patched it)"
        return next(filter(None, (_joint_reason(p) for p in projections.values())), None)

    def mlps(self) -> None:
        spec = self.spec
        if not (spec.gate and spec.up and spec.down):
            return
        for name, module in self.model.named_modules():
            children = [getattr(module, n, None) for n in (spec.gate, spec.up, spec.down)]
            if not all(isinstance(c, nn.Module) for c in children):
                continue
            if not any(isinstance(c, LoRALinear) for c in children):
                continue  # a gated MLP without LoRA: nothing to fuse, nothing to report
            reason = self._mlp_reason(module)
            if reason:
                self.report.not_fused.append(NotFused("gated MLP", name, reason))
                continue
            mlp_fusion.install(module, spec, activation_name(getattr(module, spec.act)))
            members = tuple(_join(name, n) for n in (spec.gate, spec.up, spec.down))
            self.claimed.update(members)
            self.report.fused.append(Fused("gated MLP", name, members))

    def group(self, parent_name: str, names: Sequence[str]) -> None:
        parent = self.model.get_submodule(parent_name) if parent_name else self.model
        label = _join(parent_name, "{" + ",".join(names) + "}")
        members: list[tuple[str, LoRALinear]] = []
        skipped = []
        for n in names:
            full, module = _join(parent_name, n), getattr(parent, n)
            if full in self.claimed or not isinstance(module, LoRALinear):
                continue  # fused elsewhere already, or no LoRA there (a plain nn.Linear still reads x itself)
            reason = _joint_reason(module) or ("it has hooks" if hooked(module) else None)
            if reason:
                skipped.append(f"{n}: {reason}")
            else:
                members.append((full, module))
        if len({m.in_features for _, m in members}) > 1:
            skipped, members = ["members have different input sizes, so they cannot share one input"], []
        if skipped:
            self.report.not_fused.append(NotFused("shared-input group", label, "; ".join(skipped)))
        if len(members) < 2:
            return
        group = SharedInputGroup(label, [m for _, m in members])
        stack_bases(group.members)
        for full, m in members:
            m.group, m.fused = group, True
            self.claimed.add(full)
        self.report.fused.append(Fused("shared-input group", label, tuple(full for full, _ in members)))

    def auto_groups(self, qkv: bool, mlp: bool) -> Iterator[tuple[str, tuple[str, ...]]]:
        spec = self.spec
        wanted: list[tuple[str, ...]] = []
        if qkv and spec.qkv:
            wanted.append(spec.qkv)
        if mlp and spec.gate and spec.up:
            wanted.append((spec.gate, spec.up))
        for name, module in self.model.named_modules():
            for names in wanted:
                if all(isinstance(getattr(module, n, None), nn.Module) for n in names):
                    yield name, names

    def experts(self, enabled: bool) -> None:
        for name, module in lora_expert_modules(self.model):
            reason = experts_reason(module) if enabled else "experts=False"
            if reason:
                self.report.not_fused.append(NotFused("experts", name, reason))
                continue
            module.fused, module.activation = True, activation_name(module.act_fn)
            self.report.fused.append(Fused("experts", name, (name,)))

    def norms(self) -> None:
        for name, module in self.model.named_modules():
            if not norm_fusion.is_rms_norm(module):
                continue
            if "forward" in vars(module):
                reason = "its forward is already replaced on the instance (another library patched it)"
            elif (form := norm_fusion.form_of(module)) is None:
                reason = "its forward matches none of the RMSNorm forms loralei's kernel computes"
            else:
                norm_fusion.install(module, form)
                self.report.fused.append(Fused("RMSNorm", name, ()))
                continue
            self.report.not_fused.append(NotFused("RMSNorm", name, reason))

    def residual_adds(self) -> None:
        last_name, last = "", None  # the last pre-norm layer seen
        for name, module in self.model.named_modules():
            if not residual_fusion.is_pre_norm_layer(module):
                continue
            previous = last if residual_fusion.follows(last_name, name) else None
            last_name, last = name, module
            reason = residual_fusion.reason_not_fused(module)
            if reason:
                self.report.not_fused.append(NotFused("residual adds", name, reason))
                continue
            readers = residual_fusion.norm_readers(self.spec)
            residual_fusion.install(module, readers=readers, previous=previous)
            self.report.fused.append(Fused("residual adds", name, ()))

    def rope(self) -> None:
        fused, kept = rope_fusion.install(self.model)
        self.report.fused.extend(Fused("RoPE", name, ()) for name in fused)
        reason = f"its {rope_fusion.NAME} is not the half-split formula the kernel computes"
        self.report.not_fused.extend(NotFused("RoPE", name, reason) for name in kept)

    def singles(self, flags: Mapping[str, bool]) -> None:
        for name, module in self.loras.items():
            if name in self.claimed:
                continue
            role = self.spec.role(name.rpartition(".")[2])
            reason = f"{role}=False" if not flags[role] else _base_reason(module)
            if reason:
                self.report.not_fused.append(NotFused("projection", name, reason))
                continue
            module.fused = True
            self.report.fused.append(Fused("projection", name, (name,)))


def _own_gate(module: LoRAExperts) -> bool:
    """Whether the replaced module gates with its own ``_apply_gate`` rather than Transformers' default."""
    gate = getattr(type(module.base_layer), "_apply_gate", None)
    return gate is not None and gate.__qualname__ != "_default_apply_gate"


def experts_reason(module: LoRAExperts) -> str | None:
    """Why an experts module cannot run the fused grouped op (``None`` when it can)."""
    layout = module.layout
    checks = [
        (not layout.gated, "ungated experts (up_proj then act_fn); the fused op computes act(gate) * up"),
        (not layout.concatenated, "interleaved gate/up rows; the fused op reads [gate; up] halves"),
        (layout.bias, "per-expert biases; the fused op has none"),
        (layout.post_norm, "a post-expert norm; the fused op does not apply it"),
        (_own_gate(module), f"{type(module.base_layer).__name__} gates with its own _apply_gate"),
        (
            activation_name(getattr(module, "act_fn", None)) is None,
            f"activation {type(getattr(module, 'act_fn', None)).__name__} is not supported "
            f"(supported: {', '.join(SUPPORTED_ACTIVATIONS)})",
        ),
        (hooked(module) or hooked(module.base_layer), "hooks on the experts module"),
        (
            any(getattr(module, b).requires_grad for b in (layout.up, layout.down)),
            "an expert bank is trainable (the fused op gives frozen banks no gradient)",
        ),
    ]
    return next((reason for failed, reason in checks if failed), None)


def _user_groups(model: nn.Module, groups: Sequence[GroupSpec]) -> list[tuple[str, tuple[str, ...]]]:
    """Validates a user's ``shared_input_groups`` list; every problem is reported at once."""
    out, problems = [], []
    for i, entry in enumerate(groups):
        where = f"shared_input_groups[{i}]"
        if not isinstance(entry, Mapping) or set(entry) != {"parent_name", "projection_names"}:
            problems.append(
                f'{where}: expected {{"parent_name": str, "projection_names": [str, ...]}}, got {entry!r}'
            )
            continue
        parent_name, names = entry["parent_name"], entry["projection_names"]
        try:
            parent = model.get_submodule(parent_name) if parent_name else model
        except (AttributeError, TypeError):
            problems.append(
                f"{where}.parent_name: no module {parent_name!r} in the model; use a name from named_modules()"
            )
            continue
        if isinstance(names, str) or not isinstance(names, Sequence) or len(names) < 2:
            problems.append(f"{where}.projection_names: need a list of at least 2 child names, got {names!r}")
            continue
        missing = [n for n in names if not isinstance(getattr(parent, n, None), nn.Module)]
        if missing:
            problems.append(f"{where}.projection_names: {parent_name!r} has no child module {missing[0]!r}")
            continue
        out.append((parent_name, tuple(names)))
    if problems:
        raise ConfigError("invalid shared_input_groups:\n" + "\n".join(problems))
    return out


def _quantized_notes(modules: Iterable[LoRALinear], experts: Iterable[LoRAExperts]) -> list[str]:
    """One line per way the quantized bases and expert banks compute (e.g. "224 quantized bases: NF4, ...")."""
    backends = Counter(quant.backend for m in modules if (quant := m.quant) is not None)
    banks = Counter(q.backend for m in experts for b in (m.layout.up, m.layout.down) if (q := m.quant(b)))
    return [f"{n} quantized bases: {backend}" for backend, n in sorted(backends.items())] + [
        f"{n} quantized expert banks: {backend}" for backend, n in sorted(banks.items())
    ]


def apply_fused_kernels(
    model: nn.Module,
    mlp: bool = True,
    qkv: bool = True,
    o: bool = True,
    shared_input_groups: str | Sequence[GroupSpec] | None = "auto",
    other: bool = True,
    experts: bool = True,
    norms: bool = True,
    rope: bool = True,
) -> FusionReport:
    """Makes the LoRA projections of ``model`` run fused ops; exact (same results as the plain path).

    Calling it again first undoes the previous call, so it can change the options.

    Args:
        model: a model with LoRA (``inject_lora`` / ``load_pretrained``).
        mlp: fuse gated MLPs (gate, up, activation, down in one op); where an MLP is not eligible, its
            projections run as a gate/up group and single projections.
        qkv: fuse the attention q/k/v projections (one shared-input group per attention).
        o: the attention output projection runs the single-projection op.
        shared_input_groups: ``"auto"`` (q/k/v and gate/up from the family spec), ``None`` (no groups: every
            projection alone), or a list of ``{"parent_name": ..., "projection_names": [...]}`` that replaces
            the automatic groups (include q/k/v yourself if you want them too).
        other: LoRA projections with no role in the family spec (e.g. Phi-3's ``qkv_proj``) run the
            single-projection op.
        experts: MoE experts modules with LoRA run the grouped op (routes sorted once per layer, grouped GEMMs
            for the banks and the factors, the gated activation fused); see ``loralei.ops.lora_experts``.
        norms: RMSNorm modules run loralei's RMSNorm kernels (``loralei.fusion.norms``: each class's form is
            checked against its own forward first; a frozen weight gets no gradient work), and pre-norm decoder
            layers add their residuals inside them (``loralei.fusion.residual``: each class's forward is
            checked against the composition first).
        rope: the attention's rotary embedding runs loralei's RoPE kernel (``loralei.fusion.rope``: the family
            module's ``apply_rotary_pos_emb`` is replaced for the process, calling the original wherever the
            kernel cannot run; :func:`remove_fused_kernels` leaves it).

    Returns:
        The report of what runs fused and what stays plain, with reasons.

    Raises:
        InjectionError: the model has no LoRA.
        ConfigError: an option has a wrong type or a user group names missing modules.
    """
    flags = {"mlp": mlp, "qkv": qkv, "o": o, "other": other, "experts": experts, "norms": norms, "rope": rope}
    bad = [f"{k}: must be True or False (got {v!r})" for k, v in flags.items() if not isinstance(v, bool)]
    if bad:
        raise ConfigError("invalid apply_fused_kernels options:\n" + "\n".join(bad))
    if not any(True for _ in lora_modules(model)) and not any(True for _ in lora_expert_modules(model)):
        raise InjectionError(
            "model has no LoRA modules; call inject_lora or load_pretrained before apply_fused_kernels"
        )
    if shared_input_groups == "auto" or shared_input_groups is None:
        user = None
    elif isinstance(shared_input_groups, Sequence) and not isinstance(shared_input_groups, str):
        user = _user_groups(model, shared_input_groups)
    else:
        raise ConfigError(
            f'shared_input_groups: expected "auto", None or a list of groups, got {shared_input_groups!r}'
        )
    replaced = remove_fused_kernels(model)
    planner = _Planner(model, spec_for(model))
    if mlp:
        planner.mlps()
    auto = list(planner.auto_groups(qkv, mlp)) if shared_input_groups == "auto" else []
    for parent_name, names in user if user is not None else auto:
        planner.group(parent_name, names)
    planner.singles(flags)
    planner.experts(experts)
    if norms:
        planner.norms()
        planner.residual_adds()
    if rope:
        planner.rope()
    experts_modules = [m for _, m in lora_expert_modules(model)]
    planner.report.notes.extend(_quantized_notes(planner.loras.values(), experts_modules))
    if replaced:
        planner.report.notes.append("replaced the fusion applied earlier to this model")
    setattr(model, _STATE, planner.report)
    return planner.report


def remove_fused_kernels(model: nn.Module) -> bool:
    """Restores the plain path everywhere in ``model``; a no-op on a model without fusion. The family's RoPE
    function stays replaced (it is the modeling module's, shared by every model of the family in the process, and
    gives the same values).

    Returns:
        Whether anything was fused before.
    """
    was_fused = getattr(model, _STATE, None) is not None
    for module in model.modules():
        mlp_fusion.uninstall(module)
        norm_fusion.uninstall(module)
        residual_fusion.uninstall(module)
        if isinstance(module, LoRALinear):
            if module.group is not None:
                module.group.clear()
            module.group, module.fused = None, False
        if isinstance(module, LoRAExperts):
            module.fused, module.activation = False, None
    if was_fused:
        delattr(model, _STATE)
    return was_fused
