"""Routed rows grouped by expert, and the grouped GEMMs over them.

A layer's routes (token t sent to its k-th expert) are sorted by expert once (:func:`sort_routes`); every
expert's rows are then contiguous, and one grouped GEMM multiplies each expert's rows by that expert's matrix.
On CUDA with bf16 operands that is ``torch._grouped_mm`` (one kernel for all experts); elsewhere (CPU, fp32,
unaligned shapes) a loop over the experts that received rows computes the same products.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from ..kernels.moe import combine, gather


class Routing(NamedTuple):
    """Routes sorted by expert.

    Attributes:
        order: (S,) flat route indices ``t * K + k`` in expert order (S = tokens × K).
        token: (S,) the token of each sorted route (``order // K``).
        position: (S,) the sorted row of each flat route (the inverse of ``order``).
        offsets: (E,) int32 end row of each expert's group (cumulative counts).
        counts: (E,) int32 rows per expert.
        top_k: K, the experts per token.
    """

    order: Tensor
    token: Tensor
    position: Tensor
    offsets: Tensor
    counts: Tensor
    top_k: int

    def combine(
        self, rows: Tensor, top_k_weights: Tensor | None = None, extra: Tensor | None = None
    ) -> Tensor:
        """Each token's K routed rows (``rows + extra`` when ``extra`` is given) summed, weighted by
        ``top_k_weights`` when given: (S, n) in expert order → (tokens, n). Deterministic (no atomics),
        accumulated in FP32."""
        return combine(rows, self.position, top_k_weights, self.position.shape[0] // self.top_k, extra)

    def gather(self, x: Tensor) -> Tensor:
        """Each sorted route's token row: (tokens, n) → (S, n) in expert order."""
        return gather(x, self.token)

    def sorted_weights(self, top_k_weights: Tensor) -> Tensor:
        """(S,) routing weights in expert order."""
        return top_k_weights.reshape(-1)[self.order]


def sort_routes(top_k_index: Tensor, num_experts: int) -> Routing:
    """Sorts a layer's routes by expert (stable: a token's rows keep their order within an expert).

    Args:
        top_k_index: (tokens, K) expert of each route.
        num_experts: E.

    Returns:
        The :class:`Routing`. No host synchronisation.
    """
    top_k = top_k_index.shape[-1]
    experts = top_k_index.reshape(-1)
    _, order = torch.sort(experts, stable=True)
    position = torch.empty_like(order)
    position[order] = torch.arange(order.shape[0], device=order.device)
    counts = torch.zeros(num_experts, dtype=torch.int32, device=experts.device)
    counts.scatter_add_(0, experts.to(torch.int64), torch.ones_like(experts, dtype=torch.int32))
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)
    return Routing(order, order // top_k, position, offsets, counts, top_k)


def _kernel_ok(*operands: Tensor) -> bool:
    """Whether ``torch._grouped_mm`` computes these operands: CUDA, bf16, 16-byte aligned rows."""
    return (
        hasattr(torch, "_grouped_mm")
        and all(t.is_cuda and t.dtype == torch.bfloat16 for t in operands)
        and all(t.shape[-1] % 8 == 0 and t.shape[-2] % 8 == 0 for t in operands)
    )


def _bounds(routing: Routing) -> list[tuple[int, int, int]]:
    """(expert, first row, end row) of every expert with rows (one host synchronisation)."""
    ends = routing.offsets.tolist()
    starts = [0, *ends[:-1]]
    return [(e, s, t) for e, (s, t) in enumerate(zip(starts, ends, strict=True)) if t > s]


def grouped_mm(x: Tensor, w: Tensor, routing: Routing) -> Tensor:
    """Each expert's rows times its matrix: ``out[rows_e] = x[rows_e] @ w[e]``.

    Args:
        x: (S, k) rows in expert order.
        w: (E, k, n) one matrix per expert (any strides, e.g. a transposed view of an (E, n, k) bank).
        routing: the layer's :class:`Routing`.

    Returns:
        (S, n) in ``x``'s dtype.
    """
    if _kernel_ok(x, w):
        return torch._grouped_mm(x, w, offs=routing.offsets)
    out = x.new_zeros(x.shape[0], w.shape[-1])
    for e, s, t in _bounds(routing):
        torch.mm(x[s:t], w[e], out=out[s:t])
    return out


def grouped_weight_grad(a: Tensor, b: Tensor, routing: Routing, out_dtype: torch.dtype) -> Tensor:
    """Per-expert sums over its rows: ``out[e] = a[:, rows_e] @ b[rows_e]`` (the factors' gradients).

    Args:
        a: (m, S) columns in expert order (usually a transposed view of (S, m) rows).
        b: (S, n) rows in expert order.
        routing: the layer's :class:`Routing`.
        out_dtype: dtype of the result (the factor's; FP32 factors get FP32 sums of low-precision products).

    Returns:
        (E, m, n); experts that received no rows get zeros.
    """
    experts = routing.counts.shape[0]
    if _kernel_ok(a, b):
        out = torch._grouped_mm(a, b, offs=routing.offsets)
        # an expert without rows has an empty sum: make it zero whatever the kernel left there
        return out.masked_fill_((routing.counts == 0).view(-1, 1, 1), 0).to(out_dtype)
    out = torch.zeros(experts, a.shape[0], b.shape[1], dtype=out_dtype, device=a.device)
    for e, s, t in _bounds(routing):
        out[e] = a[:, s:t].to(out_dtype) @ b[s:t].to(out_dtype)  # .to is a no-op in the factors' own dtype
    return out
