"""Checking a pre-quantized checkpoint before anything is read: its quantization config (:func:`spec_of`) and
each quantized linear's tensors, by their shapes and dtypes (:func:`check_linear`), against the format's
definition (:mod:`.checkpoint_formats`). Every refusal names the field or tensor, the value, and what to do."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import torch

from ...errors import ConfigError
from .checkpoint_formats import FORMATS, Dims, Format, QuantSpec

_GPTQ_FORMATS = {"gptq": 1, "gptq_v2": 0}  # checkpoint_format -> what is added to each stored zero point
_FIX = "use a 4-bit GPTQ, AWQ (GEMM) or ModelOpt NVFP4 checkpoint, or the model's unquantized weights"


class TensorMeta(NamedTuple):
    """A stored tensor's shape and dtype, read without its data."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def _field(qc: Mapping[str, Any], source: str, key: str, value: Any, wanted: str) -> ConfigError:
    return ConfigError(f"{source}: quantization_config.{key}={value!r}, but loralei reads {wanted}; {_FIX}")


def _group_size(qc: Mapping[str, Any], source: str, allow_whole: bool) -> int:
    size = qc.get("group_size", 128)
    if isinstance(size, bool) or not isinstance(size, int) or not (size > 0 or (allow_whole and size == -1)):
        raise _field(
            qc, source, "group_size", size, "a positive group size" + (" or -1" if allow_whole else "")
        )
    return size


def _four_bits(qc: Mapping[str, Any], source: str, key: str) -> None:
    if qc.get(key, 4) != 4:
        raise _field(qc, source, key, qc.get(key), "4-bit codes (bits=4)")


def _gptq(qc: Mapping[str, Any], source: str) -> QuantSpec:
    _four_bits(qc, source, "bits")
    layout = str(qc.get("checkpoint_format") or qc.get("format") or "gptq").lower()
    if layout not in _GPTQ_FORMATS:
        raise _field(qc, source, "checkpoint_format", layout, "the 'gptq' (v1) and 'gptq_v2' layouts")
    return QuantSpec("gptq", _group_size(qc, source, True), bool(qc.get("desc_act")), _GPTQ_FORMATS[layout])


def _awq(qc: Mapping[str, Any], source: str) -> QuantSpec:
    _four_bits(qc, source, "bits")
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise _field(qc, source, "version", version, "AWQ's GEMM layout (version='gemm')")
    if qc.get("zero_point", True) is not True:
        raise _field(qc, source, "zero_point", qc.get("zero_point"), "AWQ with zero points (zero_point=true)")
    return QuantSpec("awq", _group_size(qc, source, False))


def _modelopt(qc: Mapping[str, Any], source: str) -> QuantSpec:
    algo = qc.get("quant_algo")
    if algo != "NVFP4":
        raise _field(qc, source, "quant_algo", algo, "ModelOpt's NVFP4 (quant_algo='NVFP4')")
    if qc.get("group_size", 16) != 16:
        raise _field(qc, source, "group_size", qc.get("group_size"), "NVFP4's blocks of 16 (group_size=16)")
    return QuantSpec("nvfp4", 16)


_METHODS = {"gptq": _gptq, "awq": _awq, "modelopt": _modelopt}


def spec_of(quantization_config: Mapping[str, Any] | None, source: str) -> QuantSpec | None:
    """The checked settings of a checkpoint that loralei reads itself, or ``None`` for any other (unquantized, or a
    method Transformers loads: bitsandbytes, fine-grained FP8, ...).

    Args:
        quantization_config: the ``quantization_config`` of the checkpoint's ``config.json``.
        source: how messages name the checkpoint, e.g. ``"model.name_or_path '/ckpt'"``.

    Raises:
        ConfigError: a GPTQ, AWQ or ModelOpt config loralei cannot read (bits other than 4, a group size that is
            not positive, another GPTQ layout or AWQ version, AWQ without zero points, another ModelOpt algorithm).
    """
    if not quantization_config:
        return None
    method = str(quantization_config.get("quant_method", "")).lower()
    parse = _METHODS.get(method)
    return None if parse is None else parse(quantization_config, source)


def _divisibility(fmt: Format, spec: QuantSpec, name: str, dims: Dims) -> str | None:
    """Why the dims cannot hold the format's packing and groups, or ``None``."""
    per_out, per_in = fmt.packing
    if dims.out % per_out or dims.inp % per_in:
        return (
            f"its ({dims.out}, {dims.inp}) weight does not split into {fmt.title}'s packed codes ({per_out} per "
            f"element along the outputs, {per_in} along the inputs)"
        )
    if spec.group_size != -1 and dims.inp % spec.group_size:
        return f"group_size={spec.group_size} does not divide its {dims.inp} input features"
    return None


def check_linear(
    source: str, name: str, spec: QuantSpec, dims: Dims, metas: Mapping[str, TensorMeta]
) -> None:
    """Refuses a quantized linear whose tensors do not follow ``spec``'s format, before anything is read.

    Args:
        source: how messages name the checkpoint.
        name: the linear module's name.
        spec: the checkpoint's settings.
        dims: the model's (out, in) for the module and the groups ``spec`` gives it.
        metas: the shape and dtype of each of the module's stored tensors, by part name (``"qweight"``, ...).

    Raises:
        ConfigError: a required tensor missing (``g_idx`` with act-order included), dims that the packing or the
            group size does not divide, or a tensor whose shape or dtype is not the one the config implies.
    """
    fmt = FORMATS[spec.method]
    where = f"{source}: {fmt.title} linear {name!r}"
    if (why := _divisibility(fmt, spec, name, dims)) is not None:
        raise ConfigError(f"{where}: {why}; the checkpoint's quantization_config does not match its tensors")
    for part in fmt.parts:
        meta = metas.get(part.name)
        if meta is None:
            if part.required or (part.name == "g_idx" and spec.act_order):
                why = " (desc_act=true: act-order needs each input's group)" if part.name == "g_idx" else ""
                raise ConfigError(f"{where} has no tensor {part.name!r}{why}; the checkpoint is incomplete")
            continue
        want = part.shape(dims)
        if tuple(meta.shape) not in (want, (1,) if want == () else want) or meta.dtype not in part.dtypes:
            raise ConfigError(
                f"{where}: {part.name} is {tuple(meta.shape)} {meta.dtype}, but quantization_config "
                f"(group_size={spec.group_size}) makes it {want} of {' or '.join(map(str, part.dtypes))} for a "
                f"({dims.out}, {dims.inp}) weight; the checkpoint's quantization_config does not match its tensors"
            )


def check_group_index(source: str, name: str, g_idx: torch.Tensor, groups: int) -> None:
    """Refuses a GPTQ ``g_idx`` (read, before the weight is made) that names a group the scales do not have.

    Raises:
        ConfigError: a value outside ``[0, groups)``.
    """
    low, high = int(g_idx.min()), int(g_idx.max())
    if low < 0 or high >= groups:
        raise ConfigError(
            f"{source}: GPTQ linear {name!r}: g_idx holds groups {low}..{high}, but its scales have {groups} "
            "groups (quantization_config.group_size); the checkpoint's quantization_config does not match its tensors"
        )
