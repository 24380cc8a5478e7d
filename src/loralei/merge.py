"""Folding adapters into the base weights, undoing it bit for bit, and switching them off.

How ``unmerge_lora`` is exact: ``W + ΔW - ΔW`` rounds differently from ``W`` in bf16 (and in fp32), so
``merge_lora`` keeps a copy of each merged base weight in host memory and ``unmerge_lora`` copies it back. The
cost is one host-RAM copy of every adapted base weight while merged (Llama-3-8B, all-linear, bf16: about
13 GiB of host RAM, no GPU memory). ``merge_lora(model, unload=True)`` (= ``merge_and_unload_lora``) keeps no
copy and is not reversible.

DoRA projections merge as PEFT merges them: ``W' = (m / ‖W + ΔW‖_row) ⊙ (W + ΔW)``, in FP32, rounded once.

A quantized base (NF4, int4, FP8, bitsandbytes 4-bit) is dequantized, the update added in FP32, and the module
then holds a dense merged weight in the compute dtype; the packed Parameter itself is kept aside (it is small)
and put back by ``unmerge_lora``, so the packed bytes (codes and scales) are restored exactly.

Expert banks (``LoRAExperts``) merge the same way, bank by bank (each expert's ``scale·B[e]·A[e]`` added in FP32,
rounded once; a host copy of each merged bank for ``unmerge_lora``). Unloading puts the replaced Transformers
experts module back: its Parameters are the banks' own objects, so it holds the merged values. Quantized (NF4,
NVFP4) banks are not merged: the merged bank would be a dense copy of every expert, so it is refused with the way to get
a merged model instead.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from .errors import InjectionError
from .inject import lora_expert_modules, lora_modules, remove_injection_record, replace_module
from .modules.dora import rescale_merged_
from .modules.lora_experts import LoRAExperts
from .modules.lora_linear import LoRALinear


def _require_lora(model: nn.Module) -> tuple[list[tuple[str, LoRALinear]], list[tuple[str, LoRAExperts]]]:
    """The LoRA linear modules and the LoRA experts modules of ``model``."""
    linear, experts = list(lora_modules(model)), list(lora_expert_modules(model))
    if not linear and not experts:
        raise InjectionError("model has no LoRA modules; call inject_lora or load_pretrained first")
    return linear, experts


def _check_mergeable(
    model: nn.Module, linear: list[tuple[str, LoRALinear]], experts: list[tuple[str, LoRAExperts]]
) -> None:
    """Refuses, before anything changes, weights shared with another module (merging into tied embeddings would
    change that module too) and quantized expert banks."""
    owners: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(p), []).append(name)
    targets = [(name, module.weight) for name, module in linear]
    targets += [
        (f"{name}.{bank}", getattr(module, bank)) for name, module in experts for bank in module.adapted
    ]
    for name, weight in targets:
        if len(owners[id(weight)]) > 1:
            raise InjectionError(
                f"cannot merge into '{name}': its weight is shared with {owners[id(weight)]} (tied "
                "weights), so merging would change those modules too; untie the weights or keep the adapter unmerged"
            )
    for name, module in experts:
        for bank in module.adapted:
            if (quant := module.quant(bank)) is not None:
                kind = quant.backend.partition(",")[0]  # "NF4 expert bank", "NVFP4 checkpoint expert bank"
                raise InjectionError(
                    f"cannot merge into '{name}.{bank}': {kind}s cannot be merged (the merged bank would "
                    "be a dense copy of every expert); merge on a dense copy: load the base in bf16, "
                    "load_pretrained the adapter, merge_and_unload_lora"
                )


def _merged(module: LoRALinear, dense: torch.Tensor) -> torch.Tensor:
    """The merged weight in FP32: ``W + ΔW``, rescaled per row by DoRA's magnitude where the module has one."""
    merged = dense.float() + module.delta_weight().to(dense.device)
    magnitude = module.lora_magnitude_vector
    return merged if magnitude is None else rescale_merged_(merged, magnitude)


@torch.no_grad()
def _merge_one(module: LoRALinear, keep_original: bool) -> None:
    if module.merged:
        return
    quant = module.quant
    if quant is not None:  # a dense merged weight replaces the packed one, which is kept aside as it is
        # object.__setattr__: nn.Module would register a Parameter value as a second parameter of the module
        object.__setattr__(module, "_original_weight", module.weight if keep_original else None)
        merged = _merged(module, quant.dequantize())
        module.weight = nn.Parameter(merged.to(quant.dtype), requires_grad=False)
        module.merged = True
        return
    if keep_original:
        module._original_weight = module.weight.detach().to("cpu", copy=True)
    merged = _merged(module, module.weight)
    module.weight.copy_(merged.to(module.weight.dtype))
    module.merged = True


@torch.no_grad()
def _merge_experts(module: LoRAExperts, keep_original: bool) -> None:
    """Adds each adapted bank's update in FP32 and rounds once; ``_original_banks`` keeps host copies for
    ``unmerge_lora`` (``None`` when not kept)."""
    if module.merged:
        return
    originals = {}
    for bank in module.adapted:
        param = getattr(module, bank)
        if keep_original:
            originals[bank] = param.detach().to("cpu", copy=True)
        merged = module.delta_weight(bank).to(param.device)  # (E, ...) FP32, the bank's layout
        merged.add_(param)
        param.copy_(merged)
        del merged
    module._original_banks = originals if keep_original else None
    module.merged = True


def _unload_one(model: nn.Module, name: str, module: LoRALinear) -> None:
    plain = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None, device="meta")
    plain.weight = module.weight
    plain.bias = module.bias
    replace_module(model, name, plain)


def _unload_experts(model: nn.Module, name: str, module: LoRAExperts) -> None:
    """Puts the replaced Transformers experts module back, holding the LoRAExperts' current Parameters and
    children (the same objects, unless a ``.to()`` after injection swapped them), in its parent's train/eval mode
    (``.train()`` / ``.eval()`` after injection did not reach it)."""
    base = module.base_layer
    for pname, param in module.named_parameters(recurse=False):
        setattr(base, pname, param)
    for cname, child in module.named_children():
        if cname not in ("lora_A", "lora_B"):
            setattr(base, cname, child)
    parent = replace_module(model, name, base)
    base.train(parent.training)


def merge_lora(model: nn.Module, unload: bool = False) -> nn.Module:
    """Folds every adapter into its base weight or expert bank (in FP32, rounded once to the weight's dtype).

    Args:
        model: a model with LoRA.
        unload: also replace each LoRA module by a plain ``nn.Linear`` holding the merged weight (each LoRA
            experts module by the Transformers experts module it replaced), drop the adapters and restore the
            ``requires_grad`` flags the model had before ``inject_lora``.

    Returns:
        ``model``.

    Raises:
        InjectionError: the model has no LoRA, an adapted weight is tied to another module's, or an adapted
            expert bank is quantized (nothing is changed then).
    """
    linear, experts = _require_lora(model)
    _check_mergeable(model, linear, experts)
    for name, module in linear:
        _merge_one(module, keep_original=not unload)
        if unload:
            _unload_one(model, name, module)
    for name, module in experts:
        _merge_experts(module, keep_original=not unload)
        if unload:
            _unload_experts(model, name, module)
    if unload:
        remove_injection_record(model)
    return model


def merge_and_unload_lora(model: nn.Module) -> nn.Module:
    """``merge_lora(model, unload=True)``: returns a plain Transformers model with the update folded in."""
    return merge_lora(model, unload=True)


@torch.no_grad()
def unmerge_lora(model: nn.Module) -> nn.Module:
    """Restores the exact base weights and expert banks saved by ``merge_lora``; adapters that are not merged
    are left alone.

    Raises:
        InjectionError: the model has no LoRA.
    """
    linear, experts = _require_lora(model)
    for _, module in linear:
        original = module._original_weight
        if not module.merged or original is None:
            continue
        if isinstance(original, nn.Parameter):  # the packed Parameter of a quantized base
            module.weight = original
        else:
            module.weight.copy_(original.to(module.weight.device))
        module._original_weight = None
        module.merged = False
    for _, module in experts:
        originals = getattr(module, "_original_banks", None)
        if not module.merged or originals is None:
            continue
        for bank, original in originals.items():
            param = getattr(module, bank)
            param.copy_(original.to(param.device))
        module._original_banks = None
        module.merged = False
    return model


@contextmanager
def disable_lora(model: nn.Module) -> Iterator[nn.Module]:
    """Context manager in which the model computes its base outputs only (linear modules and expert banks).

    Raises:
        InjectionError: the model has no LoRA, or its adapters are merged (call ``unmerge_lora`` first).
    """
    linear, experts = _require_lora(model)
    modules: list[LoRALinear | LoRAExperts] = [m for _, m in linear] + [m for _, m in experts]
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
