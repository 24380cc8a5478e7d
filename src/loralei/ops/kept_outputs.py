"""Projection outputs kept from a checkpointed layer's forward and handed back to its recomputation.

A layer checkpointed with only its input kept runs its forward again in the backward to rebuild what its ops
save. With its attention results kept (:mod:`loralei.train.kept_attention`), the attention's projections (q/k/v,
o) still run again there, only to produce outputs equal to the forward's: with the MLP's recomputation skipped
too (:mod:`loralei.ops.recompute`), their base GEMMs are most of what a layer recomputes (an estimated 3 % of
the 8B step at 32K tokens). A :class:`Keeper`, set for one layer's forward and recomputation
(:func:`keeping`), takes those outputs in the forward (into host memory, as far as its budget goes) and gives them
back in the recomputation, where the projection's op forms only what its backward reads (the rank-r product
``U = D(X) Aᵀ``) and returns the kept output: its backward is the op's own, on the same saved tensors, so the
gradients are bit-identical to the recomputed ones.

Which projections take part is the keeper's choice (``owners``: the modules registered with it); the ops ask
through :func:`run`. A call inside no keeper's layer computes as usual.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import ClassVar, Protocol

from torch import Tensor, nn


class Keeper(Protocol):
    """One checkpointed layer's keeper of projection outputs (forward: ``replaying`` False)."""

    replaying: bool

    def keep_outputs(self, owners: Sequence[nn.Module], outputs: Sequence[Tensor]) -> None:
        """Keeps one call's outputs, if its projections take part and the budget allows."""

    def take_outputs(self, owners: Sequence[nn.Module]) -> list[Tensor] | None:
        """The outputs the forward kept for this call of these projections, on their device, or None."""


class _Current:
    keeper: ClassVar[Keeper | None] = None


@contextlib.contextmanager
def keeping(keeper: Keeper) -> Iterator[None]:
    """Runs a layer's forward or recomputation with ``keeper``."""
    previous, _Current.keeper = _Current.keeper, keeper
    try:
        yield
    finally:
        _Current.keeper = previous


def run(
    owners: Sequence[nn.Module],
    compute: Callable[[], Sequence[Tensor]],
    replay: Callable[[list[Tensor]], Sequence[Tensor]],
) -> Sequence[Tensor]:
    """The outputs of one projection call: ``compute()`` (kept when a forward's keeper wants them), or, in a
    recomputation that has them kept, ``replay(kept)``: the op on the kept outputs."""
    keeper = _Current.keeper
    if keeper is None:
        return compute()
    if keeper.replaying:
        kept = keeper.take_outputs(owners)
        return compute() if kept is None else replay(kept)
    outputs = compute()
    keeper.keep_outputs(owners, outputs)
    return outputs
