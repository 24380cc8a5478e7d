"""DoRA outputs kept in pinned host memory for the backward, in a run without checkpointing.

Without checkpointing the DoRA ops save their outputs for the magnitudes' gradients where the running decoder layer
has a stash (:mod:`loralei.ops.stash`; :func:`stash_outputs` sets one for each layer's training forward): q/k/v/o
would otherwise form their products again in the backward (about 30 ms of the 8B step at 8,192 tokens on an
H200), and down's output would stay on the device through the step (64 MiB a layer there). Each saved output goes
to a pinned host buffer on a side stream as autograd saves it (the host copies of offloaded checkpointing:
:mod:`.input_checkpoint`), and comes back when the backward of the layer after starts (a layer ahead of its own;
the last layer's when its own does). What they may take of the host is :func:`~.kept_attention.host_budget`;
past it, the ops keep their outputs as without a stash (down's on the device, q/k/v/o's formed again).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from transformers.modeling_layers import GradientCheckpointingLayer

from ..modules.lora_linear import LoRALinear
from ..ops import stash
from . import input_checkpoint
from .kept_attention import HOST_SHARE, PassKeeping, host_budget
from .pinned import held_bytes


class LayerStash:
    """One decoder layer's forward without checkpointing (a :class:`loralei.ops.stash.Stash`): the tensors its
    ops mark go to host memory as autograd saves them (``store``: the chain's host copies), within the pass's
    budget ``kept``, and come back when the backward unpacks them."""

    def __init__(self, store: Callable[[Tensor], Any], kept: PassKeeping) -> None:
        self.store, self.kept = store, kept
        self.marked: set[int] = set()  # ids of the tensors marked and not yet saved
        self.holders: list[weakref.ref] = []  # the host copies, weakly (autograd's saved values hold them)
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def mark(self, tensor: Tensor) -> bool:
        """Claims ``tensor``'s bytes of the budget for when it is saved; whether they were there."""
        if not self.kept.claim(held_bytes(tensor.numel() * tensor.element_size(), tensor.is_cuda)):
            return False
        self.marked.add(id(tensor))
        return True

    def pack(self, tensor: Tensor) -> Any:
        """A saved tensor: a marked one's host copy, else the tensor."""
        if id(tensor) not in self.marked:
            return tensor
        self.marked.discard(id(tensor))
        holder = self.store(tensor)
        self.holders.append(weakref.ref(holder))
        return holder

    @staticmethod
    def unpack(packed: Any) -> Tensor:
        return packed if isinstance(packed, Tensor) else packed.fetch()

    def prefetch(self) -> None:
        """Starts bringing back what the layer put away (each once)."""
        for ref in self.holders:
            if (holder := ref()) is not None:
                holder.prefetch()


class _Stasher:
    """Sets a :class:`LayerStash` for each decoder layer's training forward (its hooks), and starts bringing one
    back when the backward of the layer after it starts."""

    def __init__(self, layers: list[nn.Module]) -> None:
        self.index = {id(layer): i for i, layer in enumerate(layers)}
        self.stashes: list[LayerStash | None] = [None] * len(layers)
        self.kept = PassKeeping(0)  # the pass's budget, planned at its first layer
        self.running: list[tuple[LayerStash, stash.Stash | None]] = []

    def before(self, layer: nn.Module, args: tuple) -> None:
        if not (torch.is_grad_enabled() and layer.training):
            return
        i = self.index[id(layer)]
        if i == 0:
            self.kept = PassKeeping(host_budget())
        layer_stash = self.stashes[i] = LayerStash(input_checkpoint.storer(i), self.kept)
        layer_stash.hooks.__enter__()
        self.running.append((layer_stash, stash.swap(layer_stash)))

    def after(self, layer: nn.Module, args: tuple, output: Any) -> None:
        """Ends the layer's stash (also when its forward raised); its output's gradient will say when its backward
        starts."""
        i = self.index[id(layer)]
        if not self.running or self.running[-1][0] is not self.stashes[i]:
            return
        layer_stash, previous = self.running.pop()
        stash.swap(previous)
        layer_stash.hooks.__exit__(None, None, None)
        hidden = output[0] if isinstance(output, tuple) else output
        if layer_stash.holders and isinstance(hidden, Tensor) and hidden.requires_grad:
            self.kept.output_layers += 1
            hidden.register_hook(functools.partial(self.backward_starts, i))

    def backward_starts(self, i: int, grad: Tensor) -> None:
        """Layer ``i``'s backward starts: what it put away and what the layer before did start coming back (the
        first already on its way unless ``i`` is the last layer); the copies to the host let their tensors go."""
        input_checkpoint.release_copies()
        for j in (i, i - 1):
            if j >= 0 and (layer_stash := self.stashes[j]) is not None:
                layer_stash.prefetch()


def stash_outputs(model: nn.Module) -> str | None:
    """Keeps the outputs ``model``'s DoRA ops save in pinned host memory, decoder layer by decoder layer, for a
    run without checkpointing; the line for the run's report, or None where the model has no DoRA projection."""
    dora = sum(isinstance(m, LoRALinear) and m.lora_magnitude_vector is not None for m in model.modules())
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    if not dora or not layers:
        return None
    stasher = _Stasher(layers)
    for layer in layers:
        layer.register_forward_pre_hook(stasher.before)
        layer.register_forward_hook(stasher.after, always_call=True)
    return (
        f"DoRA: the outputs of its {dora} DoRA projections kept in pinned host memory from each layer's forward "
        f"for its backward (their magnitudes' gradients read them), as far as {HOST_SHARE:.0%} of the host's "
        "memory goes: q/k/v/o do not form their products again, down's outputs leave the device"
    )
