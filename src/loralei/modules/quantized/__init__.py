"""Quantized frozen bases: one protocol (:class:`loralei.ops.weights.QuantizedWeight`), one implementation per
kind, chosen by a table keyed by ``LoRAConfig.quantization_type`` (quantizing at injection) or by the type of
a weight the model was loaded with (bitsandbytes ``Params4bit``; a fine-grained FP8 checkpoint's codes and block
scales, adopted as a ``Float8Tensor`` by :mod:`.fp8_checkpoint`; a GPTQ, AWQ or NVFP4 checkpoint's tensors, read
by the runner as a :class:`.checkpoint_tensor.CheckpointTensor`, and an NVFP4 checkpoint's expert banks as 3-D
ones, :class:`.checkpoint_bank.CheckpointBank`)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor, nn

from ...config import LoRAConfig
from ...errors import InjectionError, LoraleiError
from ...ops.weights import QuantizedBank, QuantizedWeight
from .bnb import BnbWeight, is_bnb_linear4bit, is_params4bit
from .checkpoint_bank import CheckpointBank
from .checkpoint_tensor import CheckpointTensor
from .checkpoint_weight import CheckpointWeight
from .fake_quant import check_qat
from .fp8 import FP8Weight, check_fp8, quantize_fp8
from .fp8_checkpoint import check_fp8_linear, is_fp8_linear
from .int4 import Int4Weight, check_int4_shape, quantize_int4
from .nf4 import NF4Weight, check_nf4_shape, quantize_nf4, torchao_nf4
from .nf4_bank import NF4Bank, check_nf4_bank


class Quantizer(NamedTuple):
    """How one ``quantization_type`` checks a weight (before anything changes) and packs it.

    ``check`` takes the module name, the weight's shape and the device it will be packed on, and the config.
    """

    check: Callable[[str, torch.Size, torch.device, LoRAConfig], None]
    pack: Callable[[Tensor, LoRAConfig], Tensor]


QUANTIZERS: dict[str, Quantizer] = {
    "nf4": Quantizer(
        check=lambda n, shape, _, c: check_nf4_shape(n, shape, c.nf4_block_size, c.nf4_scaler_block_size),
        pack=lambda w, c: quantize_nf4(w, c.nf4_block_size, c.nf4_scaler_block_size),
    ),
    "int4": Quantizer(
        check=lambda n, shape, _, c: check_int4_shape(n, shape, c.int4_group_size),
        pack=lambda w, c: quantize_int4(w, c.int4_group_size),
    ),
    "fp8": Quantizer(
        check=lambda n, shape, device, c: check_fp8(n, shape, device, c.fp8_kernel),
        pack=lambda w, c: quantize_fp8(w),
    ),
}


def _is_nf4(param: Tensor) -> bool:
    """Whether ``param`` is an ``NF4Tensor`` (TorchAO is imported only if it already is)."""
    return "torchao" in sys.modules and isinstance(param, torchao_nf4().NF4Tensor)


def _is_fp8(param: Tensor) -> bool:
    """Whether ``param`` is TorchAO's ``Float8Tensor`` (there is none before ``torchao.quantization`` is
    imported)."""
    cls = getattr(sys.modules.get("torchao.quantization"), "Float8Tensor", None)
    return cls is not None and isinstance(param, cls)


def _is_int4(param: Tensor) -> bool:
    """Whether ``param`` is TorchAO's tile-packed int4 tensor (by name: older TorchAO releases lack the class)."""
    return "torchao" in sys.modules and type(param).__name__ == "Int4TilePackedTo4dTensor"


# The packed-weight types loralei computes with, and how each is seen through the protocol.
_WRAPPERS: tuple[
    tuple[Callable[[Tensor], bool], Callable[[Tensor, LoRAConfig | None], QuantizedWeight]], ...
] = (
    (_is_nf4, lambda t, c: NF4Weight(t, c.nf4_kernel, c.nf4_autotune) if c else NF4Weight(t)),
    (is_params4bit, lambda t, c: BnbWeight(t)),
    (_is_int4, lambda t, c: Int4Weight(t)),
    (_is_fp8, lambda t, c: FP8Weight(t, c.fp8_kernel, c.fp8_fast_accum) if c else FP8Weight(t)),
    (lambda t: isinstance(t, CheckpointTensor), lambda t, c: CheckpointWeight(t)),
)


def check_quantizable(name: str, base: nn.Module, config: LoRAConfig) -> None:
    """Fails before injection changes anything if ``config`` cannot quantize module ``name``, or if a base loaded
    quantized cannot be taken as it is (bases loaded quantized are never packed again).

    Raises:
        InjectionError: the weight does not fit the quantization's blocks or groups, or cannot be computed with
            on the device it will be packed on (``fp8_kernel="auto"`` off FP8-capable GPUs, a missing CUDA
            device); or a fine-grained FP8Linear that loralei cannot take (see
            :func:`.fp8_checkpoint.check_fp8_linear`); or ``config.qat`` with a base it cannot merge into (see
            :func:`.fake_quant.check_qat`).
    """
    if config.qat is not None:
        check_qat(name, base, config.qat)
        return
    if is_fp8_linear(base):
        check_fp8_linear(name, base)
    elif config.quantize_base and not is_bnb_linear4bit(base):
        device = base.weight.device if config.quantization_device is None else _packing_device(config)
        QUANTIZERS[config.quantization_type].check(name, base.weight.shape, device, config)


def _packing_device(config: LoRAConfig) -> torch.device:
    """``config.quantization_device`` (set), as a device of this machine.

    Raises:
        InjectionError: a CUDA device on a machine without one.
    """
    device = torch.device(config.quantization_device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InjectionError(
            f"quantization_device={config.quantization_device!r}, but this machine has no CUDA device; leave it "
            "unset to pack each weight where it lives"
        )
    return device


def quantize_weight(weight: Tensor, config: LoRAConfig) -> nn.Parameter:
    """``weight`` packed as ``config.quantization_type`` says, as a frozen Parameter.

    The packing runs on ``config.quantization_device`` when set (and the packed weight stays there).
    """
    if config.quantization_device is not None:
        weight = weight.to(_packing_device(config))
    return nn.Parameter(QUANTIZERS[config.quantization_type].pack(weight, config), requires_grad=False)


def as_quantized(weight: Tensor, config: LoRAConfig | None = None) -> QuantizedWeight | None:
    """``weight`` through the quantized-base protocol, or ``None`` for a dense weight.

    Args:
        weight: a module's weight Parameter.
        config: the adapter's settings (the NF4 kernel options); ``None`` uses the defaults.
    """
    if type(weight) in (nn.Parameter, Tensor):  # dense: no look-ups (also what torch.compile traces)
        return None
    for matches, wrap in _WRAPPERS:
        if matches(weight):
            return wrap(weight, config)
    return None


def check_bank_quantizable(name: str, shape: torch.Size, config: LoRAConfig) -> None:
    """Fails before injection changes anything if ``config`` cannot pack expert bank ``name`` (NF4 only).

    Raises:
        InjectionError: another quantization type, or experts that do not own whole NF4 scaler groups.
    """
    if config.quantization_type != "nf4":
        raise InjectionError(
            f"expert bank '{name}': quantization_type={config.quantization_type!r} does not pack expert banks; "
            "use quantization_type='nf4' (NF4 expert banks), or leave target_parameters out"
        )
    check_nf4_bank(name, shape, config.nf4_block_size, config.nf4_scaler_block_size)


def quantize_bank(bank: Tensor, config: LoRAConfig) -> nn.Parameter:
    """A 3-D expert bank (E, d1, d2) packed as one NF4 tensor (E·d1, d2), as a frozen Parameter (see
    :mod:`.nf4_bank`); packed on ``config.quantization_device`` when set."""
    return quantize_weight(bank.detach().reshape(-1, bank.shape[-1]), config)


def as_quantized_bank(bank: Tensor, experts: int) -> QuantizedBank | None:
    """A bank Parameter through the quantized-bank protocol, or ``None`` for a dense (E, d1, d2) one.

    Args:
        bank: the experts module's bank Parameter.
        experts: E (an NF4 bank is stored flattened to (E·d1, d2); a checkpoint's bank as (E, d1, d2)).
    """
    if type(bank) in (nn.Parameter, Tensor):
        return None
    if isinstance(bank, CheckpointTensor):
        return CheckpointBank(bank)
    return NF4Bank(bank, experts) if _is_nf4(bank) else None


def refuse_dtype_cast(fn: Callable[[Tensor], Tensor], packed: list) -> None:
    """For ``Module._apply``: packed weights may move between devices but never change dtype (casting would
    silently dequantize them, or re-wrap them with a wrong dtype).

    Args:
        fn: the function ``Module._apply`` maps over tensors.
        packed: the module's quantized weights or banks (anything with ``dtype`` and ``device``).

    Raises:
        LoraleiError: ``fn`` changes the dtype.
    """
    for quant in packed:
        new = fn(torch.empty(0, dtype=quant.dtype, device=quant.device)).dtype
        if new != quant.dtype:
            raise LoraleiError(
                f"cannot cast a model with quantized LoRA bases to {new}: the packed weights compute in "
                f"{quant.dtype} and would be dequantized or corrupted; choose the dtype when loading the model "
                "(before inject_lora), or cast only the modules you mean"
            )
