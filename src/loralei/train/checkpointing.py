"""``training.gradient_checkpointing``: how each decoder layer is checkpointed.

- ``true`` in one process: the layer keeps only its input, on the device, and its forward builds no graph
  (:mod:`loralei.train.input_checkpoint`; cheaper on the host than torch's checkpoint). A layer that takes
  another tensor needing a gradient goes to torch's checkpoint instead.
- ``true`` in several processes (DDP and FSDP2 hook into every forward and backward): torch's non-reentrant
  checkpoint per layer.
- ``true`` under ``torch_compile``: torch's checkpoint, with a selective policy (:mod:`loralei.train.compile`)
  where Transformers checkpoints inside the compiled layer (5.2x). Where it checkpoints around the compiled call
  (5.17), the policy's cache sits outside the compiled graph and gave wrong gradients (a q_proj factor's 121 %
  off in ``tests/train/test_compile.py``), so those layers recompute in full.
- ``offload``: the layer keeps only its input, in host memory (one process, no torch.compile); with rows of
  ``kept_attention.AUTO_TOKENS`` or more, its sdpa attention output too, so that attention runs once per step
  (:mod:`loralei.train.kept_attention`). A full batch's inputs must fit in :data:`PINNED_SHARE` of the host's
  memory (:func:`offload_inputs_problem`; the runner checks before the weights load).

Outside torch.compile, a recomputation lets the layer's last op skip its output when nothing reads it
(:mod:`loralei.ops.recompute`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers.modeling_layers import GradientCheckpointingLayer

from ..fusion.forwards import CHECKPOINTS_IN_FORWARD
from ..ops.recompute import dropped_saves, recomputation
from . import distributed, kept_attention, kept_dora
from .compile import checkpoint_kwargs
from .input_checkpoint import InputCheckpoint
from .pinned import held_bytes, size_text

_INPUT_GRAD_HOOKS = "_require_grads_hooks"  # Transformers' list of its input-embedding hooks
PINNED_SHARE = 0.9  # of the host's memory that a full batch's offloaded layer inputs may take


def offload_inputs_problem(layers: int, tokens: int, token_bytes: int) -> str | None:
    """Why ``offload`` cannot keep a full batch's layer inputs in pinned host memory, or None when they fit.

    Args:
        layers: the model's decoder layers (each keeps its input).
        tokens: a full micro batch's tokens on this rank (batch_size x max_seq_length, over the ranks that split
            each sequence).
        token_bytes: one token's hidden state (hidden size x the dtype's bytes).
    """
    one = held_bytes(tokens * token_bytes, pinned=True)
    host = kept_attention.host_memory()
    if layers * one <= PINNED_SHARE * host:
        return None
    return (
        f"training.gradient_checkpointing: offload keeps every decoder layer's input in pinned host memory: a "
        f"full batch of {tokens:,} tokens (batch_size x max_seq_length, a rank's share where sequences are split) "
        f"takes {layers} x {size_text(one)} = "
        f"{size_text(layers * one)} there, more than {PINNED_SHARE:.0%} of the {size_text(host)} this process may "
        "use (the machine's memory or its container's limit, shared by the processes torchrun started on it); "
        "lower training.max_seq_length or batch_size, or set "
        "gradient_checkpointing: true (the inputs stay on the GPU)"
    )


def _drop_added_input_grad_hooks(model: nn.Module, before: list | None) -> None:
    """Removes the hooks Transformers' checkpointing switch adds to make the input embeddings' output require a
    gradient (``before``: the model's list of such hooks until then, which it gets back).

    None of the checkpoints here needs them (the input-only one and torch's non-reentrant one back-propagate into
    the adapters whatever the input), and with them the embeddings' output becomes a leaf that the backward holds
    to its end (for its gradient, which nothing reads): one layer input more on the device at the step's peak, and
    the first layer's input gradient formed for nothing.
    """
    after = getattr(model, _INPUT_GRAD_HOOKS, None)
    if after is before or not after:
        return
    for hook in after:  # a new list: Transformers replaces the attribute with its own hooks
        hook.remove()
    setattr(model, _INPUT_GRAD_HOOKS, before if before is not None else [])
    if before:
        model._require_grads_hook = before[0]
    elif hasattr(model, "_require_grads_hook"):
        del model._require_grads_hook


class RecomputingCheckpoint:
    """torch's non-reentrant checkpoint whose recomputations (every call of the layer after the first) run under
    :func:`loralei.ops.recompute.recomputation` with early stop, and whose first call under
    :func:`~loralei.ops.recompute.dropped_saves` (the ops save there what they will in the recomputation, which
    torch's checkpoint checks: a DoRA node's output)."""

    def __init__(self, kwargs: dict[str, Any]) -> None:
        self.kwargs = kwargs

    def __call__(self, function: Callable, *args: Any, **kwargs: Any) -> Any:
        calls = itertools.count()

        def run(*inner: Any, **inner_kwargs: Any) -> Any:
            if next(calls) == 0:
                with dropped_saves():
                    return function(*inner, **inner_kwargs)
            with recomputation(early_stop=True):
                return function(*inner, **inner_kwargs)

        return checkpoint(run, *args, **{**self.kwargs, **kwargs})


def enable_checkpointing(
    model: nn.Module, compiled: bool, offload: bool, keep_attention: bool = False
) -> list[str]:
    """Checkpoints every decoder layer as the module docstring says (``compiled``: for torch.compile; with
    ``offload`` and ``keep_attention``, sdpa attention runs once per step: :mod:`loralei.train.kept_attention`).

    Returns:
        The lines for the run's report: where compiled layers recompute in full, where attention outputs are kept,
        where DoRA down projections' outputs are (:mod:`loralei.train.kept_dora`).
    """
    selective = compiled and CHECKPOINTS_IN_FORWARD
    kwargs = checkpoint_kwargs(selective)
    hooks = getattr(model, _INPUT_GRAD_HOOKS, None)
    if hasattr(model, "activation_checkpointing_enable"):  # Transformers >= 5.x renamed it
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    _drop_added_input_grad_hooks(model, hooks)
    if compiled:  # compiled layers keep Transformers' checkpoint function
        if selective:
            return []
        return [
            "gradient checkpointing under torch_compile recomputes whole layers: this Transformers checkpoints "
            "around the compiled layer, where a selective policy gives wrong gradients"
        ]
    layers = [module for module in model.modules() if hasattr(module, "_gradient_checkpointing_func")]
    layer_checkpoint: Callable[..., Any] = RecomputingCheckpoint(kwargs)
    # the model may carry the checkpoint function too (Transformers sets it beside the layers')
    decoder_layers = sum(isinstance(module, GradientCheckpointingLayer) for module in layers)
    dora_downs = kept_dora.owners(model)
    outputs = kept_dora.OutputBudget(dora_downs, decoder_layers) if dora_downs else None
    notes: list[str | None] = []
    if offload:
        kept = kept_attention.enable(model, decoder_layers) if keep_attention else None
        budget, note = kept if kept is not None else (None, None)
        notes.append(note)
        layer_checkpoint = InputCheckpoint(offload=True, attention=budget, outputs=outputs)
    elif distributed.world_size() == 1:
        layer_checkpoint = InputCheckpoint(offload=False, fallback=layer_checkpoint, outputs=outputs)
    else:  # torch's checkpoint: DoRA downs form their products again
        outputs = None
    if outputs is not None:
        notes.append(kept_dora.note(dora_downs))
    for module in layers:
        module._gradient_checkpointing_func = layer_checkpoint
    return [note for note in notes if note]


def offload_summary(model: nn.Module) -> str | None:
    """The end-of-run line of ``model``'s offloaded checkpointing (:meth:`InputCheckpoint.summary`), or None."""
    for module in model.modules():
        func = getattr(module, "_gradient_checkpointing_func", None)
        if isinstance(func, InputCheckpoint):
            return func.summary()
    return None
