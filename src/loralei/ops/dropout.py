"""LoRA dropout masks shared by the plain and the fused paths, so that both draw the same masks.

Each projection draws its own mask over its own input, in call order, from the global RNG. A mask is kept as a
bool tensor (1 byte per element) and applied as ``x * keep / (1 - p)``; the plain path and every fused op draw it
with :func:`draw_keep_mask`, so with the same RNG seed they use identical masks and give identical results.
"""

from __future__ import annotations

import torch

from ..errors import LoraleiError


def keep_scale(p: float) -> float:
    """The inverted-dropout factor ``1 / (1 - p)`` applied to the kept elements."""
    return 1.0 / (1.0 - p)


def draw_keep_mask(shape: tuple[int, ...], device: torch.device, p: float) -> torch.Tensor | None:
    """A bool keep-mask (True with probability ``1 - p``), or ``None`` when ``p == 0``.

    Args:
        shape: shape of the tensor the mask will be applied to.
        device: its device.
        p: dropout probability in [0, 1).

    Returns:
        The mask, or ``None`` for no dropout.
    """
    if p == 0:
        return None
    return torch.empty(shape, dtype=torch.bool, device=device).bernoulli_(1.0 - p)


def scaled_mask(keep: torch.Tensor | None, p: float, dtype: torch.dtype) -> torch.Tensor | None:
    """``keep / (1 - p)`` as a ``dtype`` tensor: the mask convention of ``ops.reference`` (``None`` stays ``None``)."""
    if keep is None:
        return None
    return keep.to(dtype) * keep_scale(p)


def op_mask(
    shape: torch.Size, device: torch.device, dtype: torch.dtype, p: float, given: torch.Tensor | None
) -> tuple[torch.Tensor | None, float]:
    """The keep-mask a fused op applies to an input of ``shape``, and the factor ``k`` applied with it.

    Args:
        shape: shape of the input the mask applies to.
        device: its device (where a mask is drawn).
        dtype: the compute dtype (a given float mask is cast to it).
        p: dropout probability of the projection.
        given: the caller's mask, already divided by the keep probability (``ops.reference``'s convention),
            or ``None``.

    Returns:
        ``(given, 1.0)`` for a caller's mask (a bool one kept as bool); otherwise a drawn bool mask (``None``
        when ``p == 0``) and ``1 / (1 - p)``.

    Raises:
        LoraleiError: ``given`` has another shape than the input.
    """
    if given is None:
        return draw_keep_mask(shape, device, p), keep_scale(p)
    if given.shape != shape:
        raise LoraleiError(
            f"dropout mask has shape {tuple(given.shape)}; expected {tuple(shape)}, the shape of its input"
        )
    return (given if given.dtype == torch.bool else given.to(dtype)), 1.0
