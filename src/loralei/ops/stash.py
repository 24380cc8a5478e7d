"""DoRA outputs saved for the backward and put away from the device where the running layer has a stash.

Without checkpointing, a DoRA projection's magnitude gradient reads its output ``Y``
(``dm = Σ_t dY ⊙ (Y - bias) / m``, :mod:`loralei.ops.dora`): the ops either keep ``Y`` on the device (the fused
MLP's down: tokens × hidden values a layer through the step) or form ``Z`` again in the backward (q/k/v/o: one more
base GEMM each). Where a stash is set for the running layer (:mod:`loralei.train.dora_stash`: pinned host memory,
brought back a layer ahead of the backward), the ops mark ``Y`` (:func:`mark`) and save it where the stash takes
it; the stash's saved-tensor hooks put the marked tensors away as autograd saves them and hand them back when the
backward unpacks them. Autograd still checks that nothing changed them in place in between.
"""

from __future__ import annotations

from typing import ClassVar, Protocol

from torch import Tensor


class Stash(Protocol):
    """One layer's stash: takes the tensors its ops mark when autograd saves them."""

    def mark(self, tensor: Tensor, held: bool) -> bool:
        """Puts ``tensor`` away when it is saved for the backward, if its budget holds it (then True). ``held``:
        the op keeps it on the device otherwise (rather than forming it again in the backward)."""


class _Current:
    stash: ClassVar[Stash | None] = None


def swap(stash: Stash | None) -> Stash | None:
    """Sets the running layer's stash (None: none); returns the one set before."""
    previous, _Current.stash = _Current.stash, stash
    return previous


def mark(tensor: Tensor, held: bool = False) -> bool:
    """Marks a tensor an op saves for its backward for the running layer's stash: whether the stash takes it
    (False without one, or past its budget). ``held``: the op keeps it on the device otherwise; else it forms it
    again in the backward where the stash does not take it."""
    return _Current.stash is not None and _Current.stash.mark(tensor, held)
