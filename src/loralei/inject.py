"""inject_lora: find the target modules of a model and swap in LoRA modules, atomically."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from typing import NamedTuple

import torch
from torch import nn

from .config import ALL_LINEAR, LoRAConfig
from .errors import InjectionError, did_you_mean
from .modules.lora_experts import LoRAExperts, experts_layout
from .modules.lora_linear import LoRALinear
from .modules.principal_init import check_principal
from .modules.quantized import check_bank_quantizable, check_quantizable
from .modules.quantized.bnb import is_bnb_linear4bit
from .modules.quantized.fp8_checkpoint import as_linear, compute_dtype, is_fp8_linear

logger = logging.getLogger("loralei")

# Module types loralei can adapt, and the LoRA module that wraps each (bitsandbytes' Linear4bit and Transformers'
# fine-grained FP8Linear too: :func:`adapter_for`; neither library is imported unless the model already uses it).
ADAPTERS: dict[type[nn.Module], type[LoRALinear]] = {nn.Linear: LoRALinear}

_STATE = "_loralei"  # attribute on the model holding the injection record


class ParameterCount(NamedTuple):
    """Trainable and total parameter counts of a model."""

    trainable: int
    total: int

    @property
    def percent(self) -> float:
        return 100.0 * self.trainable / max(self.total, 1)

    def __str__(self) -> str:
        return f"trainable params: {self.trainable:,} || all params: {self.total:,} || trainable%: {self.percent:.4f}"


class InjectionRecord(NamedTuple):
    """What ``inject_lora`` did, kept on the model so it can be saved and undone."""

    config: LoRAConfig
    requires_grad: dict[str, bool]
    added_input_grad_hooks: bool


def count_parameters(model: nn.Module) -> ParameterCount:
    """Counts trainable and total parameters (shared parameters once)."""
    params = {id(p): p for p in model.parameters()}.values()
    return ParameterCount(
        trainable=sum(p.numel() for p in params if p.requires_grad), total=sum(p.numel() for p in params)
    )


def lora_modules(model: nn.Module) -> Iterator[tuple[str, LoRALinear]]:
    """Yields ``(name, module)`` for every LoRA module in ``model``."""
    for name, module in model.named_modules():
        if isinstance(module, LoRALinear):
            yield name, module


def lora_expert_modules(model: nn.Module) -> Iterator[tuple[str, LoRAExperts]]:
    """Yields ``(name, module)`` for every experts module with LoRA in ``model``."""
    for name, module in model.named_modules():
        if isinstance(module, LoRAExperts):
            yield name, module


def adapted_bank_names(model: nn.Module) -> list[str]:
    """Full parameter names of the adapted expert banks (``<experts>.gate_up_proj``), in model order."""
    return [f"{name}.{bank}" for name, module in lora_expert_modules(model) for bank in module.adapted]


def injection_record(model: nn.Module) -> InjectionRecord | None:
    """The record ``inject_lora`` left on ``model``, or ``None`` if it has no adapter."""
    return getattr(model, _STATE, None)


def adapter_for(module: nn.Module) -> type[LoRALinear] | None:
    """The LoRA module type that wraps ``module``, or ``None`` when loralei cannot adapt it."""
    return LoRALinear if is_bnb_linear4bit(module) or is_fp8_linear(module) else ADAPTERS.get(type(module))


def replace_module(model: nn.Module, name: str, new: nn.Module) -> nn.Module:
    """Puts ``new`` at ``name`` in ``model``; returns its parent."""
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name)
    setattr(parent, child, new)
    return parent


def pattern_hits(name: str, patterns: list[str] | str) -> list[str]:
    """The entries of ``patterns`` that select module ``name`` (PEFT's rules: suffix list or full-match regex)."""
    if isinstance(patterns, str):
        return [patterns] if re.fullmatch(patterns, name) else []
    return [p for p in patterns if name == p or name.endswith("." + p)]


def _layer_index(name: str, layers_pattern: str | None) -> int | None:
    pattern = re.escape(layers_pattern) if layers_pattern else r"[^.]+"
    found = re.search(rf"(?:^|\.){pattern}\.(\d+)(?:\.|$)", name)
    return int(found.group(1)) if found else None


def _output_head(model: nn.Module) -> nn.Module | None:
    get = getattr(model, "get_output_embeddings", None)
    return get() if callable(get) else None


def find_targets(model: nn.Module, config: LoRAConfig, strict: bool = True) -> list[str]:
    """Names of the modules ``config`` selects in ``model``.

    Args:
        model: the model to search.
        config: selects modules by ``target_modules``, ``exclude_modules``, ``layers_to_transform``.
        strict: every entry of a ``target_modules`` list must select at least one module.

    Returns:
        Module names in model order.

    Raises:
        InjectionError: nothing matches, a list entry matches nothing (strict), or a selected module has a
            type loralei cannot adapt.
    """
    if config.target_modules is None:
        return []
    head = _output_head(model)
    targets, used = [], set()
    for name, module in model.named_modules():
        if not name:
            continue
        if config.target_modules == ALL_LINEAR:
            hits = [ALL_LINEAR] if isinstance(module, nn.Linear) and module is not head else []
        else:
            hits = pattern_hits(name, config.target_modules)
        if not hits or not _selected(name, config):
            continue
        if adapter_for(module) is None:
            raise InjectionError(
                f"module '{name}' matches target {hits[0]!r} but is a {type(module).__name__}; loralei adapts "
                f"{', '.join(t.__name__ for t in ADAPTERS)}, bitsandbytes Linear4bit and Transformers' fine-grained "
                "FP8Linear modules: target its linear projections instead"
            )
        targets.append(name)
        used.update(hits)
    _check_targets_found(model, config, targets, used, strict)
    return targets


def _selected(name: str, config: LoRAConfig) -> bool:
    """Whether module ``name`` passes ``exclude_modules`` and ``layers_to_transform``."""
    if config.exclude_modules and pattern_hits(name, config.exclude_modules):
        return False
    layers = config.layers_to_transform
    return layers is None or _layer_index(name, config.layers_pattern) in layers


def find_parameter_targets(
    model: nn.Module, config: LoRAConfig, strict: bool = True
) -> dict[str, tuple[str, ...]]:
    """The expert banks ``config.target_parameters`` selects: experts-module name → bank names (in the
    module's parameter order). Entries match full parameter names by suffix, as PEFT's do.

    Raises:
        InjectionError: an entry selects a parameter that is not a bank of an experts module, selects nothing
            (strict), or (with ``quantize_base``) only one bank of a module is selected.
    """
    if not config.target_parameters:
        return {}
    targets: dict[str, tuple[str, ...]] = {}
    used: set[str] = set()
    for module_name, module in model.named_modules():
        for pname, param in module.named_parameters(recurse=False):
            full = f"{module_name}.{pname}" if module_name else pname
            hits = pattern_hits(full, config.target_parameters)
            if not hits or not _selected(module_name, config):
                continue
            layout = experts_layout(module)
            if layout is None or pname not in (layout.up, layout.down):
                raise InjectionError(
                    f"target_parameters entry {hits[0]!r} selects '{full}' (shape {tuple(param.shape)} in a "
                    f"{type(module).__name__}), which is not a 3-D expert bank of an MoE experts module "
                    "(gate_up_proj / up_proj / down_proj called as experts(hidden_states, top_k_index, "
                    "top_k_weights)); target linear layers with target_modules instead"
                )
            targets[module_name] = (*targets.get(module_name, ()), pname)
            used.update(hits)
    _check_parameters_found(model, config, used, strict)
    if config.quantize_base:
        for name, banks in targets.items():
            if len(banks) == 1:
                raise InjectionError(
                    f"quantize_base packs both banks of an experts module, but target_parameters selects only "
                    f"'{name}.{banks[0]}'; add the other bank to target_parameters"
                )
            module = model.get_submodule(name)
            for bank in banks:
                check_bank_quantizable(f"{name}.{bank}", getattr(module, bank).shape, config)
    return targets


def _check_parameters_found(model: nn.Module, config: LoRAConfig, used: set[str], strict: bool) -> None:
    banks = sorted(
        {
            f"{n.rpartition('.')[2]}.{p}"
            for n, m in model.named_modules()
            if (lay := experts_layout(m))
            for p in (lay.up, lay.down)
        }
    )
    for entry in config.target_parameters:
        if entry not in used and (strict or not used):
            where = (
                f"expert banks in this model are e.g. {banks[:4]}"
                if banks
                else "this model has no MoE experts module"
            )
            raise InjectionError(
                f"target_parameters entry {entry!r} matches no expert bank{did_you_mean(entry, banks)}; {where}"
            )


def _check_targets_found(
    model: nn.Module, config: LoRAConfig, targets: list[str], used: set[str], strict: bool
) -> None:
    leaf_names = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)})
    if not targets:
        raise InjectionError(
            f"no module matches target_modules={config.target_modules!r} "
            f"(exclude_modules={config.exclude_modules!r}, layers_to_transform={config.layers_to_transform!r}); "
            f"linear modules in this model are named e.g. {leaf_names[:12]}"
        )
    if strict and isinstance(config.target_modules, list):
        for entry in config.target_modules:
            if entry not in used:
                raise InjectionError(
                    f"target_modules entry {entry!r} matches no module{did_you_mean(entry, leaf_names)}; "
                    f"linear modules in this model are named e.g. {leaf_names[:12]}"
                )


def _fp8_dtype(model: nn.Module, targets: list[str]) -> torch.dtype | None:
    """The compute dtype of a model with fine-grained FP8Linear targets (their LoRA factors take it), else
    ``None``."""
    if any(is_fp8_linear(model.get_submodule(name)) for name in targets):
        return compute_dtype(model)
    return None


def _adapt(base: nn.Module, config: LoRAConfig, fp8_dtype: torch.dtype | None) -> LoRALinear:
    """The LoRA module replacing ``base``; a fine-grained FP8Linear is first taken as an ``nn.Linear`` holding its
    codes and block scales, computing in ``fp8_dtype``."""
    if fp8_dtype is not None and is_fp8_linear(base):
        base = as_linear(base, fp8_dtype)
    return adapter_for(base)(base, config)


def inject_lora(model: nn.Module, config: LoRAConfig, strict: bool = True) -> nn.Module:
    """Adds LoRA to the modules ``config`` selects, in place, and freezes every other parameter.

    Bases loaded quantized are kept as they are, with or without ``quantize_base``: bitsandbytes 4-bit
    ``Linear4bit`` weights, and the FP8 codes and 128x128 block scales of Transformers' fine-grained ``FP8Linear``
    (the LoRA factors then take the dtype of the model's other parameters).

    Also makes the input embeddings' output require grad, so that reentrant gradient checkpointing still
    backpropagates into the adapters when the embeddings are frozen.

    Args:
        model: a Transformers (or any torch) model.
        config: the adapter settings.
        strict: every entry of a ``target_modules`` list must match some module.

    Returns:
        ``model`` itself.

    Raises:
        InjectionError: the model already has LoRA, the targets are wrong (see :func:`find_targets`), or a base
            cannot be packed or taken as it is (see ``loralei.modules.quantized.check_quantizable``).
    """
    existing = [name for name, _ in lora_modules(model)] + [name for name, _ in lora_expert_modules(model)]
    if existing:
        raise InjectionError(
            f"model already has LoRA in {len(existing)} modules (e.g. '{existing[0]}'); loralei keeps one adapter "
            "per model: use load_pretrained to load weights into it, or merge_and_unload_lora(model) first"
        )
    targets = find_targets(model, config, strict=strict)
    expert_targets = find_parameter_targets(model, config, strict=strict)
    for name in targets:  # every check before the first module changes
        check_quantizable(name, model.get_submodule(name), config)
        check_principal(name, model.get_submodule(name), config.init_lora_weights, config.r)
    fp8_dtype = _fp8_dtype(model, targets)
    requires_grad = {name: p.requires_grad for name, p in model.named_parameters()}
    model.requires_grad_(False)
    for name in targets:
        replace_module(model, name, _adapt(model.get_submodule(name), config, fp8_dtype))
    for name, banks in expert_targets.items():
        replace_module(model, name, LoRAExperts(model.get_submodule(name), banks, config))
    add_hooks = hasattr(model, "enable_input_require_grads") and not getattr(
        model, "_require_grads_hooks", None
    )
    if add_hooks:
        model.enable_input_require_grads()
    setattr(model, _STATE, InjectionRecord(config, requires_grad, add_hooks))
    logger.info(
        "loralei: %s r=%d in %d modules and %d experts modules; %s",
        "DoRA" if config.use_dora else "LoRA",
        config.r,
        len(targets),
        len(expert_targets),
        count_parameters(model),
    )
    return model


def drop_input_grad_hooks(model: nn.Module) -> None:
    """Removes the hooks ``inject_lora`` added (if it did) that make the input embeddings' output require a
    gradient.

    Reentrant gradient checkpointing needs them (a checkpointed layer whose input needs no gradient would get no
    backward); without it they only make the backward form the first layer's input gradient, which nothing
    reads (with frozen embeddings).
    """
    record = injection_record(model)
    if record is None or not record.added_input_grad_hooks:
        return
    model.disable_input_require_grads()
    setattr(model, _STATE, record._replace(added_input_grad_hooks=False))


def remove_injection_record(model: nn.Module) -> None:
    """Restores the pre-injection ``requires_grad`` flags and hooks, and forgets the injection."""
    record = injection_record(model)
    if record is None:
        return
    for name, p in model.named_parameters():
        p.requires_grad_(record.requires_grad.get(name, False))
    if record.added_input_grad_hooks:
        model.disable_input_require_grads()
    delattr(model, _STATE)
