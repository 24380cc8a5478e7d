"""Checkpointing that keeps only each decoder layer's input: on the device (``training.gradient_checkpointing:
true`` in one process) or in host memory (``offload``).

The forward runs without autograd, so it builds no graph and saves nothing; the backward runs the layer again
with autograd and back-propagates through it (as reentrant checkpointing does). Without a graph to record in
the forward this costs the host less than torch's non-reentrant checkpoint, whose hooks see every saved tensor
twice: small models, whose step the host bounds, run faster with it.

Offloaded, the input goes to a pinned host buffer on a side stream (in pieces the pinned allocator does not
round up: :mod:`.pinned`). While one layer's backward runs, the input of the layer before it is already on its
way back to the device (one layer of prefetch), so the copies overlap compute. The layer inputs are what full
checkpointing still holds on the device; offloading them leaves the activations of one layer at a time there.

The recomputed forward sees the RNG state of the original one (dropout masks repeat), and the layer's last op may
skip its output there (:mod:`loralei.ops.recompute`). Offloaded, a layer may keep its attention results and
projection outputs beside its input (:mod:`.kept_attention`): the input comes back once the attention backward of
the layer after it is done (the step's peak is inside that backward), the rest once that layer's q/k/v
projections' backward is done too, so that it never meets those backwards' operands and gradients. Gradients flow
to the layer's input and its parameters; other tensor arguments (position embeddings, masks) must not need
gradients: such a call goes to the fallback checkpoint function when there is one, and is refused otherwise.
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch.autograd.graph import get_gradient_edge

from ..errors import ConfigError
from ..ops import recompute
from .kept_attention import AttentionBudget, LayerAttention, PassKeeping
from .kept_dora import OutputBudget
from .pinned import PinnedBuffer


class Streams(NamedTuple):
    """A device's side streams for copies to the host and back: one each way, so that copies back (the backward's)
    never queue behind copies to the host (the forward's), and the link carries both at once."""

    to_host: torch.cuda.Stream
    to_device: torch.cuda.Stream


class _HostCopy:
    """A layer input (or another tensor a layer keeps) on its way to host memory and back: into a pinned buffer
    on CUDA (copies on side streams, the copy back after the copy there), a clone on the CPU.

    Eagerly, the side stream's uses of device memory are recorded on it (``record_stream``): the allocator reuses
    the memory once the copy is done. Inside a CUDA graph's capture the allocator would keep such memory until the
    capture ends (it cannot ask a captured event whether it is done), and each layer's copies would add to the
    graph's memory. There, the device tensor a copy reads stays referenced until the capturing stream has waited
    for the copy (:meth:`release`, called by the chain two layers on), and the tensor a copy back writes is
    allocated on the capturing stream, which waits for the copy before it reads it.
    """

    def __init__(self, tensor: torch.Tensor, streams: Streams | None, buffer: PinnedBuffer | None) -> None:
        self.device, self.streams, self.back, self.shape = tensor.device, streams, None, tensor.shape
        self.ready: torch.cuda.Event | None = None  # recorded after the copy back
        self.attention: LayerAttention | None = None  # what the layer's attention kept (offload only)
        self.source: torch.Tensor | None = None  # in a capture: the device tensor until the copy has read it
        self.sent: torch.cuda.Event | None = None  # recorded after the copy to the host
        self.owned = False  # the copy back went into memory of the stream that reads it
        self.host: torch.Tensor | PinnedBuffer
        if streams is None or buffer is None:
            self.host = tensor.detach().clone()
            return
        self.host = buffer
        stream = streams.to_host
        stream.wait_stream(torch.cuda.current_stream(tensor.device))
        with torch.cuda.stream(stream):
            buffer.send(tensor.detach())
        self.sent = torch.cuda.Event()
        self.sent.record(stream)
        if torch.cuda.is_current_stream_capturing():
            self.source = tensor.detach()
        else:
            tensor.record_stream(stream)  # the device memory is not reused before the copy has read it

    def release(self) -> None:
        """In a capture: the current stream waits for the copy to the host, and the device tensor it read may
        go (a no-op otherwise, and once done)."""
        if self.source is not None:
            torch.cuda.current_stream(self.device).wait_event(self.sent)
            self.source = None

    def prefetch(self) -> None:
        """Starts the copy back to the device (once)."""
        if self.back is not None:
            return
        if self.streams is None:
            self.back = self.host
            return
        stream, out = self.streams.to_device, None
        stream.wait_event(self.sent)  # the host buffer is filled
        if torch.cuda.is_current_stream_capturing():
            current = torch.cuda.current_stream(self.device)
            out = torch.empty(self.shape, dtype=self.host.dtype, device=self.device)
            stream.wait_stream(current)  # the memory's earlier uses on the current stream are done
        self.owned = out is not None
        with torch.cuda.stream(stream):
            self.back = self.host.bring(self.shape, self.device, out)
            self.ready = torch.cuda.Event()
            self.ready.record(stream)

    def fetch(self) -> torch.Tensor:
        """The input back on its device, ready for the current stream: which waits for this copy only, not for the
        copies queued after it on the side stream (the rest of the layer's kept tensors, used later)."""
        self.prefetch()
        if self.streams is not None:
            torch.cuda.current_stream(self.device).wait_event(self.ready)
            if not self.owned:
                self.back.record_stream(torch.cuda.current_stream(self.device))
        back, self.back = self.back, None
        return back


class _Kept:
    """A layer input held on its device (nothing to copy)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor.detach()
        self.attention: LayerAttention | None = None

    def prefetch(self) -> None:
        """Nothing to bring back."""

    def fetch(self) -> torch.Tensor:
        return self.tensor


class _Chain:
    """The layers of one forward pass in order, so that each backward can prefetch the input of the one before;
    one pinned buffer per layer position, reused by every pass (grown when a longer batch comes).

    The chain refers to the kept inputs weakly (each layer's autograd node holds its own): a pass whose graph is
    dropped without a backward frees its inputs, and the next pass starts where it started. A buffer that a CUDA
    graph captured stays allocated when a longer batch grows its position's (``captured``): the graph's
    replays still copy into it.
    """

    def __init__(self) -> None:
        self.copies: list[weakref.ref[_HostCopy | _Kept]] = []
        self.buffers: dict[tuple[int, int], PinnedBuffer] = {}  # by (layer position, tensor of the layer)
        self.captured: dict[int, PinnedBuffer] = {}  # by id: the buffers graphs copy into
        self.streams: dict[torch.device, Streams] = {}
        # copies to the host whose device tensor a capture still holds, with their layer positions
        self.sending: list[tuple[int, _HostCopy]] = []

    def _buffer(self, tensor: torch.Tensor, slot: tuple[int, int]) -> PinnedBuffer | None:
        if tensor.device.type != "cuda":
            return None
        buffer = self.buffers.get(slot)
        if buffer is None or buffer.numel < tensor.numel() or buffer.dtype != tensor.dtype:
            buffer = self.buffers[slot] = PinnedBuffer(tensor.numel(), tensor.dtype)
        if torch.cuda.is_current_stream_capturing():
            self.captured[id(buffer)] = buffer
        return buffer

    def host_bytes(self) -> int:
        """Bytes of host memory the pinned buffers take: every slot's, at the longest batch so far, and those a
        CUDA graph captured before a longer batch grew their slot's."""
        held = {id(b): b for b in self.buffers.values()} | self.captured
        return sum(b.nbytes for b in held.values())

    def _host_copy(self, tensor: torch.Tensor, slot: tuple[int, int]) -> _HostCopy:
        """``tensor`` sent to its slot's buffer; in a capture, the copies that layers two or more before sent let
        their tensors go (the capturing stream waits for them: a whole layer later they are done; the layer just
        before sent its last output, down's, at its end, a moment before this layer's first copy, and waiting for
        that would hold this layer's compute up: about 1 ms a layer of the 8B step without checkpointing)."""
        self.release(before=slot[0] - 1)
        streams = None
        if tensor.device.type == "cuda":
            streams = self.streams.get(tensor.device)
            if streams is None:
                streams = self.streams[tensor.device] = Streams(
                    torch.cuda.Stream(tensor.device), torch.cuda.Stream(tensor.device)
                )
        copy = _HostCopy(tensor, streams, self._buffer(tensor, slot))
        if copy.source is not None:
            self.sending.append((slot[0], copy))
        return copy

    def release(self, before: int | None = None) -> None:
        """Lets go the device tensors of the copies to the host sent so far (:meth:`_HostCopy.release`): those of
        the layers before position ``before``, or all."""
        keep = []
        for index, copy in self.sending:
            if before is None or index < before:
                copy.release()
            else:
                keep.append((index, copy))
        self.sending = keep

    def push(self, tensor: torch.Tensor, offload: bool) -> tuple[int, _HostCopy | _Kept]:
        """Keeps a layer input (sent to the host with ``offload``); returns its position in the pass and its
        holder, which the caller keeps."""
        while self.copies and self.copies[-1]() is None:  # a pass dropped without its backward
            self.copies.pop()
        index = len(self.copies)
        holder = self._host_copy(tensor, (index, 0)) if offload else _Kept(tensor)
        self.copies.append(weakref.ref(holder))
        return index, holder

    def storer(self, index: int) -> Callable[[torch.Tensor], _HostCopy]:
        """Sends the further tensors layer ``index`` keeps (its attention results) to the host, each into a
        buffer of its own."""
        slots = itertools.count(1)
        return lambda tensor: self._host_copy(tensor, (index, next(slots)))

    def _holder(self, index: int) -> _HostCopy | _Kept | None:
        return self.copies[index]() if 0 <= index < len(self.copies) else None

    def prefetch_input(self, index: int) -> None:
        """Starts bringing back layer ``index``'s input."""
        if (holder := self._holder(index)) is not None:
            holder.prefetch()

    def prefetch_kept(self, index: int) -> None:
        """Starts bringing back what layer ``index`` kept besides its input: attention results, projection
        outputs."""
        if (holder := self._holder(index)) is not None and holder.attention is not None:
            holder.attention.prefetch()

    def take(self, index: int, holder: _HostCopy | _Kept) -> torch.Tensor:
        """The input of layer ``index`` back on the device; starts bringing back the one before it, unless this
        layer's attention runs on a kernel of :mod:`loralei.ops.attention` (kept or computed again): then the
        input before comes back once this layer's attention backward is done, and the rest that layer kept once
        this one's q/k/v projections' backward is (:func:`_running`), so that neither meets the operands of those
        backwards, where the step's peak is."""
        self.release()
        tensor = holder.fetch()
        if index == 0:  # the first layer's backward ends the pass
            self.copies.clear()
        elif holder.attention is None or not holder.attention.attends:
            self.prefetch_input(index - 1)
            self.prefetch_kept(index - 1)
        return tensor


_CHAIN = _Chain()


def storer(index: int) -> Callable[[torch.Tensor], _HostCopy]:
    """Sends tensors layer ``index`` keeps to host memory (pinned buffers of its own, reused by every pass)."""
    return _CHAIN.storer(index)


def release_copies() -> None:
    """Lets go the device tensors that copies to the host sent inside a capture still hold (done by now)."""
    _CHAIN.release()


def offload_host_bytes() -> int:
    """Bytes of pinned host memory the offloaded layer inputs of this process occupy now."""
    return _CHAIN.host_bytes()


def _rng_states(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """The RNG states the recomputation restores; None inside a CUDA graph's capture, where they cannot be set
    and nothing draws from them (:func:`loralei.train.graphs.refusal` keeps dropout out of graphs)."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return None
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


# An input that asks for a backward: a layer whose input needs no gradient (the first, after a frozen embedding)
# still back-propagates into its own (LoRA) parameters. Zero-sized, so that nothing large stays alive for it (a
# leaf made of the input itself would keep the embeddings' output until the step's end).
_ASKS_BACKWARD = torch.zeros(0, requires_grad=True)


class _InputOnlyLayer(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        owner: InputCheckpoint,
        run: Callable,
        input_grad: bool,
        hidden: torch.Tensor,
        _asks_backward: torch.Tensor,
        *rest: Any,
    ) -> Any:
        ctx.owner, ctx.run, ctx.rest, ctx.device, ctx.input_grad = owner, run, rest, hidden.device, input_grad
        ctx.rng = _rng_states(hidden.device)
        ctx.index, ctx.holder = _CHAIN.push(hidden, owner.offload)
        ctx.attention = ctx.holder.attention = owner.layer_attention(ctx.index, hidden)
        with torch.no_grad(), _running(ctx.attention, replaying=False):
            return run(hidden, *rest)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        hidden = _CHAIN.take(ctx.index, ctx.holder).detach().requires_grad_(ctx.input_grad)
        ctx.holder = None
        with torch.enable_grad():
            out = ctx.owner.rerun(ctx, hidden)
        outs = out if isinstance(out, tuple) else (out,)
        # the outputs' graph edges, not the outputs: the recomputed outputs (nothing reads them) are freed before
        # the backward through them starts
        pairs = [
            (get_gradient_edge(o), g)
            for o, g in zip(outs, grads, strict=True)
            if isinstance(o, torch.Tensor) and o.requires_grad and g is not None
        ]
        del out, outs
        torch.autograd.backward([edge for edge, _ in pairs], [g for _, g in pairs])
        return (None, None, None, hidden.grad if ctx.input_grad else None, None, *(None for _ in ctx.rest))


def _running(
    layer: LayerAttention | None, replaying: bool, index: int = 0
) -> contextlib.AbstractContextManager:
    """A layer's forward or recomputation with its kept attention, if any; once the recomputed attention's
    backward is done, the layer before's input starts coming back, and once the q/k/v projections' backward is
    done, the rest it kept (attention results, projection outputs), whose copies queue on one stream behind the
    input's (which takes about as long as that backward at long context), without meeting its gradients."""
    if layer is None:
        return contextlib.nullcontext()
    return layer.running(
        replaying,
        after_attention=lambda: _CHAIN.prefetch_input(index - 1),
        after_projections=lambda: _CHAIN.prefetch_kept(index - 1),
    )


def _replay(ctx: Any, hidden: torch.Tensor) -> Any:
    """The layer's forward again, with the RNG state of the first run and the attention results it kept."""
    with _running(ctx.attention, replaying=True, index=ctx.index):
        if ctx.rng is None:
            return ctx.run(hidden, *ctx.rest)
        devices = [ctx.device] if ctx.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.set_rng_state(ctx.rng[0])
            if ctx.rng[1] is not None:
                torch.cuda.set_rng_state(ctx.rng[1], ctx.device)
            return ctx.run(hidden, *ctx.rest)


class InputCheckpoint:
    """Transformers' ``gradient_checkpointing_func``, one per model: runs ``function(hidden, *rest)`` keeping only
    ``hidden`` for the backward, in host memory with ``offload``.

    The backward's recomputation lets the layer's last op leave its output unfilled
    (:mod:`loralei.ops.recompute`). When a later op saved tensors in such a recomputation, the layer is recomputed
    in full, and so is every layer after that (``defer_outputs`` turns off).
    """

    def __init__(
        self,
        offload: bool,
        fallback: Callable[..., Any] | None = None,
        attention: AttentionBudget | None = None,
        outputs: OutputBudget | None = None,
    ) -> None:
        self.offload, self.fallback, self.defer_outputs = offload, fallback, True
        self.attention = attention  # keeps the layers' attention results beside their inputs (offload only)
        self.outputs = outputs  # keeps DoRA down projections' outputs in host memory (:mod:`.kept_dora`)
        self.pass_kept = PassKeeping(0)  # what this pass may keep in host memory (planned at its first layer)

    def layer_attention(self, index: int, hidden: torch.Tensor) -> LayerAttention | None:
        """Layer ``index``'s keeper of attention results and projection outputs (keeping them where the pass's
        plan has room), or None when it keeps neither: attention is kept only with offloading."""
        if self.attention is not None and self.offload:
            if index == 0:
                self.pass_kept = self.attention.plan(hidden)
            keeping = index < self.pass_kept.attention_room
            owners = self.attention.owners | (
                self.outputs.owners if self.outputs is not None else frozenset()
            )
            return LayerAttention(keeping, _CHAIN.storer(index), owners, self.pass_kept)
        if self.outputs is None:
            return None
        if index == 0:
            self.pass_kept = self.outputs.plan(hidden, self.offload)
        return LayerAttention(True, _CHAIN.storer(index), self.outputs.owners, self.pass_kept)

    def summary(self) -> str | None:
        """A line for the end of an offloaded run, or of one that kept DoRA outputs, or None when it has nothing
        to say: the pinned host memory and what the last pass kept there."""
        if not self.offload and self.outputs is None:
            return None
        pinned = offload_host_bytes()  # none on the CPU, where the copies are plain host tensors
        parts = [f"{pinned / 2**30:,.2f} GiB of pinned host memory"] if pinned else []
        kept = self.pass_kept
        if self.attention is not None and self.offload and not kept.attention_room:
            parts.append("attention recomputed (the layer inputs left no room in the host budget)")
        elif self.attention is not None and self.offload:
            layers = self.attention.layers
            parts.append(f"attention kept in {kept.attention_layers} of {layers} layers")
            if self.attention.owners:
                which = "q/k/v/o and DoRA down" if self.outputs is not None else "q/k/v/o"
                parts[-1] += f", {which} outputs in {kept.output_layers} of {layers}"
            if kept.attention_room < layers:
                parts[-1] += " (the host budget held no more)"
        elif self.outputs is not None:
            layers = self.outputs.layers
            parts.append(f"DoRA down outputs kept in {kept.output_layers} of {layers} layers")
            if kept.short:
                parts[-1] += " (the host budget held no more)"
        prefix = "offloaded checkpointing: " if self.offload else "checkpointing: "
        return prefix + "; ".join(parts) if parts else None

    def rerun(self, ctx: Any, hidden: torch.Tensor) -> Any:
        if self.defer_outputs:
            out, read_after = recompute.watched(lambda: _replay(ctx, hidden))
            if not read_after:
                return out
            self.defer_outputs = False
        return _replay(ctx, hidden)

    def __call__(self, function: Callable, hidden: torch.Tensor, *rest: Any, **checkpoint_kwargs: Any) -> Any:
        """The layer's forward, its input kept for the backward.

        Raises:
            ConfigError: another tensor argument needs a gradient (it would not get one) and there is no fallback.
        """
        if not torch.is_grad_enabled():  # nothing to keep for a backward (e.g. DPO's reference pass)
            return function(hidden, *rest)
        if any(isinstance(arg, torch.Tensor) and arg.requires_grad for arg in rest):
            if self.fallback is not None:
                return self.fallback(function, hidden, *rest, **checkpoint_kwargs)
            raise ConfigError(
                "training.gradient_checkpointing: offload gives gradients to each layer's hidden states and "
                "parameters only, but this model passes its layers another tensor that needs one; use "
                "gradient_checkpointing: true"
            )
        return _InputOnlyLayer.apply(self, function, hidden.requires_grad, hidden, _ASKS_BACKWARD, *rest)
