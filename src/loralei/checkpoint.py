"""Saving and loading adapters: loralei's native format and PEFT's (which vLLM also loads).

Native: ``loralei_adapter.safetensors`` (in-memory names: ``<module>.lora_A.weight``, and for expert banks
``<experts>.lora_A.<bank>`` (E×r×in) / ``<experts>.lora_B.<bank>`` (E×out×r); with a PiSSA/OLoRA init also
the initial factors ``<module>.lora_A_init`` / ``.lora_B_init``) and ``loralei_config.json``
(format version, the whole ``LoRAConfig``, the adapted module names and expert banks).
PEFT: ``adapter_model.safetensors`` and ``adapter_config.json``, names and layouts as in :mod:`loralei.peft_format`
(adapters on expert banks are checked against PEFT only, not vLLM).
Every save goes to a temporary sibling directory first and is renamed into place.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from .config import LoRAConfig
from .errors import CheckpointError, ConfigError, InjectionError
from .inject import adapted_bank_names, inject_lora, injection_record, lora_modules
from .modules.lora_experts import LoRAExperts
from .modules.lora_linear import LoRALinear
from .modules.principal_init import initial_factors_to_come, is_principal
from .peft_format import (
    PEFT_CONFIG,
    PEFT_PREFIX,
    PEFT_WEIGHTS,
    config_for_model,
    lora_config_from_peft,
    peft_adapter_config,
    peft_tensors,
    tensors_from_peft,
)
from .principal_adapter import (
    as_plain_lora,
    initial_tensors,
    plain_lora_config,
    pop_initial,
    refuse_residual_peft_adapter,
    restore_initial,
)

FORMAT_VERSION = 1
NATIVE_WEIGHTS, NATIVE_CONFIG = "loralei_adapter.safetensors", "loralei_config.json"
_ADAPTER_FILES = {NATIVE_WEIGHTS, NATIVE_CONFIG, PEFT_WEIGHTS, PEFT_CONFIG, "README.md"}


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter tensors of ``model`` under their in-memory names, in model order: ``<module>.lora_A.weight``
    (r×in) and ``.lora_B.weight`` (out×r) for linear modules (with DoRA also ``<module>.lora_magnitude_vector``
    (out,)), ``<experts>.lora_A.<bank>`` (E×r×in) and ``<experts>.lora_B.<bank>`` (E×out×r) for expert banks."""
    tensors: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        if isinstance(module, LoRALinear):
            for part in ("lora_A", "lora_B"):
                tensors[f"{name}.{part}.weight"] = getattr(module, part).weight
            if module.lora_magnitude_vector is not None:
                tensors[f"{name}.lora_magnitude_vector"] = module.lora_magnitude_vector
        elif isinstance(module, LoRAExperts):
            for bank in module.adapted:
                tensors[f"{name}.lora_A.{bank}"] = module.lora_A[bank]
                tensors[f"{name}.lora_B.{bank}"] = module.lora_B[bank]
    return tensors


def _base_model_name(model: nn.Module) -> str | None:
    config = getattr(model, "config", None)
    return getattr(config, "_name_or_path", None) or None


# ---------------------------------------------------------------------------------------------------- saving


def save_pretrained(model: nn.Module, path: str | os.PathLike, format: str = "native") -> Path:
    """Saves the adapter of ``model`` to directory ``path``, atomically.

    Args:
        model: a model with LoRA (from ``inject_lora`` or ``load_pretrained``).
        path: target directory; an existing adapter directory there is replaced as a whole.
        format: ``"native"`` (reloads with the full ``LoRAConfig``) or ``"peft"`` (loads in
            ``peft.PeftModel.from_pretrained`` and vLLM).

    Returns:
        The directory written.

    Raises:
        CheckpointError: unknown format, no adapter, or ``path`` holds files that are not an adapter's.
    """
    writers: dict[str, Callable[[nn.Module, Path], None]] = {"native": _write_native, "peft": _write_peft}
    if format not in writers:
        raise CheckpointError(f"format={format!r} is not known; use 'native' or 'peft'")
    if injection_record(model) is None:
        raise CheckpointError("model has no LoRA adapter to save; call inject_lora or load_pretrained first")
    path = Path(path)
    _atomic_dir(path, lambda tmp: writers[format](model, tmp))
    return path


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _write_native(model: nn.Module, directory: Path) -> None:
    record = injection_record(model)
    tensors = lora_state_dict(model) | initial_tensors(model)  # PiSSA/OLoRA: the initial factors too
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    save_file(tensors, directory / NATIVE_WEIGHTS, metadata={"format": "pt"})
    _write_json(
        directory / NATIVE_CONFIG,
        {
            "format": "loralei",
            "format_version": FORMAT_VERSION,
            # where the weights were packed belongs to that run's machine, not to the adapter (load_pretrained
            # takes it as an argument)
            "lora_config": record.config.model_dump(mode="json") | {"quantization_device": None},
            "target_module_names": [name for name, _ in lora_modules(model)],
            "target_parameter_names": adapted_bank_names(model),
            "base_model_name_or_path": _base_model_name(model),
        },
    )


def _write_peft(model: nn.Module, directory: Path) -> None:
    # PiSSA/OLoRA: a plain LoRA relative to the original base (loralei.principal_adapter)
    save_file(as_plain_lora(model, peft_tensors(model)), directory / PEFT_WEIGHTS, metadata={"format": "pt"})
    _write_json(
        directory / PEFT_CONFIG, plain_lora_config(model, peft_adapter_config(model, _base_model_name(model)))
    )


def _atomic_dir(path: Path, write: Callable[[Path], None]) -> None:
    """Runs ``write`` into a temporary sibling of ``path``, then renames it to ``path``."""
    if path.exists():
        _check_replaceable(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        write(tmp)
        if path.exists():
            old = path.with_name(f".{path.name}.old-{uuid.uuid4().hex[:8]}")
            os.rename(path, old)
            os.rename(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _check_replaceable(path: Path) -> None:
    if not path.is_dir():
        raise CheckpointError(f"{path} exists and is not a directory; choose another path for the adapter")
    foreign = sorted(p.name for p in path.iterdir() if p.name not in _ADAPTER_FILES)
    if foreign:
        raise CheckpointError(
            f"{path} already holds files that are not an adapter's ({foreign[:5]}); refusing to replace it: "
            "save into a new or empty directory"
        )


# --------------------------------------------------------------------------------------------------- loading


def load_pretrained(
    model: nn.Module, path: str | os.PathLike, quantization_device: str | None = None
) -> nn.Module:
    """Loads a native or PEFT adapter directory into ``model``, injecting LoRA first if it has none.

    An adapter trained with ``quantize_base`` packs the dense base weights the same way again while injecting.

    Args:
        model: the base model the adapter was trained on (or the same model with LoRA already injected).
        path: an adapter directory written by ``save_pretrained`` (either format) or by PEFT.
        quantization_device: for an adapter trained on a quantized base, pack each base weight on this device
            (e.g. ``"cuda"`` for a model loaded on the CPU; the packed weight stays there); ``None`` packs each
            weight where it lives.

    Returns:
        ``model``.

    Raises:
        CheckpointError: the directory or a file is missing or corrupt, the adapter does not fit the model
            (a missing or unexpected key, a shape or rank mismatch), or ``quantization_device`` is given for an
            adapter without a quantized base or is not a device.
    """
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"adapter directory {path} does not exist (or is not a directory)")
    peft = False
    if (path / NATIVE_CONFIG).exists():
        config, tensors, adapted = _read_native(path)
    elif (path / PEFT_CONFIG).exists():
        peft, adapted = True, None
        meta = read_json(path / PEFT_CONFIG)
        refuse_residual_peft_adapter(meta, path / PEFT_CONFIG)
        config = lora_config_from_peft(meta, path / PEFT_CONFIG)
        tensors = _read_tensors(path / PEFT_WEIGHTS, PEFT_PREFIX)
        if injection_record(model) is None:
            config = config_for_model(config, meta, model, tensors)
    else:
        found = sorted(p.name for p in path.iterdir())
        raise CheckpointError(
            f"{path} is not an adapter directory: expected {NATIVE_CONFIG} (loralei) or {PEFT_CONFIG} (PEFT), "
            f"found {found[:8]}"
        )
    if quantization_device is not None:
        config = _with_quantization_device(config, quantization_device, path)
    initial = pop_initial(tensors)
    principal = is_principal(config.init_lora_weights) and injection_record(model) is None
    if principal and not initial:
        raise CheckpointError(
            f"adapter {path} was trained with init_lora_weights={config.init_lora_weights!r} but holds no initial "
            "factors, so the residual base cannot be rebuilt; the adapter is incomplete, save it again"
        )
    # PiSSA/OLoRA: the residual is rebuilt from the saved initial factors, not from a second decomposition
    with initial_factors_to_come() if principal else nullcontext():
        _ensure_injected(model, config, path, adapted)
    restore_initial(model, initial, path)
    if peft:
        tensors = tensors_from_peft(model, tensors, path)
    _copy_tensors(model, tensors, path)
    return model


def read_initial_factors(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The PiSSA/OLoRA initial factors a native adapter directory holds (empty for other inits).

    Raises:
        CheckpointError: the weights file is missing or corrupt.
    """
    return pop_initial(_read_tensors(Path(path) / NATIVE_WEIGHTS))


def _with_quantization_device(config: LoRAConfig, device: str, path: Path) -> LoRAConfig:
    if not config.quantize_base:
        raise CheckpointError(
            f"quantization_device={device!r}: adapter {path} was not trained on a quantized base "
            "(quantize_base is false), so nothing is packed; leave quantization_device out"
        )
    try:
        return LoRAConfig(**(config.model_dump() | {"quantization_device": device}))
    except ConfigError as exc:
        raise CheckpointError(f"load_pretrained: {exc}") from None


def read_json(file: Path) -> dict[str, Any]:
    """An adapter directory's JSON file as a dict.

    Raises:
        CheckpointError: the file is unreadable, not JSON, or not a JSON object.
    """
    try:
        data = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(
            f"{file} is not readable JSON ({exc}); the adapter is corrupt, save it again"
        ) from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{file} must hold a JSON object, got {type(data).__name__}")
    return data


def _read_tensors(file: Path, prefix: str = "") -> dict[str, torch.Tensor]:
    if not file.exists():
        raise CheckpointError(f"{file} is missing; the adapter directory is incomplete")
    try:
        tensors = load_file(file)
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(
            f"{file} is not a readable safetensors file ({exc}); the adapter is corrupt"
        ) from None
    return {k.removeprefix(prefix): v for k, v in tensors.items()}


class _Adapted(NamedTuple):
    """What a native adapter records it adapts (``None``: not recorded, by an older loralei)."""

    modules: list[str] | None
    banks: list[str] | None


def _read_native(path: Path) -> tuple[LoRAConfig, dict[str, torch.Tensor], _Adapted]:
    meta = read_json(path / NATIVE_CONFIG)
    version = meta.get("format_version")
    if meta.get("format") != "loralei" or not isinstance(version, int):
        raise CheckpointError(f"{path / NATIVE_CONFIG} has no loralei format header; the adapter is corrupt")
    if version > FORMAT_VERSION:
        raise CheckpointError(
            f"{path} uses adapter format {version}, newer than this loralei reads ({FORMAT_VERSION}); upgrade loralei"
        )
    try:
        config = LoRAConfig(**meta.get("lora_config", {}))
    except ConfigError as exc:
        raise CheckpointError(f"{path / NATIVE_CONFIG} holds an invalid config:\n{exc}") from None
    adapted = _Adapted(meta.get("target_module_names"), meta.get("target_parameter_names"))
    return config, _read_tensors(path / NATIVE_WEIGHTS), adapted


def _ensure_injected(model: nn.Module, config: LoRAConfig, path: Path, adapted: _Adapted | None) -> None:
    record = injection_record(model)
    if record is None:
        try:
            inject_lora(model, config, strict=False)
        except InjectionError as exc:
            raise CheckpointError(f"adapter {path} does not fit this model: {exc}") from None
    else:
        for field in ("r", "lora_alpha", "use_rslora", "use_dora"):
            have, want = getattr(record.config, field), getattr(config, field)
            if have != want:
                raise CheckpointError(
                    f"adapter {path} has {field}={want!r} but the model's adapter has {field}={have!r}; "
                    "load it into a model without LoRA so it is injected with the adapter's settings"
                )
    if adapted is None:
        return
    checks = (
        (adapted.modules, [name for name, _ in lora_modules(model)], "modules"),
        (adapted.banks, adapted_bank_names(model), "expert banks"),
    )
    for want, have, what in checks:
        if want is not None and set(want) != set(have):
            diff = sorted(set(want) ^ set(have))
            raise CheckpointError(
                f"adapter {path} adapts other {what} than this model has LoRA on (e.g. '{diff[0]}'); "
                "load it into the model it was trained on"
            )


@torch.no_grad()
def _copy_tensors(model: nn.Module, tensors: dict[str, torch.Tensor], path: Path) -> None:
    params = lora_state_dict(model)
    missing = sorted(params.keys() - tensors.keys())
    unexpected = sorted(tensors.keys() - params.keys())
    if missing or unexpected:
        raise CheckpointError(
            f"adapter {path} does not match the model: {len(missing)} missing keys (e.g. {missing[:3]}), "
            f"{len(unexpected)} unexpected keys (e.g. {unexpected[:3]})"
        )
    for key, param in params.items():
        if tensors[key].shape != param.shape:
            raise CheckpointError(
                f"adapter {path}: '{key}' has shape {tuple(tensors[key].shape)} in the file but "
                f"{tuple(param.shape)} in the model; the adapter was trained on a differently sized model or rank"
            )
    for key, param in params.items():
        param.copy_(tensors[key].to(param.dtype))
