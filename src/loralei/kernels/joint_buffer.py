r"""Tensors that lie side by side in one buffer, so that one GEMM can take them as one matrix.

A shared-input group's input gradient is ``dX = Σ_i dY_i W_i``. When the ``dY_i`` are adjacent column blocks of
one buffer and the ``W_i`` adjacent row blocks of another, the sum is one GEMM ``[dY_1 … dY_N] [W_1; …; W_N]``
instead of N GEMMs that each read and write ``dX``. :func:`joined` finds such neighbours without copying.

Who lays them out: the fusion stacks a group's dense base weights in one buffer (``fusion.groups``), and the
RoPE backward writes the q and k gradients side by side in a buffer with spare columns after them
(:func:`with_spare`), where the group writes the v gradient (:func:`take_spare`) as it reads it anyway: the
attention's backward (cuDNN) hands v's gradient over in a tensor of its own.
"""

from __future__ import annotations

import torch

_SPARE = "_loralei_spare_columns"  # attribute of a buffer: (first column, width) of its unwritten columns


def joined(a: torch.Tensor, b: torch.Tensor, dim: int) -> torch.Tensor | None:
    """A view of 2-D ``a`` and ``b`` concatenated along ``dim`` (0: rows, 1: columns) where ``b`` starts in
    memory exactly where ``a`` ends along ``dim`` (same buffer, strides, dtype and other extent); else None,
    and always None under ``torch.compile`` (its tracer reads no storage addresses)."""
    other = 1 - dim
    if (
        torch.compiler.is_compiling()
        or a.dim() != 2
        or b.dim() != 2
        or a.dtype != b.dtype
        or a.device != b.device
    ):
        return None
    if a.stride() != b.stride() or a.shape[other] != b.shape[other]:
        return None
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return None
    if b.storage_offset() != a.storage_offset() + a.shape[dim] * a.stride(dim):
        return None
    shape = list(a.shape)
    shape[dim] += b.shape[dim]
    return a.as_strided(shape, a.stride(), a.storage_offset())


def with_spare(buffer: torch.Tensor, start: int) -> torch.Tensor:
    """Marks the last-dimension columns ``start:`` of ``buffer`` as not written yet, free for :func:`take_spare`;
    returns ``buffer``."""
    setattr(buffer, _SPARE, (start, buffer.shape[-1] - start))
    return buffer


def take_spare(before: torch.Tensor, shape: torch.Size) -> torch.Tensor | None:
    """The spare columns right after the 2-D view ``before`` of a buffer that :func:`with_spare` marked, as a 2-D
    view of ``shape`` for the caller to fill (the buffer has no spare columns left then); None where ``before``
    has no such neighbour (and under ``torch.compile``)."""
    if torch.compiler.is_compiling():
        return None
    base = before._base
    spare = getattr(base, _SPARE, None) if base is not None else None
    if spare is None or spare[1] != shape[1] or base.shape[-1] != before.stride(0):
        return None
    slot = base.view(-1, base.shape[-1])[:, spare[0] :]
    if slot.shape != shape or joined(before, slot, 1) is None:
        return None
    delattr(base, _SPARE)
    return slot
