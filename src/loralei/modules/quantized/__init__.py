"""Quantized frozen bases: one protocol (:class:`loralei.ops.weights.QuantizedWeight`), one implementation per
kind, chosen by a table keyed by ``LoRAConfig.quantization_type`` (quantizing at injection) or by the type of
a weight the model was loaded with (bitsandbytes ``Params4bit``)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor, nn

from ...config import LoRAConfig
from ...errors import InjectionError
from ...ops.weights import QuantizedBank, QuantizedWeight
from .bnb import BnbWeight, is_bnb_linear4bit, is_params4bit
from .int4 import Int4Weight, check_int4_shape, quantize_int4
from .nf4 import NF4Weight, check_nf4_shape, quantize_nf4, torchao_nf4


class Quantizer(NamedTuple):
    """How one ``quantization_type`` checks a weight (before anything changes) and packs it."""

    check: Callable[[str, torch.Size, LoRAConfig], None]
    pack: Callable[[Tensor, LoRAConfig], Tensor]


QUANTIZERS: dict[str, Quantizer] = {
    "nf4": Quantizer(
        check=lambda name, shape, c: check_nf4_shape(name, shape, c.nf4_block_size, c.nf4_scaler_block_size),
        pack=lambda w, c: quantize_nf4(w, c.nf4_block_size, c.nf4_scaler_block_size),
    ),
    "int4": Quantizer(
        check=lambda name, shape, c: check_int4_shape(name, shape, c.int4_group_size),
        pack=lambda w, c: quantize_int4(w, c.int4_group_size),
    ),
}


def _is_nf4(param: Tensor) -> bool:
    """Whether ``param`` is an ``NF4Tensor`` (TorchAO is imported only if it already is)."""
    return "torchao" in sys.modules and isinstance(param, torchao_nf4().NF4Tensor)


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
)


def check_quantizable(name: str, base: nn.Module, config: LoRAConfig) -> None:
    """Fails before injection changes anything if ``config`` cannot quantize module ``name``.

    Raises:
        InjectionError: the weight does not fit the quantization's blocks or groups, or the library is missing.
    """
    if config.quantize_base and not is_bnb_linear4bit(base):
        QUANTIZERS[config.quantization_type].check(name, base.weight.shape, config)


def quantize_weight(weight: Tensor, config: LoRAConfig) -> nn.Parameter:
    """``weight`` packed as ``config.quantization_type`` says, as a frozen Parameter.

    The packing runs on ``config.quantization_device`` when set (and the packed weight stays there).
    """
    device = config.quantization_device
    if device is not None:
        if torch.device(device).type == "cuda" and not torch.cuda.is_available():
            raise InjectionError(
                f"quantization_device={device!r}, but this machine has no CUDA device; leave it unset to pack "
                "each weight where it lives"
            )
        weight = weight.to(device)
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


def as_quantized_bank(bank: Tensor) -> QuantizedBank | None:
    """A 3-D expert bank through the quantized-bank protocol, or ``None`` for a dense one."""
    return None if type(bank) in (nn.Parameter, Tensor) else bank
