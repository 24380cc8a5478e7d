"""NF4 expert banks: a 3-D bank (E, d1, d2) stored as one TorchAO ``NF4Tensor`` of shape (E·d1, d2).

Each expert's elements are a contiguous range of the flattened bank, and with ``d1·d2`` a multiple of
``nf4_block_size · nf4_scaler_block_size`` every expert owns whole blocks and whole scaler groups: its codes,
block scales and double-quantization factors are slices of the bank's (the scales' mean is the bank's). So a few
routed experts are dequantized one by one, each straight from its slices, and the others never are; every expert
(``None``: a training batch, :func:`loralei.ops.lora_experts._dense`), or at least half of them, is the whole
bank dequantized in one launch instead, the same values: the launches of one per expert cost the host more time
than the other experts' writes cost the GPU.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...errors import InjectionError
from ...kernels import nf4 as nf4_kernels
from .buffers import shared_buffer
from .nf4 import NF4Weight
from .tensor import PackedTensor


def check_nf4_bank(name: str, shape: torch.Size, block_size: int, scaler_block_size: int) -> None:
    """Refuses a bank whose experts do not each own whole NF4 scaler groups, before anything is changed.

    Raises:
        InjectionError: ``d1·d2`` does not divide by ``block_size * scaler_block_size``.
    """
    group = block_size * scaler_block_size
    per_expert = shape[1] * shape[2]
    if per_expert % group:
        raise InjectionError(
            f"expert bank '{name}' {tuple(shape)}: each expert has {per_expert} elements, not a multiple of "
            f"nf4_block_size * nf4_scaler_block_size = {block_size} * {scaler_block_size} = {group}; choose "
            "smaller blocks (e.g. nf4_scaler_block_size=8 for tiny models) or leave the bank out"
        )


class NF4Bank(PackedTensor):
    """An NF4-packed expert bank through :class:`loralei.ops.weights.QuantizedBank` (dtype and device are the
    packed tensor's; the shape is the dense bank's).

    Args:
        tensor: the ``NF4Tensor`` (E·d1, d2), a frozen Parameter of the experts module.
        experts: E.
    """

    def __init__(self, tensor: Tensor, experts: int) -> None:
        super().__init__(tensor)
        self.whole = NF4Weight(tensor)
        self.experts = experts

    @property
    def shape(self) -> torch.Size:
        rows, cols = super().shape  # the packed (E·d1, d2) matrix's, read once
        return torch.Size((self.experts, rows // self.experts, cols))

    @property
    def nbytes(self) -> int:
        return self.whole.nbytes

    @property
    def backend(self) -> str:
        return (
            "NF4 expert bank, dequantized into a shared buffer for grouped GEMMs (whole for a training batch)"
        )

    def expert(self, e: int) -> nf4_kernels.NF4Packed:
        """Expert ``e``'s slices of the packed bank."""
        p = self.whole.packed
        n = self.shape[1] * self.shape[2]
        block, group = p.block_size, p.block_size * p.scaler_block_size
        return p._replace(
            data=p.data[e * n // 2 : (e + 1) * n // 2],
            scalers=p.scalers[e * n // block : (e + 1) * n // block],
            factors=p.factors[e * n // group : (e + 1) * n // group],
            shape=tuple(self.shape[1:]),
        )

    def dequantize(self, experts: list[int] | None, out: Tensor | None = None) -> Tensor:
        if out is None:
            out = shared_buffer(self.shape, self.dtype, self.device)
        every = experts is None or 2 * len(experts) >= self.experts
        if every and out.is_contiguous():  # module docstring: one launch
            nf4_kernels.dequantize(self.whole.packed, out.view(-1, self.shape[2]))
            return out
        for e in range(self.experts) if experts is None else experts:
            nf4_kernels.dequantize(self.expert(e), out[e])
        return out
