"""DoRA outputs kept in pinned host memory for the backward, in a run without checkpointing.

Without checkpointing the DoRA ops save their outputs for the magnitudes' gradients where the running decoder layer
has a stash that takes them (:mod:`loralei.ops.stash`; :func:`stash_outputs` sets one for each layer's training
forward): q/k/v/o would otherwise form their products again in the backward (about 30 ms of the 8B step at 8,192
tokens on an H200), and down's output would stay on the device through the step (64 MiB a layer there). Each
output taken goes to a pinned host buffer on a side stream as autograd saves it (the host copies of offloaded
checkpointing: :mod:`.input_checkpoint`), and comes back on the other side stream when the backward of the layer
after starts (a layer ahead of its own; the last layer's when its own does), down's first.

The copies must not outlast the forward's products, or the forward waits for them (inside a CUDA graph's capture
the computing stream waits for each layer's copies two layers on: :mod:`.input_checkpoint`). So each layer's
outputs may take :data:`FLOPS_PER_LINK_BYTE`-th of its projections' FLOPs in bytes a token (:func:`row_plan`):
down's first (they would stay on the device), then the others in the order the forward makes them, each that
fits (the rest form their products again, as without a stash). At the 8B shape that is all of them (on an H100
the link carried them in the forward's time). Where the device's copies to the host run slower than those of that
measurement (:func:`link_rate`, timed once at setup while every process of the run copies), a layer sends less
in proportion. All of it within :func:`~.kept_attention.host_budget` of the host's memory.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn
from transformers.modeling_layers import GradientCheckpointingLayer

from ..fusion.specs import spec_for
from ..modules.lora_linear import LoRALinear
from ..ops import stash
from . import distributed, input_checkpoint
from .kept_attention import HOST_SHARE, PassKeeping, host_budget
from .pinned import tensor_held_bytes

# What the host link moves while a layer's forward runs: on an H100 at the 8B shape, every DoRA output (28,672
# bytes a token against 436 MFLOP of projections: 15,200 FLOPs a byte) left within the forward, its 7.0 GiB of
# copies at 46.7 GB/s, with the step's kernels idle 9 ms against LoRA's 2 (the forward's attention, norms and
# activations run between its GEMMs: about 700 TFLOP/s of projections overall).
FLOPS_PER_LINK_BYTE = 15_000
# The link_rate that figure holds for: on the H100 where it was measured the probe's copies ran at 55.0 GB/s (the
# step's own, between its kernels, at 46.7); a tenth under that still counts as such a link (the probes of two
# machines of one kind differ by a few percent). A device whose probe runs slower (a GPU sharing its link to the
# host with another that copies at once, an older PCIe generation) sends less in proportion.
REFERENCE_LINK_GBPS = 50.0
LINK_PROBE_BYTES = 64 * 2**20  # :func:`link_rate` times four copies of this many bytes


class RowPlan(NamedTuple):
    """What a layer's outputs may send to the host a token (a row), so that its forward's copies take no longer
    than its products: ``held`` whether the outputs the ops would otherwise hold on the device (DoRA downs') go,
    and ``rest`` the bytes a row left for the outputs they would otherwise form again (q/k/v/o), taken in the
    order the forward marks them."""

    held: bool
    rest: int


def row_plan(
    products: list[tuple[int, int]], held_widths: list[int], element_size: int, flops_per_byte: float
) -> RowPlan:
    """The :class:`RowPlan` of a layer whose projections' bases are ``products`` (in, out) and whose DoRA downs'
    outputs are ``held_widths`` wide: its rows may send ``2 Σ in·out / flops_per_byte`` bytes (:func:`link_share`),
    the held outputs first."""
    row = int(sum(2 * inputs * outputs for inputs, outputs in products) // flops_per_byte)
    held = sum(held_widths) * element_size
    return RowPlan(True, row - held) if held <= row else RowPlan(False, row)


def link_rate(device: torch.device) -> float:
    """GB/s of copies from ``device`` to pinned host memory, timed while every process of the run copies at once
    (after a barrier where there is a process group): GPUs that share a link to the host each see their share."""
    source = torch.empty(LINK_PROBE_BYTES, dtype=torch.uint8, device=device)
    target = torch.empty(LINK_PROBE_BYTES, dtype=torch.uint8, pin_memory=True)
    target.copy_(source, non_blocking=True)  # the first copy pays for setting up
    torch.cuda.synchronize(device)
    distributed.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(4):
        target.copy_(source, non_blocking=True)
    end.record()
    end.synchronize()
    return 4 * LINK_PROBE_BYTES / (start.elapsed_time(end) * 1e6)


def link_share(device: torch.device) -> tuple[float, float | None]:
    """The FLOPs of a layer's projections that each byte of its outputs sent to the host takes on ``device``:
    :data:`FLOPS_PER_LINK_BYTE`, more in proportion where :func:`link_rate` is under :data:`REFERENCE_LINK_GBPS`
    (never less: a faster link sends no more than the measured step did); and that rate (None off CUDA, where
    the stash's copies are clones and nothing is timed)."""
    if device.type != "cuda":
        return FLOPS_PER_LINK_BYTE, None
    rate = link_rate(device)
    return FLOPS_PER_LINK_BYTE * max(1.0, REFERENCE_LINK_GBPS / rate), rate


class LayerStash:
    """One decoder layer's forward without checkpointing (a :class:`loralei.ops.stash.Stash`): the tensors its
    ops mark go to host memory as autograd saves them (``store``: the chain's host copies), within the layer's
    :class:`RowPlan` and the pass's host budget ``kept``, and come back when the backward unpacks them."""

    def __init__(self, store: Callable[[Tensor], Any], kept: PassKeeping, plan: RowPlan) -> None:
        self.store, self.kept, self.held, self.rest = store, kept, plan.held, plan.rest
        self.marked: dict[int, bool] = {}  # ids of the tensors marked and not yet saved: whether held
        self.holders: list[weakref.ref] = []  # the host copies, weakly (autograd's saved values hold them)
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def mark(self, tensor: Tensor, held: bool) -> bool:
        """Takes ``tensor`` for when it is saved, if the layer's plan holds it and, for an output the op would
        otherwise form again (whose op saves it only if taken), the pass's budget (claimed now). A held output's
        bytes are claimed when it is saved (:meth:`pack`): an op run without autograd (a tiled MLP's forward)
        marks one it never saves."""
        if held:
            if self.held:
                self.marked[id(tensor)] = True
            return self.held
        row = tensor.shape[-1] * tensor.element_size()
        if row > self.rest or not self.kept.claim(tensor_held_bytes(tensor)):
            return False
        self.rest -= row
        self.marked[id(tensor)] = False
        return True

    def pack(self, tensor: Tensor) -> Any:
        """A saved tensor: a marked one's host copy (a held one's where the pass's budget still holds it), else the
        tensor."""
        held = self.marked.pop(id(tensor), None)
        if held is None or (held and not self.kept.claim(tensor_held_bytes(tensor))):
            return tensor
        holder = self.store(tensor)
        self.holders.append(weakref.ref(holder))
        return holder

    @staticmethod
    def unpack(packed: Any) -> Tensor:
        return packed if isinstance(packed, Tensor) else packed.fetch()

    def prefetch(self) -> None:
        """Starts bringing back what the layer put away (each once), last first: the order its backward reads
        them in (down's before o's before q/k/v's)."""
        for ref in reversed(self.holders):
            if (holder := ref()) is not None:
                holder.prefetch()


class _Stasher:
    """Sets a :class:`LayerStash` for each decoder layer's training forward (its hooks), and starts bringing one
    back when the backward of the layer after it starts."""

    def __init__(self, layers: list[nn.Module], down: str | None, flops_per_byte: float) -> None:
        self.index = {id(layer): i for i, layer in enumerate(layers)}
        self.plans = [_layer_plan(layer, down, flops_per_byte) for layer in layers]
        self.stashes: list[LayerStash | None] = [None] * len(layers)
        self.kept = PassKeeping(0)  # the pass's budget, planned at its first layer
        self.running: list[tuple[LayerStash, stash.Stash | None]] = []

    def before(self, layer: nn.Module, args: tuple) -> None:
        if not (torch.is_grad_enabled() and layer.training):
            return
        i = self.index[id(layer)]
        if i == 0:
            self._unwind()
            self.kept = PassKeeping(host_budget())
        layer_stash = self.stashes[i] = LayerStash(input_checkpoint.storer(i), self.kept, self.plans[i])
        layer_stash.hooks.__enter__()
        self.running.append((layer_stash, stash.swap(layer_stash)))

    def _end_last(self) -> LayerStash:
        """Ends the stash set last: the one set before it is the ops' again, and its saved-tensor hooks go."""
        layer_stash, previous = self.running.pop()
        stash.swap(previous)
        layer_stash.hooks.__exit__(None, None, None)
        return layer_stash

    def _unwind(self) -> None:
        """Ends the stashes a forward left set: one interrupted by a ``BaseException`` (Ctrl-C), which skips even
        the forward hooks that run when a forward raises."""
        while self.running:
            self._end_last()

    def after(self, layer: nn.Module, args: tuple, output: Any) -> None:
        """Ends the layer's stash (also when its forward raised); its output's gradient will say when its backward
        starts."""
        i = self.index[id(layer)]
        if not self.running or self.running[-1][0] is not self.stashes[i]:
            return
        layer_stash = self._end_last()
        hidden = output[0] if isinstance(output, tuple) else output
        if layer_stash.holders and isinstance(hidden, Tensor) and hidden.requires_grad:
            hidden.register_hook(functools.partial(self.backward_starts, i))

    def backward_starts(self, i: int, grad: Tensor) -> None:
        """Layer ``i``'s backward starts: what it put away and what the layer before did start coming back (the
        first already on its way unless ``i`` is the last layer); the copies to the host let their tensors go."""
        input_checkpoint.release_copies()
        for j in (i, i - 1):
            if j >= 0 and (layer_stash := self.stashes[j]) is not None:
                layer_stash.prefetch()


def _layer_plan(layer: nn.Module, down: str | None, flops_per_byte: float) -> RowPlan:
    """The :class:`RowPlan` of a decoder layer from its LoRA projections (its DoRA downs: those named ``down``)."""
    projections = [(name, m) for name, m in layer.named_modules() if isinstance(m, LoRALinear)]
    held = [
        m.out_features
        for name, m in projections
        if name.rpartition(".")[2] == down and m.lora_magnitude_vector is not None
    ]
    size = projections[0][1].lora_weights().dtype.itemsize if projections else 2
    return row_plan([(m.in_features, m.out_features) for _, m in projections], held, size, flops_per_byte)


def stash_outputs(model: nn.Module) -> str | None:
    """Keeps the outputs ``model``'s DoRA ops save in pinned host memory, decoder layer by decoder layer, for a
    run without checkpointing; the line for the run's report, or None where the model has no DoRA projection."""
    dora = sum(isinstance(m, LoRALinear) and m.lora_magnitude_vector is not None for m in model.modules())
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    if not dora or not layers:
        return None
    flops_per_byte, rate = link_share(next(model.parameters()).device)
    stasher = _Stasher(layers, spec_for(model).down, flops_per_byte)
    for layer in layers:
        layer.register_forward_pre_hook(stasher.before)
        layer.register_forward_hook(stasher.after, always_call=True)
    memory = "host memory" if rate is None else "pinned host memory"  # a CPU run's copies are clones
    return (
        f"DoRA: the outputs of its {dora} DoRA projections kept in {memory} from each layer's forward for its "
        "backward (their magnitudes' gradients read them), as many as the host link carries while the layer "
        f"computes{_link_text(rate)} and {HOST_SHARE:.0%} of the host's memory holds: those q/k/v/o do not form "
        "their products again, those downs' outputs leave the device"
    )


def _link_text(rate: float | None) -> str:
    """The measured link rate for the report, and what it changes."""
    if rate is None:
        return ""
    if rate >= REFERENCE_LINK_GBPS:
        return f" (copies to the host measured at {rate:.1f} GB/s)"
    return (
        f" (copies to the host measured at {rate:.1f} GB/s, under the {REFERENCE_LINK_GBPS} GB/s the plan was "
        f"measured at: each layer sends {rate / REFERENCE_LINK_GBPS:.0%} as many bytes)"
    )
