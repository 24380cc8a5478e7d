"""``training.layer_offloading``: the frozen base weights of every decoder layer live in host memory (pinned, on
CUDA, in pieces the pinned allocator does not round up: :mod:`.pinned`) and stream to the device one layer at a
time, so that about two layers' weights are resident at once. A dense weight streams itself; a packed one
(TorchAO's NF4Tensor, Float8Tensor, tile-packed int4) streams the tensors inside it (codes, scales), and its
wrapper, which reads them at every product, stays put.

The model goes to the device without them (:func:`to_device_but_streamed`): they go from where the model was
loaded to host memory, one layer at a time, so that the device never holds the whole model and the host never
holds more than one layer twice. Each layer's weights are copied to the device just before its forward and
again before its recomputation in the backward, then released. Storages move, not tensors: the fusion stacks
q/k/v (and gate/up) as row blocks of one buffer so that one GEMM serves them
(:func:`loralei.kernels.joint_buffer.joined`), and each parameter is re-pointed at the same offset and strides
in the device copy, so such views stay joined. A released parameter holds no elements, so that a read outside
its layer's turn fails loudly.

When layer ``i`` loads, the next layer in the direction of travel is prefetched (``i + 1`` in the forward,
``i - 1`` in the backward's recomputations; the other neighbour at either end, where the pass turns), and every
other layer is released. On CUDA the copies run on a side stream, the compute stream waits for a layer's copy
before its first kernel, and a released buffer is not reused before the kernels queued on it have run.

The layer loads from its module forward pre-hook (a forward without gradients, e.g. evaluation) and from the
function its checkpoint runs: Transformers checkpoints inside the layer's ``forward``, so the recomputation
calls that function again without passing the module's hooks. Only checkpointed layers can stream: autograd
would otherwise save weights that are released before the backward reads them.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn

from ..errors import ConfigError, LoraleiError
from . import heap
from .compile import decoder_layers
from .pinned import PinnedBuffer

_ALIGN = 64  # bytes: a copied span starts this aligned, so each tensor keeps its alignment on the device


class _Place(NamedTuple):
    """A tensor's place in a span: element offset from its start, shape and strides."""

    offset: int
    shape: torch.Size
    stride: tuple[int, ...]


@dataclass
class _Span:
    """The bytes of one storage that a layer's parameters use, kept in host memory, and where each of those
    parameters lies in them (a released parameter has no shape left to read)."""

    host: PinnedBuffer  # uint8
    nbytes: int
    params: list[tuple[nn.Parameter, _Place]]


@dataclass
class _Layer:
    """One decoder layer's streamed weights: their spans, and the device copies while resident."""

    spans: list[_Span]
    buffers: list[torch.Tensor] | None = None
    ready: torch.cuda.Event | None = None  # the copy's end, on the side stream (CUDA)


def _streamed_params(layer: nn.Module) -> list[nn.Parameter]:
    """The layer's frozen weights that stream: dense ones, and those held as a tensor subclass that can list its
    inner tensors (anything else stays put, and :func:`_unstreamable` names it)."""
    return [
        p
        for p in layer.parameters()
        if not p.requires_grad
        and p.numel()
        and (type(p.data) is torch.Tensor or hasattr(p, "__tensor_flatten__"))
    ]


def _streamed_tensors(layer: nn.Module) -> list[torch.Tensor]:
    """The plain tensors that hold the layer's frozen weights: each dense parameter, and the inner tensors of one
    held as a tensor subclass (TorchAO's NF4Tensor and Float8Tensor, the tile-packed int4: codes, scales), whose
    wrapper stays put and reads them at every product."""
    found: list[torch.Tensor] = []
    for p in _streamed_params(layer):
        if type(p.data) is torch.Tensor:
            found.append(p)
        else:
            names, _ = p.__tensor_flatten__()
            found += [t for t in (getattr(p, name) for name in names) if t.numel()]
    return found


def _unstreamable(layer: nn.Module) -> str | None:
    """A frozen parameter whose storage this module cannot move, by name, or None."""
    for name, p in layer.named_parameters():
        if p.requires_grad or type(p.data) is torch.Tensor:
            continue
        flatten = getattr(p, "__tensor_flatten__", None)
        if flatten is None or any(type(getattr(p, n)) is not torch.Tensor for n in flatten()[0]):
            return f"{name} ({type(p.data).__name__})"
    return None


def _byte_range(p: torch.Tensor) -> tuple[int, int]:
    """The bytes of its storage that ``p`` reads: first, and one past the last."""
    extent = 1 + sum((size - 1) * stride for size, stride in zip(p.shape, p.stride(), strict=True))
    start = p.storage_offset() * p.element_size()
    return start, start + extent * p.element_size()


def _spans(params: list[nn.Parameter], pin: bool) -> list[_Span]:
    """The parameters grouped by storage, each group's used bytes copied to host memory once."""
    groups: dict[int, list[nn.Parameter]] = {}
    for p in params:
        groups.setdefault(p.untyped_storage().data_ptr(), []).append(p)
    spans = []
    for group in groups.values():
        ranges = [_byte_range(p) for p in group]
        lo = min(start for start, _ in ranges) // _ALIGN * _ALIGN
        hi = max(end for _, end in ranges)
        source = torch.empty(0, dtype=torch.uint8, device=group[0].device)
        source.set_(group[0].untyped_storage(), lo, (hi - lo,), (1,))
        host = PinnedBuffer(hi - lo, torch.uint8, pin)
        host.send(source, blocking=True)  # the source is released once the layer's spans are made
        places = [
            (p, _Place((start - lo) // p.element_size(), p.shape, p.stride()))
            for p, (start, _) in zip(group, ranges, strict=True)
        ]
        spans.append(_Span(host, hi - lo, places))
    return spans


def _point(p: nn.Parameter, storage: torch.UntypedStorage, place: _Place) -> None:
    p.data = torch.empty(0, dtype=p.dtype, device=storage.device).set_(
        storage, place.offset, place.shape, place.stride
    )


class LayerStreamer:
    """The decoder layers' frozen weights in host memory, loaded to ``device`` as :meth:`ensure` asks."""

    def __init__(self, layers: list[_Layer], device: torch.device) -> None:
        """``layers``: already released (:func:`release`)."""
        self.layers, self.device = layers, device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.current: int | None = None
        self.direction = 1

    def host_bytes(self) -> int:
        """Bytes of host memory the host copies take (their buffers' pieces)."""
        return sum(span.host.nbytes for layer in self.layers for span in layer.spans)

    def away_numel(self) -> int:
        """Elements of the streamed dense parameters not on the device now (a parameter count adds them back; a
        quantized weight's wrapper keeps its shape, only its inner tensors stream)."""
        return sum(
            place.shape.numel()
            for layer in self.layers
            if layer.buffers is None
            for span in layer.spans
            for p, place in span.params
            if isinstance(p, nn.Parameter)
        )

    def resident(self) -> list[int]:
        """The layers whose weights are on the device (or on their way there)."""
        return [i for i, layer in enumerate(self.layers) if layer.buffers is not None]

    def ensure(self, index: int) -> None:
        """Makes layer ``index``'s weights usable on the current stream; prefetches the next layer in the
        direction of travel and releases every other."""
        if index != self.current:
            if self.current is not None:
                self.direction = 1 if index > self.current else -1
            self.current = index
            ahead = self._ahead(index)
            for i in self.resident():
                if i not in (index, ahead):
                    release(self.layers[i], self.device)
            for i in (index, ahead):
                if i is not None and self.layers[i].buffers is None:
                    self._load(self.layers[i])
        if (ready := self.layers[index].ready) is not None:
            torch.cuda.current_stream(self.device).wait_event(ready)

    def _ahead(self, index: int) -> int | None:
        """The layer to prefetch: the next one in the direction of travel, the other neighbour at an end."""
        for step in (self.direction, -self.direction):
            if 0 <= index + step < len(self.layers):
                return index + step
        return None

    def _load(self, layer: _Layer) -> None:
        with torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
            layer.buffers = [span.host.bring((span.nbytes,), self.device) for span in layer.spans]
        if self.stream is not None:
            layer.ready = torch.cuda.Event()
            layer.ready.record(self.stream)
            compute = torch.cuda.current_stream(self.device)
            for buffer in layer.buffers:  # not reused before the compute stream's kernels on it have run
                buffer.record_stream(compute)
        for span, buffer in zip(layer.spans, layer.buffers, strict=True):
            for p, place in span.params:
                _point(p, buffer.untyped_storage(), place)


def release(layer: _Layer, device: torch.device) -> None:
    """Drops the layer's weights from wherever they are (the device copy, or the copy it was loaded with):
    each parameter is left holding no elements on ``device``."""
    for span in layer.spans:
        for p, _ in span.params:
            p.data = torch.empty(0, dtype=p.dtype, device=device)
    layer.buffers, layer.ready = None, None


def _host_layer(layer: nn.Module, device: torch.device, pin: bool) -> _Layer:
    """The layer's streamed weights copied to host memory, the copy they had released at once (so that host
    memory never holds more than one layer twice)."""
    streamed = _Layer(_spans(_streamed_tensors(layer), pin))
    release(streamed, device)
    heap.trim()  # the released copy's pages go back to the system, not only to the heap
    return streamed


def to_device_but_streamed(model: nn.Module, device: torch.device) -> None:
    """``model.to(device)`` except the decoder layers' frozen weights (dense or packed), which stay where the
    model was loaded (host memory) until :func:`offload_layers` takes them: the whole model never has to fit on
    the device, only what stays there (embeddings, head, norms, the LoRA factors)."""
    kept = {id(p) for layer in decoder_layers(model) or [] for p in _streamed_params(layer)}
    model._apply(lambda t: t if id(t) in kept else t.to(device))  # Module.to(device)'s _apply, those kept


def _loaded(load: Callable[[], None], function: Callable, *args: Any, **kwargs: Any) -> Any:
    load()
    return function(*args, **kwargs)


class _LoadingCheckpoint:
    """A layer's checkpoint function whose function loads the layer's weights first, in the forward and in the
    backward's recomputation."""

    def __init__(self, checkpoint: Callable[..., Any], load: Callable[[], None]) -> None:
        self.checkpoint, self.load = checkpoint, load

    def __call__(self, function: Callable, *args: Any, **kwargs: Any) -> Any:
        return self.checkpoint(functools.partial(_loaded, self.load, function), *args, **kwargs)


def _pre_hook(streamer: LayerStreamer, index: int, module: nn.Module, args: Any) -> None:
    """Loads layer ``index`` before its forward; refuses a forward that autograd records unrecomputed.

    Raises:
        LoraleiError: gradients are on but the layer will not be checkpointed (e.g. the model in eval mode).
    """
    if torch.is_grad_enabled() and not (module.training and module.gradient_checkpointing):
        raise LoraleiError(
            "training.layer_offloading: a decoder layer ran with gradients on but without gradient "
            "checkpointing (is the model in eval mode?); its streamed weights would be gone before the "
            "backward: call model.train(), or run the forward under torch.no_grad()"
        )
    streamer.ensure(index)


def refusal(model: nn.Module) -> str | None:
    """Why this model's layers cannot stream, with the fix, or None: no decoder-layer list, a base loaded
    quantized by Transformers, a frozen weight of a kind whose storage cannot move, or layers that are not
    checkpointed."""
    layers = decoder_layers(model)
    if layers is None:
        return "this model has no decoder-layer list to stream; set layer_offloading: false"
    quantized = getattr(getattr(model, "config", None), "quantization_config", None)
    if quantized is not None and not _bnb_4bit(quantized):
        return (
            "the model was loaded quantized by Transformers, whose quantized layers hold their tensors in ways "
            "this does not move (bitsandbytes 4-bit excepted); load a dense base (lora.quantize_base packs it), "
            "or set layer_offloading: false"
        )
    for index, layer in enumerate(layers):
        if (what := _unstreamable(layer)) is not None:
            return (
                f"decoder layer {index}'s frozen {what} keeps its storage where this cannot move it; set "
                "layer_offloading: false"
            )
    if not all(
        getattr(layer, "gradient_checkpointing", False) and hasattr(layer, "_gradient_checkpointing_func")
        for layer in layers
    ):
        return (
            "its decoder layers are not checkpointed, so autograd would keep weights that stream out; set "
            "training.gradient_checkpointing: true or offload"
        )
    return None


def _bnb_4bit(quantization_config: Any) -> bool:
    """Whether Transformers loaded the model as bitsandbytes 4-bit: each ``Params4bit`` holds its 4-bit codes
    in its own storage, which streams as a dense weight's does (its ``quant_state`` statistics, about 3 % of the
    packed bytes, stay on the device)."""
    fields = quantization_config if isinstance(quantization_config, dict) else quantization_config.to_dict()
    return fields.get("quant_method") == "bitsandbytes" and bool(fields.get("load_in_4bit"))


def offload_layers(model: nn.Module, device: torch.device) -> str:
    """Moves every decoder layer's frozen dense weights to host memory and makes them stream back as the
    module docstring says; returns the line for the run's report.

    Raises:
        ConfigError: the model cannot stream (:func:`refusal`).
    """
    if (why := refusal(model)) is not None:
        raise ConfigError(f"training.layer_offloading: true cannot run here: {why}")
    layers = decoder_layers(model)
    pin = device.type == "cuda"
    streamer = LayerStreamer([_host_layer(layer, device, pin) for layer in layers], device)
    for index, layer in enumerate(layers):
        layer.register_forward_pre_hook(functools.partial(_pre_hook, streamer, index))
        load = functools.partial(streamer.ensure, index)
        layer._gradient_checkpointing_func = _LoadingCheckpoint(layer._gradient_checkpointing_func, load)
    model.loralei_layer_streamer = streamer
    host = f"{streamer.host_bytes() / 2**20:,.1f} MiB in {'pinned ' if pin else ''}host memory"
    return (
        f"training.layer_offloading: the frozen weights of {len(layers)} decoder layers ({host}) stream to "
        f"{device.type} one layer ahead of use; 2 layers resident at a time"
    )


def layer_streamer(model: nn.Module) -> LayerStreamer | None:
    """The model's :class:`LayerStreamer`, when its layers stream."""
    return getattr(model, "loralei_layer_streamer", None)
