"""PEFT's adapter format: loralei's adapter as PEFT names and lays it out, and back.

Linear modules: ``base_model.model.<module>.lora_A.weight`` (r×in) and ``.lora_B.weight`` (out×r), as in memory;
DoRA adds ``base_model.model.<module>.lora_magnitude_vector`` (out,), also as in memory, and ``use_dora: true``.

Expert banks (``target_parameters``): PEFT wraps each adapted bank of an experts module in one ``ParamWrapper``;
several banks of one module are nested, the bank first in the module's parameter order innermost. So with
``gate_up_proj`` and ``down_proj`` both adapted, ``<experts>.base_layer.lora_A.weight`` is ``gate_up_proj``'s and
``<experts>.lora_A.weight`` is ``down_proj``'s; a bank adapted alone is ``<experts>.lora_A.weight``. Each wrapper
holds the factors of all E experts in two matrices::

    lora_A.weight: (E·r, in)   == A.reshape(E·r, in)                 (A: E×r×in, in memory)
    lora_B.weight: (out, r·E)  == B.permute(1, 2, 0).reshape(out, r·E) (B: E×out×r, in memory)

Where PEFT's rules (0.21, Transformers 5) differ from loralei's:

- ``layers_to_transform`` and ``exclude_modules`` apply to ``target_modules`` only: PEFT adapts every bank
  ``target_parameters`` names, in every layer. Exports name exactly the adapted banks (full names when the
  suffixes would select more); imports adapt what PEFT adapted (:func:`config_for_model`).
- With ``target_modules`` unset, which linear modules PEFT adds depends on the architecture (its default table,
  or none); exports write ``[]`` when only banks are adapted, imports read the linear modules from the weights.
- On the MoE model types whose experts Transformers 5 fused (Qwen3-MoE, Mixtral, DeepSeek-V3, ...) PEFT rewrites
  ``target_modules`` for Transformers-4 adapters: a regex becomes the leaf names it matches (all layers), and
  ``gate_proj`` / ``up_proj`` / ``down_proj`` (Mixtral: ``w1`` / ``w2`` / ``w3``) and ``gate`` become expert banks.
  Exports list exact module names there instead of a regex, and refuse linear modules with those leaf names
  (:func:`peft_target_modules`).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .config import LoRAConfig
from .errors import CheckpointError, ConfigError
from .inject import adapted_bank_names, injection_record, lora_expert_modules, lora_modules, pattern_hits
from .modules.lora_experts import LoRAExperts

PEFT_WEIGHTS, PEFT_CONFIG = "adapter_model.safetensors", "adapter_config.json"
PEFT_PREFIX = "base_model.model."
# PEFT config fields loralei cannot honour, with the value that means "not used".
_PEFT_UNSUPPORTED = {
    "bias": "none",
    "modules_to_save": None,
    "rank_pattern": {},
    "alpha_pattern": {},
    "fan_in_fan_out": False,
    "lora_bias": False,
}


def _exact_regex(names: list[str]) -> str:
    """A ``target_modules`` regex that matches exactly ``names`` (PEFT full-matches a string)."""
    return "(" + "|".join(re.escape(n) for n in names) + ")"


def _lora_prefixes(model: nn.Module) -> tuple[str, ...]:
    """Name prefixes of every LoRA factor in ``model`` (not part of the base model)."""
    names = [n for n, _ in lora_modules(model)] + [n for n, _ in lora_expert_modules(model)]
    return tuple(f"{n}.{part}" for n in names for part in ("lora_A", "lora_B"))


def _base_parameter_names(model: nn.Module) -> list[str]:
    """Full names of the base model's parameters, found as PEFT's ``_inject_parameters`` walks them."""
    lora = _lora_prefixes(model)
    return [
        f"{module_name}.{pname}" if module_name else pname
        for module_name, module in model.named_modules()
        if not module_name.startswith(lora)
        for pname, _ in module.named_parameters(recurse=False)
    ]


def _peft_moe_renames(model: nn.Module) -> tuple[str | None, frozenset[str]]:
    """The model type and the ``target_modules`` leaf names PEFT rewrites on it, or ``(type, {})``.

    With Transformers 5, PEFT converts configs of Transformers-4 MoE adapters on the model types whose experts
    Transformers 5 fused (Transformers' ``_MODEL_TO_CONVERSION_PATTERN``, plus Mixtral): it resolves a regex
    ``target_modules`` to the leaf names it matches (so a regex selecting some layers selects all of them), and
    turns the per-expert leaf names below into ``target_parameters`` (``down_proj`` -> the ``down_proj`` bank).
    """
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    try:
        from transformers.conversion_mapping import _MODEL_TO_CONVERSION_PATTERN as patterns
    except ImportError:  # Transformers 4: PEFT converts nothing
        return model_type, frozenset()
    family = "mixtral" if model_type == "mixtral" else patterns.get(model_type)
    return model_type, _PEFT_MOE_LEAVES.get(family, frozenset())


# PEFT's (0.21) per-family names of Transformers-4 expert projections (and the router) it rewrites.
_PEFT_MOE_LEAVES = {
    "mixtral": frozenset({"gate", "w1", "w2", "w3"}),
    "qwen2_moe": frozenset({"gate", "gate_proj", "up_proj", "down_proj"}),
}


def peft_target_modules(model: nn.Module) -> list[str] | str:
    """The smallest PEFT ``target_modules`` that selects exactly the adapted linear modules on the bare model.

    Leaf names (``["q_proj", "v_proj"]``) when they select nothing else; otherwise a full-match regex of the
    exact module names (a list of them on the MoE model types whose regex PEFT widens, see
    :func:`_peft_moe_renames`), so PEFT injects the same modules and reports no missing keys. ``[]`` when only
    expert banks are adapted (``None`` would let PEFT pick default modules for the architecture).

    Raises:
        CheckpointError: a linear module has a leaf name PEFT reads as an expert bank on this model type.
    """
    targets = [name for name, _ in lora_modules(model)]
    model_type, renamed = _peft_moe_renames(model)
    clash = [t for t in targets if t.rsplit(".", 1)[-1] in renamed]
    if clash:
        raise CheckpointError(
            f"format='peft' cannot express LoRA on '{clash[0]}' ({len(clash)} such modules): on {model_type} models "
            f"PEFT reads target_modules entries named {sorted(renamed)} as the fused expert banks (its conversion of "
            "Transformers-4 adapters), so it would adapt the experts instead and drop these weights; save with "
            "format='native', or leave those modules out of target_modules (target the expert banks with "
            "target_parameters)"
        )
    lora = _lora_prefixes(model)
    base_names = [n for n, _ in model.named_modules() if n and not n.startswith(lora)]
    leaves = sorted({t.rsplit(".", 1)[-1] for t in targets})
    selected = [n for n in base_names if pattern_hits(n, leaves)]
    if selected == targets:
        return leaves
    return targets if renamed else _exact_regex(targets)


def peft_target_parameters(model: nn.Module) -> list[str] | None:
    """PEFT ``target_parameters`` naming exactly the adapted expert banks, or ``None`` when there are none.

    Suffixes (``["experts.gate_up_proj"]``) when they select no other parameter of the bare model, otherwise
    the full parameter names (PEFT takes no regex here, and ignores ``layers_to_transform`` for parameters).
    """
    banks = adapted_bank_names(model)
    if not banks:
        return None
    suffixes = sorted({".".join(b.rsplit(".", 2)[-2:]) for b in banks})  # "experts.gate_up_proj"
    selected = [n for n in _base_parameter_names(model) if pattern_hits(n, suffixes)]
    return suffixes if sorted(selected) == sorted(banks) else sorted(banks)


def _wrapper_name(module_name: str, module: LoRAExperts, bank: str) -> str:
    """The module path of PEFT's ``ParamWrapper`` for ``bank``: one ``.base_layer`` per wrapper outside it."""
    depth = len(module.adapted) - 1 - module.adapted.index(bank)
    return module_name + ".base_layer" * depth


def peft_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter of ``model`` under PEFT's names and in PEFT's layouts, on the CPU, contiguous."""
    out = {
        f"{PEFT_PREFIX}{name}.{part}.weight": getattr(module, part).weight
        for name, module in lora_modules(model)
        for part in ("lora_A", "lora_B")
    }
    for name, module in lora_modules(model):
        if module.lora_magnitude_vector is not None:
            out[f"{PEFT_PREFIX}{name}.lora_magnitude_vector"] = module.lora_magnitude_vector
    for name, module in lora_expert_modules(model):
        for bank in module.adapted:
            a, b = module.lora_A[bank], module.lora_B[bank]
            experts, out_f, r = b.shape
            wrapper = PEFT_PREFIX + _wrapper_name(name, module, bank)
            out[f"{wrapper}.lora_A.weight"] = a.reshape(experts * r, a.shape[-1])
            out[f"{wrapper}.lora_B.weight"] = b.permute(1, 2, 0).reshape(out_f, r * experts)
    return {k: v.detach().to("cpu").contiguous() for k, v in out.items()}


def peft_adapter_config(model: nn.Module, base_model_name: str | None) -> dict[str, Any]:
    """The ``adapter_config.json`` of ``model``'s adapter."""
    config = injection_record(model).config
    alpha = int(config.lora_alpha) if float(config.lora_alpha).is_integer() else config.lora_alpha
    data = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": config.r,
        "lora_alpha": alpha,
        "lora_dropout": config.lora_dropout,
        "use_rslora": config.use_rslora,
        "target_modules": peft_target_modules(model),
        "bias": "none",
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "use_dora": config.use_dora,
        "modules_to_save": None,
        "inference_mode": True,
        "base_model_name_or_path": base_model_name,
        "revision": None,
    }
    target_parameters = peft_target_parameters(model)
    if target_parameters is not None:
        data["target_parameters"] = target_parameters
    return data


# --------------------------------------------------------------------------------------------------- reading


def lora_config_from_peft(meta: dict[str, Any], file: Path) -> LoRAConfig:
    """The ``LoRAConfig`` an ``adapter_config.json`` describes, as written (see :func:`config_for_model`).

    Raises:
        CheckpointError: not a LoRA adapter, a PEFT feature loralei does not implement, or invalid values.
    """
    if meta.get("peft_type", "LORA") != "LORA":
        raise CheckpointError(
            f"{file.parent} holds a {meta.get('peft_type')} adapter; loralei loads LoRA adapters only"
        )
    for key, unused in _PEFT_UNSUPPORTED.items():
        if meta.get(key, unused) not in (unused, None, {}, [], False):
            raise CheckpointError(
                f"{file}: {key}={meta[key]!r} is not supported by loralei; "
                "merge that adapter with PEFT or retrain without it"
            )
    layers_pattern = meta.get("layers_pattern")
    target_modules = meta.get("target_modules")
    fields = {
        "r": meta.get("r"),
        "lora_alpha": meta.get("lora_alpha"),
        "lora_dropout": meta.get("lora_dropout", 0.0),
        "use_rslora": meta.get("use_rslora", False),
        "use_dora": meta.get("use_dora", False),
        # [] is PEFT's "no modules, only target_parameters"
        "target_modules": target_modules if target_modules != [] else None,
        "target_parameters": meta.get("target_parameters") or None,
        "exclude_modules": meta.get("exclude_modules"),
        "layers_to_transform": meta.get("layers_to_transform"),
        "layers_pattern": layers_pattern[0] if isinstance(layers_pattern, list) else layers_pattern,
    }
    keep = {k: v for k, v in fields.items() if v is not None}
    if target_modules == [] or fields["target_parameters"]:
        keep["target_modules"] = fields["target_modules"]  # None here means "no linear modules"
    try:
        return LoRAConfig(**keep)
    except ConfigError as exc:
        raise CheckpointError(f"{file} holds a config loralei cannot use:\n{exc}") from None


def config_for_model(
    config: LoRAConfig, meta: dict[str, Any], model: nn.Module, tensors: dict[str, torch.Tensor]
) -> LoRAConfig:
    """``config`` rewritten, where PEFT's rules differ from loralei's, to select what PEFT adapted in ``model``.

    PEFT ignores ``layers_to_transform`` and ``exclude_modules`` for ``target_parameters``, and with
    ``target_modules`` unset adapts per-architecture defaults; in those cases the adapted banks become the exact
    parameter names PEFT's suffix rule selects and the adapted linear modules are read from the weights file
    (its ``<module>.lora_A.weight`` keys), with the filters dropped. Otherwise ``config`` is returned as it is.
    """
    if not config.target_parameters:
        return config
    filtered = config.layers_to_transform is not None or bool(config.exclude_modules)
    if not filtered and meta.get("target_modules") is not None:
        return config
    banks = [n for n in _base_parameter_names(model) if pattern_hits(n, config.target_parameters)]
    expert_modules = {b.rpartition(".")[0] for b in banks}
    dense = sorted(
        name
        for key in tensors
        if key.endswith(".lora_A.weight")
        and (name := key.removesuffix(".lora_A.weight")).replace(".base_layer", "") not in expert_modules
    )
    return LoRAConfig(
        **config.model_dump()
        | {
            "target_modules": _exact_regex(dense) if dense else None,
            "target_parameters": banks or config.target_parameters,  # none: inject_lora names the entry
            "layers_to_transform": None,
            "layers_pattern": None,
            "exclude_modules": None,
        }
    )


def tensors_from_peft(
    model: nn.Module, tensors: dict[str, torch.Tensor], path: Path
) -> dict[str, torch.Tensor]:
    """PEFT's expert-bank tensors (prefix removed) renamed and reshaped to ``model``'s in-memory factors.

    Keys of linear modules are already the in-memory names and pass through; a key the model does not have is
    left as it is, so the caller reports it.

    Raises:
        CheckpointError: a bank's tensor has a shape other than PEFT's layout for the model's bank.
    """
    out = dict(tensors)
    for name, module in lora_expert_modules(model):
        for bank in module.adapted:
            wrapper = _wrapper_name(name, module, bank)
            key_a, key_b = f"{wrapper}.lora_A.weight", f"{wrapper}.lora_B.weight"
            if key_a not in out or key_b not in out:
                continue
            experts, r, in_f = module.lora_A[bank].shape
            out_f = module.lora_B[bank].shape[1]
            for key, want in ((key_a, (experts * r, in_f)), (key_b, (out_f, r * experts))):
                if tuple(out[key].shape) != want:
                    raise CheckpointError(
                        f"adapter {path}: '{key}' ({bank} of {name}) has shape {tuple(out[key].shape)} in the file "
                        f"but PEFT lays this bank out as {want} (experts={experts}, r={r}, in={in_f}, out={out_f}); "
                        "the adapter was trained on a differently sized model or rank"
                    )
            out[f"{name}.lora_A.{bank}"] = out.pop(key_a).reshape(experts, r, in_f)
            out[f"{name}.lora_B.{bank}"] = out.pop(key_b).reshape(out_f, r, experts).permute(2, 0, 1)
    return out
