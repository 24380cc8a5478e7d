"""Checkpoint recomputation that skips the one product nobody reads: the output of a layer's last op.

A checkpointed layer's forward runs twice: once for real, and once more in the backward to re-create the
tensors its autograd nodes saved. The second run's output is thrown away. In a Llama-style decoder layer the
last op is the gated MLP, whose output (the down projection: a T×I by I×H GEMM, about a seventh of the layer's
forward FLOPs) only feeds the residual add, which saves nothing. Under :func:`recomputation` the fused MLP
(:func:`loralei.ops.lora_mlp.lora_mlp`) therefore saves what it always saves but leaves its output unfilled
(:func:`defer`), and fills it only when something after it could read it (:func:`settle`).

When is the output unread? The two checkpoint styles answer it differently:

- torch's non-reentrant checkpoint stops a recomputation as soon as every tensor the first forward saved has
  been saved again ("early stop"; on by default). When the MLP is the layer's last op that saves tensors, the
  stop comes while the MLP's node saves them, before any op can read its output. When the recomputation goes on
  after the MLP (a norm after the MLP, as in Gemma-2, saves its input), the MLP fills its output at once, before
  returning it (``early_stop=True`` here).
- the input-only checkpoint (:mod:`loralei.train.input_checkpoint`) back-propagates through the recomputed
  graph, so it never stops early (``early_stop=False``). :meth:`Recomputation.pack` watches for tensors saved after the MLP's
  node; when there are any, an op may have read the unfilled output, and the caller recomputes the layer in
  full (:attr:`Recomputation.read_after`).

Every tensor the backward uses is the same as without the skip, so the gradients are bit-identical.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import ClassVar, TypeVar

import torch

T = TypeVar("T")


class Recomputation:
    """One layer's recomputed forward: the op whose output waits to be filled, if any."""

    # the one running (a class attribute: torch.compile reads it cheaply)
    current: Recomputation | None = None

    def __init__(self, early_stop: bool) -> None:
        self.early_stop = early_stop
        self.pending: tuple[torch.Tensor, Callable[[], torch.Tensor]] | None = None
        # the deferring op has returned: a tensor saved from now on comes from a later op
        self.settled = False
        self.read_after = False  # a later op saved tensors (only watched without early stop)

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        """A ``saved_tensors_hooks`` pack hook (identity) that notes tensors saved after the deferring op."""
        if self.settled:
            self.read_after = True
        return tensor


@contextlib.contextmanager
def recomputation(early_stop: bool) -> Iterator[Recomputation]:
    """Marks the forward run inside as a recomputation whose output is dropped."""
    previous, current = Recomputation.current, Recomputation(early_stop)
    Recomputation.current = current
    try:
        yield current
    finally:
        Recomputation.current, current.pending = previous, None


def _same(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def watched(run: Callable[[], T]) -> tuple[T, bool]:
    """``run()`` as a recomputation without early stop whose output nobody reads (the input-only checkpoint's
    rerun of a layer, a tiled MLP's backward run of a tile), every tensor saved inside watched: its result, and
    whether an op saved tensors after the one that left its output unfilled (then the caller runs it again in
    full, since that op may have read the unfilled output)."""
    with recomputation(early_stop=False) as rec, torch.autograd.graph.saved_tensors_hooks(rec.pack, _same):
        out = run()
    return out, rec.read_after


def in_recomputation() -> bool:
    """Whether the op being called runs inside a recomputation (what it saves lives only until the layer's
    backward)."""
    return Recomputation.current is not None


class _Dropped:
    """Whether the running forward is the first of a checkpoint that drops what its ops save and recomputes it
    (torch's non-reentrant checkpoint)."""

    active: ClassVar[bool] = False


@contextlib.contextmanager
def dropped_saves() -> Iterator[None]:
    """Marks the forward run inside as the first of a checkpoint that keeps none of what its ops save and checks
    that its recomputation saves the same tensors (torch's non-reentrant checkpoint)."""
    previous, _Dropped.active = _Dropped.active, True
    try:
        yield
    finally:
        _Dropped.active = previous


def keeps_outputs() -> bool:
    """Whether an op may save its (T, out) output for its backward at no cost: inside a recomputation (what it
    saves lives only until the layer's backward), and in the first forward of a checkpoint that drops what its
    ops save (:func:`dropped_saves`), which must save what its recomputation will."""
    return Recomputation.current is not None or _Dropped.active


def may_defer() -> bool:
    """Whether the op being called may leave its output unfilled: inside a recomputation, the first to ask."""
    current = Recomputation.current
    return current is not None and current.pending is None and not current.settled


def defer(out: torch.Tensor, fill: Callable[[], torch.Tensor]) -> None:
    """Registers ``out`` (uninitialised) and the function that computes its values."""
    current = Recomputation.current
    assert current is not None, "defer outside a recomputation"
    current.pending = (out, fill)


def settle() -> None:
    """Called by the deferring op once its node has saved its tensors. Under early stop, getting here means the
    recomputation goes on past the op, so its output is filled now; otherwise later saves are watched."""
    current = Recomputation.current
    if current is None or current.pending is None:
        return
    current.settled = True
    if current.early_stop:
        out, fill = current.pending
        with torch.no_grad():
            out.copy_(fill())
        current.pending = None
