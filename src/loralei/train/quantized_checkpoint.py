"""Reading a GPTQ, AWQ or ModelOpt NVFP4 checkpoint without the packages that write them.

Transformers needs a compiled GPTQ or AWQ package to load these checkpoints (and loads no pre-quantized NVFP4
one), so the runner reads them itself, one decoder layer at a time (:mod:`.layered_load`): the model is built
from its config with the quantization config removed, on the meta device, and each linear whose tensors the
checkpoint stores quantized (``<linear>.qweight`` for GPTQ / AWQ, ``<linear>.weight_scale`` for NVFP4) gets a
frozen :class:`loralei.modules.quantized.checkpoint_tensor.CheckpointTensor` holding those tensors as they are.
An NVFP4 checkpoint's per-expert linears become the packed expert banks the model holds, still 4-bit
(:mod:`.quantized_banks`), which the adapter must target (``lora.target_parameters``): they compute through the
expert LoRA op only. Everything else (embeddings, norms, a head that was left unquantized) is read as usual.

:func:`plan` checks every quantized linear's tensors against the config (shapes and dtypes from the files'
headers) before anything is read. Injection then adopts the adapter's targets as quantized bases; the
quantized linears it does not target stay ``nn.Linear`` modules whose forward dequantizes on the fly.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..config import LoRAConfig
from ..errors import ConfigError
from ..inject import find_parameter_targets
from ..modules.principal_init import is_principal
from ..modules.quantized.checkpoint_checks import check_group_index, check_linear, spec_of
from ..modules.quantized.checkpoint_formats import FORMATS, Dims, QuantSpec, groups_of
from ..modules.quantized.checkpoint_tensor import CheckpointTensor
from .layered_load import SafetensorsDirectory, load_by_layers, mismatch
from .quantized_banks import BankPlan, plan_banks, stack_bank


def checkpoint_spec(config: Any, source: str) -> QuantSpec | None:
    """The checked quantization settings of a checkpoint loralei reads itself (GPTQ, AWQ, NVFP4), or ``None``.

    Raises:
        ConfigError: a GPTQ, AWQ or ModelOpt quantization config loralei cannot read (see
            :func:`loralei.modules.quantized.checkpoint_checks.spec_of`).
    """
    qc = getattr(config, "quantization_config", None)
    if qc is not None and not isinstance(qc, dict):
        qc = qc.to_dict()
    return spec_of(qc, source)


def without_quantization(config: Any) -> Any:
    """A copy of a model config without its quantization config, to build the model's dense skeleton."""
    config = copy.deepcopy(config)
    del config.quantization_config
    return config


def plan(
    model: nn.Module,
    files: SafetensorsDirectory,
    spec: QuantSpec,
    source: str,
    banked: frozenset[str] = frozenset(),
) -> dict[str, tuple[str, ...]]:
    """The quantized linears of the checkpoint and the parts each stores, checked against ``spec``.

    Args:
        model: the model built from the config (on the meta device).
        files: the checkpoint's safetensors files.
        spec: the checkpoint's quantization settings.
        source: how messages name the checkpoint.
        banked: the per-expert linears that make the model's expert banks (:func:`.quantized_banks.plan_banks`).

    Returns:
        Linear module name -> the part names it stores (in the format's order).

    Raises:
        ConfigError: no tensor of the format at all, quantized tensors of a module that is not a linear of the
            model, or tensors that do not follow the config (see ``check_linear``).
    """
    fmt = FORMATS[spec.method]
    names = files.names()
    suffix = f".{fmt.marker}"
    linears = {}
    for name in sorted(n.removesuffix(suffix) for n in names if n.endswith(suffix)):
        if name in banked:
            continue
        module = model.get_submodule(name) if _has_module(model, name) else None
        if type(module) is not nn.Linear:
            raise ConfigError(
                f"{source}: the checkpoint stores {fmt.title} tensors for {name!r}, which is "
                f"{'not a module' if module is None else 'a ' + type(module).__name__} of this model, not a linear "
                "layer; check that config.json is the checkpoint's own"
            )
        parts = tuple(p.name for p in fmt.parts if f"{name}.{p.name}" in names)
        metas = files.metadata(f"{name}.{p}" for p in parts)
        dims = Dims(module.out_features, module.in_features, groups_of(spec, module.in_features))
        check_linear(source, name, spec, dims, {p: metas[f"{name}.{p}"] for p in parts})
        linears[name] = parts
    if not linears and not banked:
        raise ConfigError(
            f"{source}: quantization_config says {fmt.title}, but the checkpoint has no tensor named "
            f"'*{suffix}'; the checkpoint's quantization_config does not match its tensors"
        )
    return linears


def _has_module(model: nn.Module, name: str) -> bool:
    try:
        model.get_submodule(name)
    except AttributeError:
        return False
    return True


class QuantizedSource:
    """The checkpoint's tensors as the model names them (a :class:`.layered_load.TensorSource`): each quantized
    linear's stored tensors read as one ``CheckpointTensor`` named ``<linear>.weight``, each quantized expert bank's
    per-expert tensors as one 3-D ``CheckpointTensor`` named ``<experts>.<bank>``.

    Args:
        files: the checkpoint's safetensors files.
        spec: its quantization settings.
        linears: what :func:`plan` returned.
        banks: what :func:`.quantized_banks.plan_banks` returned.
        model: the model being filled (for each linear's and bank's dense shape).
        dtype: the dtype the quantized weights compute in (the model's).
        source: how messages name the checkpoint.
    """

    def __init__(
        self,
        files: SafetensorsDirectory,
        spec: QuantSpec,
        linears: dict[str, tuple[str, ...]],
        banks: dict[str, BankPlan],
        model: nn.Module,
        dtype: torch.dtype,
        source: str,
    ) -> None:
        self.files, self.spec, self.linears, self.dtype, self.source = files, spec, linears, dtype, source
        self.banks, self.held = banks, files.names()
        self.shapes = {name: model.get_submodule(name).weight.shape for name in linears}
        self.shapes |= {name: model.get_parameter(name).shape for name in banks}
        self.kept = [p.name for p in FORMATS[spec.method].parts if p.kept]

    def _bank_parts(self, bank: str, kept_only: bool) -> list[str]:
        """The stored tensors of ``bank``'s per-expert linears (only those the weight keeps, or all of them)."""
        parts = self.kept if kept_only else [p.name for p in FORMATS[self.spec.method].parts]
        linears = self.banks[bank].linears(bank)
        return [n for linear in linears for p in parts if (n := f"{linear}.{p}") in self.held]

    def names(self) -> set[str]:
        stored = {f"{name}.{part}" for name, parts in self.linears.items() for part in parts}
        stored |= {n for bank in self.banks for n in self._bank_parts(bank, kept_only=False)}
        return (self.files.names() - stored) | {f"{name}.weight" for name in self.linears} | set(self.banks)

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        quantized = [n.removesuffix(".weight") for n in names if n.removesuffix(".weight") in self.linears]
        banks = [n for n in names if n in self.banks]
        plain = [n for n in names if n.removesuffix(".weight") not in quantized and n not in self.banks]
        out = self.files.read(plain)
        for name in quantized:
            stored = self.files.read([f"{name}.{p}" for p in self.linears[name] if p in self.kept])
            out[f"{name}.weight"] = self._weight(name, {k.rpartition(".")[2]: t for k, t in stored.items()})
        for name in banks:
            stored = self.files.read(self._bank_parts(name, kept_only=True))
            out[name] = stack_bank(stored, name, self.banks[name], self.shapes[name], self.spec, self.dtype)
        return out

    def _weight(self, name: str, parts: dict[str, torch.Tensor]) -> CheckpointTensor:
        """One linear's stored tensors as its frozen weight (a one-element global scale as a scalar)."""
        shape = self.shapes[name]
        if "g_idx" in parts:
            check_group_index(self.source, name, parts["g_idx"], groups_of(self.spec, shape[1]))
        if "weight_scale_2" in parts:
            parts["weight_scale_2"] = parts["weight_scale_2"].reshape(())
        return CheckpointTensor(parts, self.spec, shape, self.dtype)


def refuse_options(lora: LoRAConfig, spec: QuantSpec, source: str) -> None:
    """Refuses adapter settings that a quantized checkpoint cannot honour.

    Raises:
        ConfigError: ``lora.quantize_base`` (the linears are kept quantized as stored), ``lora.target_parameters``
            but for NVFP4 (expert banks of GPTQ and AWQ checkpoints are not read) or a PiSSA/OLoRA
            ``lora.init_lora_weights`` (a stored quantized weight cannot be rewritten as the residual).
    """
    title = FORMATS[spec.method].title
    if is_principal(lora.init_lora_weights):
        raise ConfigError(
            f"lora.init_lora_weights: {lora.init_lora_weights!r}, but {source} is a {title} checkpoint: its linears "
            "are kept quantized as stored and cannot be rewritten as the PiSSA/OLoRA residual; train from the "
            "unquantized model (with lora.quantize_base: true to pack the residual), or use init_lora_weights: true"
        )
    fields = ("quantize_base",) if spec.method == "nvfp4" else ("quantize_base", "target_parameters")
    for field in fields:
        if value := getattr(lora, field):
            raise ConfigError(
                f"lora.{field}: {value!r}, but {source} is a {title} checkpoint: its linears are kept quantized as "
                f"stored and its expert banks are not adapted; remove lora.{field}"
            )


def load(
    model: nn.Module,
    files: SafetensorsDirectory,
    spec: QuantSpec,
    lora: LoRAConfig,
    dtype: torch.dtype,
    source: str,
    check_targets: Callable[[nn.Module, LoRAConfig], None],
) -> None:
    """Fills ``model`` (built without the quantization config, on the meta device) from a quantized checkpoint,
    one decoder layer at a time, its quantized linears as ``CheckpointTensor`` weights computing in ``dtype``.

    Raises:
        ConfigError: what :func:`plan` refuses, or tensors the model does not name as the checkpoint does;
            ``check_targets``'s errors; quantized expert banks that ``lora.target_parameters`` does not select;
            all before any tensor is read.
    """
    banks = plan_banks(model, files.names(), files.metadata, spec, source)
    banked = frozenset(linear for bank, p in banks.items() for linear in p.linears(bank))
    linears = plan(model, files, spec, source, banked)
    tensors = QuantizedSource(files, spec, linears, banks, model, dtype, source)
    if (why := mismatch(model, tensors)) is not None:
        title = FORMATS[spec.method].title
        raise ConfigError(
            f"{source}: loralei reads {title} checkpoints whose tensors the model names, but {why}"
        )
    check_targets(model, lora)
    _require_adapted(model, lora, banks, source)
    load_by_layers(model, tensors, lora, torch.device("cpu"))


def _require_adapted(model: nn.Module, lora: LoRAConfig, banks: dict[str, BankPlan], source: str) -> None:
    """Refuses quantized expert banks that the adapter does not target: they compute through the expert LoRA op
    only (Transformers' experts forward would read their codes as weights).

    Raises:
        ConfigError: a bank that ``lora.target_parameters`` does not select, naming it and the entries to add.
    """
    selected = {f"{m}.{b}" for m, names in find_parameter_targets(model, lora).items() for b in names}
    if missing := [bank for bank in banks if bank not in selected]:
        entries = sorted({".".join(bank.split(".")[-2:]) for bank in missing})
        raise ConfigError(
            f"lora.target_parameters: {lora.target_parameters!r}, but {source} stores the expert bank "
            f"{missing[0]!r} ({len(missing)} in all) as NVFP4, which loralei computes with only through expert "
            f"LoRA; add {entries} to lora.target_parameters"
        )
