"""PoLoRA's preconditioned gradients, computed for all pairs of one shape at once.

An 8B model's LoRA has a few hundred (A, B) pairs but only a handful of distinct shapes (one per projection
kind), so the pairs are stacked by shape and every product is a batched matmul; all Gram matrices of one rank
share a single batched Cholesky factorisation. The number of kernel launches per step therefore grows with
the number of shapes, not with the number of pairs.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

Pair = tuple[Tensor, Tensor]


class _Stack(NamedTuple):
    """Pairs of one shape, dtype and device (and the same gradients present), stacked along a batch dim."""

    pairs: list[Pair]
    a: Tensor  # (n, r, in), at least float32
    b: Tensor  # (n, out, r), at least float32

    @classmethod
    def of(cls, pairs: list[Pair]) -> _Stack:
        a, b = (_at_least_fp32(torch.stack(factors)) for factors in zip(*pairs, strict=True))
        return cls(pairs, a, b)

    def grads(self, which: int) -> Tensor | None:
        """The stacked gradients of the A (``which=0``) or B (``1``) factors, or ``None`` when they have none."""
        grads = [pair[which].grad for pair in self.pairs]
        if grads[0] is None:
            return None
        return torch.stack(grads).to(self.a.dtype)

    def unstack(self, which: int, scaled: Tensor) -> dict[Tensor, Tensor]:
        """``scaled`` (one slice per pair) keyed by the pairs' A (``which=0``) or B (``1``) factors, in their dtype."""
        factors = [pair[which] for pair in self.pairs]
        return dict(zip(factors, scaled.to(factors[0].dtype).unbind(), strict=True))


def _at_least_fp32(t: Tensor) -> Tensor:
    # Gram matrices and products in at least float32: low-precision factors are common, r×r Grams are tiny.
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _bucket_key(pair: Pair) -> tuple:
    a, b = pair
    grad_dtypes = tuple(None if t.grad is None else t.grad.dtype for t in pair)
    return (a.shape, b.shape, a.dtype, b.dtype, a.device, grad_dtypes)


def preconditioned_grads(group: dict[str, Any]) -> dict[Tensor, Tensor]:
    """The scaled gradients Ĝ of a paired group's factors that have a gradient, keyed by factor.

    Args:
        group: a PoLoRA parameter group with ``paired`` true (``params`` = A1, B1, A2, B2, ...).

    Returns:
        ``{A: (c·BᵀB + δI)⁻¹ ∇A, B: ∇B (c·AAᵀ + δI)⁻¹}`` in each factor's dtype.
    """
    flat = group["params"]
    buckets: dict[tuple, list[Pair]] = {}
    for pair in zip(flat[0::2], flat[1::2], strict=True):
        if pair[0].grad is not None or pair[1].grad is not None:
            buckets.setdefault(_bucket_key(pair), []).append(pair)
    stacks = [_Stack.of(pairs) for pairs in buckets.values()]
    fold = group["scale"] ** 2 if group["scale_invariant"] else 1.0
    grams = [s.b.mT @ s.b for s in stacks] + [s.a @ s.a.mT for s in stacks]
    inverses = damped_inverses(grams, fold, group["delta"])
    out: dict[Tensor, Tensor] = {}
    for stack, inv_b, inv_a in zip(stacks, inverses[: len(stacks)], inverses[len(stacks) :], strict=True):
        grad_a, grad_b = stack.grads(0), stack.grads(1)
        if grad_a is not None:
            out.update(stack.unstack(0, inv_b @ grad_a))
        if grad_b is not None:
            out.update(stack.unstack(1, grad_b @ inv_a))
    return out


def damped_inverses(grams: list[Tensor], fold: float, delta: float) -> list[Tensor]:
    """``(fold·G + δI)⁻¹`` for each stack of r×r Gram matrices G, in G's dtype.

    All stacks of one size on one device are inverted together in float64: a batched Cholesky factor ``L``
    and a triangular solve give ``L⁻¹``, and the inverse is ``L⁻ᵀL⁻¹``. No call here checks for errors on the
    host.

    Args:
        grams: stacks (n×r×r) of symmetric positive semi-definite matrices (n and r may differ between stacks).
        fold: multiplier of every Gram matrix.
        delta: damping, > 0.

    Returns:
        The stacks of inverses, in the order given.
    """
    out: list[Tensor] = list(grams)
    buckets: dict[tuple[int, torch.device, torch.dtype], list[int]] = {}
    for i, gram in enumerate(grams):
        buckets.setdefault((gram.shape[-1], gram.device, gram.dtype), []).append(i)
    for (rank, device, dtype), indices in buckets.items():
        batch = torch.cat([grams[i] for i in indices]).double() * fold
        batch.diagonal(dim1=-2, dim2=-1).add_(delta)
        chol = torch.linalg.cholesky_ex(batch).L
        eye = torch.eye(rank, dtype=batch.dtype, device=device).expand_as(batch)
        chol_inv = torch.linalg.solve_triangular(chol, eye, upper=False)
        inverses = (chol_inv.mT @ chol_inv).to(dtype)
        sizes = [grams[i].shape[0] for i in indices]
        for i, part in zip(indices, inverses.split(sizes), strict=True):
            out[i] = part
    return out
