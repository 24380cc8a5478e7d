"""Folding adapters into the base weights, undoing it bit for bit, and switching them off.

How ``unmerge_lora`` is exact: ``W + ΔW - ΔW`` rounds differently from ``W`` in bf16 (and in fp32), so
``merge_lora`` keeps a copy of each merged base weight in host memory and ``unmerge_lora`` copies it back. The
cost is one host-RAM copy of every adapted base weight while merged (Llama-3-8B, all-linear, bf16: about
13 GiB of host RAM, no GPU memory). ``merge_lora(model, unload=True)`` (= ``merge_and_unload_lora``) keeps no
copy and is not reversible.

A quantized base (NF4, bitsandbytes 4-bit) is dequantized, the update added in FP32, and the module then holds
a dense merged weight in the compute dtype; the packed Parameter itself is kept aside (it is small) and put back
by ``unmerge_lora``, so the packed bytes are restored exactly.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from .errors import InjectionError
from .inject import lora_modules, remove_injection_record
from .modules.lora_linear import LoRALinear


def _require_lora(model: nn.Module) -> list[tuple[str, LoRALinear]]:
    found = list(lora_modules(model))
    if not found:
        raise InjectionError("model has no LoRA modules; call inject_lora or load_pretrained first")
    return found


def _check_not_tied(model: nn.Module, modules: list[tuple[str, LoRALinear]]) -> None:
    """Merging into a weight shared with another module (tied embeddings) would change that module too."""
    owners: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(p), []).append(name)
    for name, module in modules:
        if len(owners[id(module.weight)]) > 1:
            raise InjectionError(
                f"cannot merge into '{name}': its weight is shared with {owners[id(module.weight)]} (tied "
                "weights), so merging would change those modules too; untie the weights or keep the adapter unmerged"
            )


@torch.no_grad()
def _merge_one(module: LoRALinear, keep_original: bool) -> None:
    if module.merged:
        return
    quant = module.quant
    if quant is not None:  # a dense merged weight replaces the packed one, which is kept aside as it is
        # object.__setattr__: nn.Module would register a Parameter value as a second parameter of the module
        object.__setattr__(module, "_original_weight", module.weight if keep_original else None)
        merged = quant.dequantize().float() + module.delta_weight().to(quant.device)
        module.weight = nn.Parameter(merged.to(quant.dtype), requires_grad=False)
        module.merged = True
        return
    if keep_original:
        module._original_weight = module.weight.detach().to("cpu", copy=True)
    merged = module.weight.float() + module.delta_weight().to(module.weight.device)
    module.weight.copy_(merged.to(module.weight.dtype))
    module.merged = True


def _unload_one(model: nn.Module, name: str, module: LoRALinear) -> None:
    plain = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None, device="meta")
    plain.weight = module.weight
    plain.bias = module.bias
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name), child, plain)


def merge_lora(model: nn.Module, unload: bool = False) -> nn.Module:
    """Folds every adapter into its base weight (in FP32, rounded once to the weight's dtype).

    Args:
        model: a model with LoRA.
        unload: also replace each LoRA module by a plain ``nn.Linear`` holding the merged weight, drop the
            adapters and restore the ``requires_grad`` flags the model had before ``inject_lora``.

    Returns:
        ``model``.

    Raises:
        InjectionError: the model has no LoRA.
    """
    modules = _require_lora(model)
    _check_not_tied(model, modules)
    for name, module in modules:
        _merge_one(module, keep_original=not unload)
        if unload:
            _unload_one(model, name, module)
    if unload:
        remove_injection_record(model)
    return model


def merge_and_unload_lora(model: nn.Module) -> nn.Module:
    """``merge_lora(model, unload=True)``: returns a plain Transformers model with the update folded in."""
    return merge_lora(model, unload=True)


@torch.no_grad()
def unmerge_lora(model: nn.Module) -> nn.Module:
    """Restores the exact base weights saved by ``merge_lora``; adapters that are not merged are left alone.

    Raises:
        InjectionError: the model has no LoRA.
    """
    for _, module in _require_lora(model):
        original = module._original_weight
        if not module.merged or original is None:
            continue
        if isinstance(original, nn.Parameter):  # the packed Parameter of a quantized base
            module.weight = original
        else:
            module.weight.copy_(original.to(module.weight.device))
        module._original_weight = None
        module.merged = False
    return model


@contextmanager
def disable_lora(model: nn.Module) -> Iterator[nn.Module]:
    """Context manager in which the model computes its base outputs only.

    Raises:
        InjectionError: the model has no LoRA, or its adapters are merged (call ``unmerge_lora`` first).
    """
    modules = [m for _, m in _require_lora(model)]
    if any(m.merged for m in modules):
        raise InjectionError("adapters are merged into the base weights; call unmerge_lora(model) first")
    previous = [m.disabled for m in modules]
    for m in modules:
        m.disabled = True
    try:
        yield model
    finally:
        for m, was in zip(modules, previous, strict=True):
            m.disabled = was
