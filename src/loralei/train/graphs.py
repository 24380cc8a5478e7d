"""``training.cuda_graphs``: each micro batch's forward and backward replayed from a CUDA graph.

A small model's step is bound by the host: Python and the launches of a few thousand kernels take longer than the
GPU takes to run them, and even a large model's GPU waits a few microseconds between kernels. A CUDA graph records
the launches of one forward and backward once; a replay is one launch. The optimizer step, clipping and the
step's verdict stay eager (a few fused kernels).

How a batch shape gets its graph (:class:`GraphedSteps`):

- Its first micro batch runs eagerly, on the stream that captures: lazy initialisation, the autotuners'
  benchmarks and the pinned buffers of offloaded checkpointing happen there, as none of them can inside a capture.
- Its second is captured: the inputs are copied into static device buffers (with the window's trainable-token
  count, a device scalar in eager steps too), the forward and backward are recorded, and the graph is replayed.
  Whether the rows are packed is part of the shape: it decides the attention mask (:func:`_causal_rows`). Every
  later micro batch of that shape is copied into the buffers and replays the graph.
- At most ``MAX_GRAPHS`` shapes get graphs, which share one memory pool (it holds one step's activations); other
  shapes run eagerly.

Gradients, with several micro batches per optimizer step: a replay adds into the parameters' ``.grad`` tensors
that its capture saw, so the loop zeroes them after a step instead of freeing them. With one micro batch per step
(``gradient_accumulation_steps: 1``) nothing needs adding: each shape's graph is captured with no ``.grad``, so
its backward hands each gradient over as a fresh tensor of the graph (no add kernel, and nothing to zero), and a
replay points ``.grad`` at that graph's tensors; an eager micro batch first drops the ``.grad`` of the step
before. Nothing random may run inside a graph (:func:`refusal` turns graphs down for dropout) and nothing
may read a device value on the host: a capture that fails says why and leaves the rest of the run eager.

What a step keeps across micro batches on the host side (a preference objective's metric sums) cannot be added up
inside the graph, whose Python runs once: the step hands the adding to :func:`after_each_run`, which runs it at
once eagerly and, inside a capture, after each replay of that graph (reading the tensors the graph writes).
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from ..modules.lora_experts import LoRAExperts
from .losses import Batch, Count

MAX_GRAPHS = 4
# Config keys of Transformers models whose dropout runs in training mode.
_DROPOUT_KEYS = ("attention_dropout", "hidden_dropout", "dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop")

MicroStep = Callable[[Batch, Count], torch.Tensor]

# the callbacks of the graph being captured (empty: no capture under way)
_capturing: list[list[Callable[[], None]]] = []


def after_each_run(callback: Callable[[], None]) -> None:
    """Runs ``callback`` now, or, while a :class:`GraphedSteps` captures a step, after each replay of that graph
    (module docstring): for work on the values a step writes that must happen every time it runs, outside it."""
    if _capturing:
        _capturing[-1].append(callback)
    else:
        callback()


@contextlib.contextmanager
def _collecting(after: list[Callable[[], None]]) -> Iterator[None]:
    """Inside the block, :func:`after_each_run` appends to ``after``."""
    _capturing.append(after)
    try:
        yield
    finally:
        _capturing.pop()


def refusal(model: nn.Module) -> str | None:
    """Why ``model``'s training step cannot be replayed from a graph, or None when it can: dropout (a replay
    would draw the same numbers each time), MoE experts whose step reads the expert counts on the host
    (:meth:`LoRAExperts.host_reads`; the fused op on bf16 banks reads nothing there) and eager attention
    (Transformers builds its additive mask with ``torch.where`` on a Python scalar, a host-to-device copy a
    capture refuses: seen on the H200 with Transformers 5.17)."""
    for module in model.modules():
        if isinstance(module, LoRAExperts) and (why := module.host_reads()) is not None:
            return why
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) == "eager":
        return "eager attention builds its mask with a host-to-device copy (attn_implementation sdpa replays)"
    for key in _DROPOUT_KEYS:
        if (getattr(config, key, None) or 0) > 0:
            return f"the model's config sets {key}={getattr(config, key)}"
    for module in model.modules():
        p = module.p if isinstance(module, nn.Dropout) else getattr(module, "dropout_p", None)
        if p:
            return f"dropout p={p} in {type(module).__name__}"
    return None


def _first_cause(error: BaseException) -> str:
    """The first line of the error that broke a capture: ending a broken capture raises an error of its own,
    whose context is the one that says what broke it."""
    while error.__context__ is not None:
        error = error.__context__
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


def _end_generator_captures() -> None:
    """After a failed capture, CUDA's default generators still count as capturing (torch ends their capture
    with the graph's, which failed), and every later random draw would fail: each gets a fresh state with the
    same seed and offset."""
    for generator in torch.cuda.default_generators:
        fresh = torch.Generator(device=generator.device)
        fresh.set_state(generator.get_state())
        generator.graphsafe_set_state(fresh.graphsafe_get_state())


def packed(batch: Batch) -> bool:
    """Whether a row of the (host) batch holds several samples: its position ids restart somewhere."""
    positions = batch.get("position_ids")
    return positions is not None and bool((positions[:, 1:] != positions[:, :-1] + 1).any())


def _key(batch: Batch) -> tuple:
    """What a graph is captured for: the batch's shapes (an attention mask among them), and whether its rows are
    packed (the attention mask a replay builds differs)."""
    return (*((name, tuple(t.shape), t.dtype) for name, t in sorted(batch.items())), packed(batch))


@contextlib.contextmanager
def _causal_rows() -> Iterator[None]:
    """Inside a capture, lets Transformers' mask builder take its eager path for rows that are neither packed
    nor padded: no mask, SDPA's causal kernel.

    Eagerly it reads the position ids on the host to tell packed rows, and skips the mask for rows that are
    neither. Inside a capture it counts as tracing: it cannot read them, so it builds a full mask (Transformers
    5.17 always does while tracing), the same result at about three times the attention's cost. The host batch
    says which rows these are (:func:`_key`), and for them the builder is told that nothing is traced and that
    no row is packed; it then reads nothing on the device."""
    masking = importlib.import_module("transformers.masking_utils")
    patched = {
        "is_tracing": lambda tensor=None: False,
        "find_packed_sequence_indices": lambda position_ids: None,
    }
    saved = {name: getattr(masking, name) for name in patched if hasattr(masking, name)}
    for name in saved:
        setattr(masking, name, patched[name])
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(masking, name, value)


@dataclass
class _Graph:
    """One shape's graph: static inputs it reads, the window's token count, the loss it writes, and the
    gradients it writes (in :class:`GraphedSteps`'s parameter order; None where replays add into ``.grad``)."""

    graph: torch.cuda.CUDAGraph
    inputs: Batch
    num_items: torch.Tensor
    loss: torch.Tensor
    grads: list[torch.Tensor | None] | None = None
    after: list[Callable[[], None]] = field(default_factory=list)  # after_each_run's, in the step's order

    def load(self, batch: Batch, num_items: torch.Tensor) -> None:
        for name, tensor in batch.items():
            self.inputs[name].copy_(tensor, non_blocking=True)
        self.num_items.copy_(num_items)


class GraphedSteps:
    """Runs micro steps (``step(batch_on_device, num_items) -> loss``, the forward and the backward) from CUDA
    graphs, one per batch shape, as the module docstring says; ``note`` receives what a person should know (a
    capture that failed). With ``params`` (the trainable parameters, for one micro batch per optimizer step) every
    micro batch writes their ``.grad`` instead of adding into it (module docstring).

    Call it with a micro batch on the host and the window's trainable tokens (a device scalar); it returns the
    loss on the device.
    """

    def __init__(
        self,
        step: MicroStep,
        device: torch.device,
        note: Callable[[str], None],
        params: Sequence[nn.Parameter] | None = None,
    ) -> None:
        self.step, self.device, self.note = step, device, note
        self.params = list(params) if params is not None else None
        self.stream = torch.cuda.Stream(device)
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple, _Graph] = {}
        self.seen: set[tuple] = set()
        self.enabled = True
        self.replays = self.eager_steps = 0

    def __call__(self, batch: Batch, num_items: torch.Tensor) -> torch.Tensor:
        key = _key(batch)
        graph = self.graphs.get(key)
        if graph is None and self.enabled and key in self.seen and len(self.graphs) < MAX_GRAPHS:
            graph = self._capture(key, batch, num_items)
        if graph is None:
            self.seen.add(key)
            self.eager_steps += 1
            self._drop_grads()
            return self._eager(batch, num_items)
        graph.load(batch, num_items)
        graph.graph.replay()
        for callback in graph.after:
            callback()
        self.replays += 1
        if graph.grads is not None:
            for param, grad in zip(self.params, graph.grads, strict=True):
                if param.grad is not grad:
                    param.grad = grad
        return graph.loss

    @property
    def writes_grads(self) -> bool:
        """Whether each micro batch writes the gradients (nothing to zero between steps)."""
        return self.params is not None

    def _drop_grads(self) -> None:
        """Where micro batches write the gradients: the ``.grad`` of the step before let go, so that the next
        backward hands over fresh ones."""
        for param in self.params or ():
            param.grad = None

    def _eager(self, batch: Batch, num_items: torch.Tensor) -> torch.Tensor:
        """The step on the capture stream, ordered after what the current stream queued and before what it
        queues next."""
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            loss = self.step({k: v.to(self.device, non_blocking=True) for k, v in batch.items()}, num_items)
        current.wait_stream(self.stream)
        loss.record_stream(current)
        return loss

    def _capture(self, key: tuple, batch: Batch, count: torch.Tensor) -> _Graph | None:
        """The graph of ``batch``'s key, its static inputs holding ``batch`` (None when capturing fails)."""
        inputs = {name: t.to(self.device, copy=True) for name, t in batch.items()}
        num_items = count.clone()
        graph = torch.cuda.CUDAGraph()
        causal = not key[-1] and "attention_mask" not in batch
        masks = _causal_rows() if causal else contextlib.nullcontext()
        self._drop_grads()
        after: list[Callable[[], None]] = []
        try:
            with masks, _collecting(after), torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
                loss = self.step(inputs, num_items)
        except RuntimeError as error:
            self.enabled, self.pool = False, None
            del graph, inputs, num_items
            _end_generator_captures()
            torch.cuda.empty_cache()  # what the failed capture reserved
            self.note(
                f"training.cuda_graphs: capturing the step failed ({_first_cause(error)}); the run goes on eagerly"
            )
            return None
        grads = [param.grad for param in self.params] if self.params is not None else None
        self.graphs[key] = _Graph(graph, inputs, num_items, loss.detach(), grads, after)
        return self.graphs[key]

    def summary(self) -> str:
        """One line: how many micro batches replayed graphs, of how many shapes."""
        shapes = len(self.graphs)
        return (
            f"CUDA graphs: {self.replays} micro batches replayed from {shapes} captured shape(s), "
            f"{self.eager_steps} ran eagerly"
        )
