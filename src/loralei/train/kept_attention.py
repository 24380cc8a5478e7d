"""Attention computed once per step under offloaded checkpointing: each layer's forward keeps its attention
output and log-sum-exp in host memory beside the layer's input, and the backward's recomputation of the layer
takes them back instead of running attention again (:mod:`loralei.ops.attention`).

At long context attention is most of a step's time, and its second forward about a fifth of the step at 32K
tokens (Llama-3-8B shape on an H200: 14 ms of the 57 ms forward + backward, per layer). Keeping the output costs
host memory (the output's bytes per layer: as much again as the layer input for Llama-3) and a copy each way,
which overlaps compute as the inputs' copies do: what the layer before kept comes back once this one's q/k/v
projections' backward is done (its attention module tells the layer its input, whose gradient marks that point),
behind the layer before's input on the same copy stream, so that the copies' device memory never meets the
attention backward's gradients, where the step's peak is.

The attention's projections (q/k/v and o) keep their outputs the same way (:mod:`loralei.ops.kept_outputs`):
their recomputation then forms only the rank-r products their backward reads, not the base GEMMs (most of what
is left to recompute: an estimated 3 % of the 8B step at 32K tokens). They take what the host budget leaves
once every layer's input and attention output are counted, layer by layer from the first; a projection whose
base takes its input's FP8 codes from a norm (:mod:`loralei.fusion.residual`) is left out, since its
recomputation's norm makes them anyway.

It applies to causal attention without a mask under ``sdpa`` (one sequence per row, or rows with no padding),
where PyTorch would run the cuDNN or flash kernel (:func:`loralei.ops.attention.kernel_for`); any other call
(a mask, dropout, a kernel that is neither) runs Transformers' sdpa attention as it would have. Host memory is
bounded: every layer's input and the kept results fit in :data:`HOST_SHARE` of the host's memory, each counted
as the pinned buffer that holds it (:mod:`.pinned`); where not every layer's results fit, the first layers keep
theirs and the others recompute attention (and their projections). A recomputed attention runs the same kernel
through :func:`loralei.ops.attention.replayed` too, so that its backward also goes in groups of heads and the
layer before's input comes back only after it. The backward is the kernel's own, on the same operands as after
``scaled_dot_product_attention``: losses and gradients are unchanged (bit for bit on the CPU; on CUDA the query
gradient of cuDNN's backward varies from run to run in the last bits either way).
"""

from __future__ import annotations

import contextlib
import functools
import os
import weakref
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from torch import Tensor, nn

from ..fusion.specs import spec_for
from ..modules.lora_linear import LoRALinear
from ..ops import attention, kept_outputs
from . import launch, tiled_mlp
from .pinned import held_bytes, tensor_held_bytes

NAME = "loralei_kept_sdpa"  # the attention implementation a model runs under while it keeps attention outputs
HOST_SHARE = (
    0.5  # of the host's memory (host_memory) that offloaded inputs and kept outputs may take together
)
AUTO_TOKENS = tiled_mlp.AUTO_TOKENS  # rows at least this long keep attention (shorter: little to gain)


def keeps(gradient_checkpointing: bool | str, max_seq_length: int, sequence_parallel_size: int = 1) -> bool:
    """Whether a run keeps attention (and projection) outputs in host memory: offloaded checkpointing of rows of
    :data:`AUTO_TOKENS` or more, unless its sequences are split over ranks (whose attention exchanges heads
    around the kernel: :mod:`.sequence_parallel`)."""
    long_rows = max_seq_length >= AUTO_TOKENS
    return gradient_checkpointing == "offload" and long_rows and sequence_parallel_size == 1


# a container's memory limit: cgroup v2, then v1 (absent, "max" or a huge number where there is none)
MEMORY_LIMITS = (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"))


def host_memory(limits: Sequence[Path] = MEMORY_LIMITS) -> int:
    """Bytes of host memory this process may use: the physical memory, lowered to its container's limit where
    it has one (a container often sees all of its host's memory but may use a part), shared equally by the
    processes torchrun started on this machine (``LOCAL_WORLD_SIZE``), which offload alike."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in limits:
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return total // launch.local_processes()


@functools.cache
def host_budget() -> int:
    """Bytes of host memory the offloaded layer inputs, kept attention results and projection outputs may take
    (read once: every pass asks, and the container's limit is a file)."""
    return int(HOST_SHARE * host_memory())


def _nothing() -> None:
    pass


def _dense(tensor: Tensor) -> tuple[Tensor, list[int]]:
    """``tensor`` permuted to the order of its memory (a contiguous view when it is dense), and the permutation."""
    order = sorted(range(tensor.dim()), key=lambda d: -tensor.stride(d))
    return tensor.permute(order), order


def _undone(tensor: Tensor, order: list[int]) -> Tensor:
    inverse = [0] * len(order)
    for position, dim in enumerate(order):
        inverse[dim] = position
    return tensor.permute(inverse)


class _Held(NamedTuple):
    """One attention call's kept results, away from the device."""

    kernel: attention.Kernel
    out: Any  # holders (see LayerAttention)
    order: list[int]  # the output's dimensions in memory order, as kept
    lse: Any
    extras: tuple

    def fetch(self) -> attention.Kept:
        return attention.Kept(
            self.kernel, _undone(self.out.fetch(), self.order), self.lse.fetch(), self.extras
        )


class PassKeeping:
    """What one pass keeps in host memory: how many of its layers may keep attention results (from the first),
    the bytes of the budget it has left for projection outputs (claimed as they are kept), how many of its
    layers kept attention results and projection outputs, and whether a claim found the budget short."""

    def __init__(self, nbytes: int, attention_room: int = 0) -> None:
        self.left, self.attention_room = nbytes, attention_room
        self.attention_layers = self.output_layers = 0
        self.short = False

    def claim(self, nbytes: int) -> bool:
        if nbytes > self.left:
            self.short = True
            return False
        self.left -= nbytes
        return True


# one call's kept outputs: each tensor's holder and its dimensions in memory order
_HeldOutputs = list[tuple[Any, list[int]]]


class LayerAttention:
    """The attention results of one checkpointed layer's forward, and its attention projections' outputs, kept
    for its recomputation (a :class:`loralei.ops.kept_outputs.Keeper`).

    ``store`` sends a tensor to where it waits (a pinned host buffer on CUDA) and returns its holder: an object
    with ``prefetch()`` (start the copy back) and ``fetch()`` (the tensor on its device). ``owners``: the ids of
    the projections whose outputs may be kept, within ``kept``'s budget (the pass's, which counts what its layers
    keep).
    """

    current: LayerAttention | None = None  # the layer running now: forward (recording) or recomputation

    def __init__(
        self,
        keeping: bool,
        store: Callable[[Tensor], Any],
        owners: frozenset[int] = frozenset(),
        kept: PassKeeping | None = None,
    ) -> None:
        self.keeping, self.store = keeping, store
        self.owners, self.pass_kept = owners, kept or PassKeeping(0)
        self.held: list[_Held | None] = []  # per attention call; None: it runs again in the recomputation
        self.back: list[attention.Kept | None] | None = None  # the kept results on the device, once fetched
        # kept projection outputs by projection (its first module's id), per call (None: not kept)
        self.outputs: dict[int, list[_HeldOutputs | None]] = {}
        # every kept tensor's holder, in the order the forward kept them (weakly: a holder taken back goes)
        self.holders: list[weakref.ref] = []
        self.replaying, self.cursor = False, 0
        # what runs once the recomputed attention's backward is done, and once its input has its gradient
        self.after_attention: Callable[[], None] = _nothing
        self.after_projections: Callable[[], None] = _nothing
        self.input_hooked = False  # this recomputation's attention input will say when it has its gradient
        # the forward's attention ran on a kernel of ops.attention, kept or not: the recomputation's attention
        # then runs through attention.replayed, whose backward (in groups of heads) calls done
        self.attends = False

    def _takes_part(self, owners: Sequence[nn.Module]) -> bool:
        return self.keeping and all(id(module) in self.owners for module in owners)

    def keep_outputs(self, owners: Sequence[nn.Module], outputs: Sequence[Tensor]) -> None:
        """Keeps one projection call's outputs, where its modules take part and the pass's budget holds them
        (otherwise that call runs again in the recomputation)."""
        if not self._takes_part(owners):
            return
        calls = self.outputs.setdefault(id(owners[0]), [])
        if not self.pass_kept.claim(sum(tensor_held_bytes(t) for t in outputs)):
            calls.append(None)
            return
        if not any(call for per_call in self.outputs.values() for call in per_call):  # the layer's first
            self.pass_kept.output_layers += 1
        calls.append([(self._store(dense), order) for dense, order in map(_dense, outputs)])

    def take_outputs(self, owners: Sequence[nn.Module]) -> list[Tensor] | None:
        """The next kept outputs of these projections on the device (handed out once: the recomputation's
        graph holds them from then on), or None."""
        calls = self.outputs.get(id(owners[0])) if self._takes_part(owners) else None
        held = calls.pop(0) if calls else None
        return None if held is None else [_undone(holder.fetch(), order) for holder, order in held]

    def keep(self, kept: attention.Kept | None) -> None:
        """Keeps one attention call's results (None: the call ran as usual and will again)."""
        if kept is None:
            self.held.append(None)
            return
        out, order = _dense(kept.out)
        if not self.kept():  # the layer's first kept attention results
            self.pass_kept.attention_layers += 1
        self.held.append(_Held(kept.kernel, self._store(out), order, self._store(kept.lse), kept.extras))

    def _store(self, tensor: Tensor) -> Any:
        holder = self.store(tensor)
        self.holders.append(weakref.ref(holder))
        return holder

    def prefetch(self) -> None:
        """Starts bringing the kept results and outputs back to the device, in the order the forward kept them,
        which is the order the recomputation takes them in (q/k/v, the attention's, o)."""
        for ref in self.holders:
            if (holder := ref()) is not None:
                holder.prefetch()

    def kept(self) -> bool:
        """Whether the forward kept results of any attention call (then :meth:`done` runs in the backward)."""
        return any(held is not None for held in self.held)

    def next(self) -> attention.Kept | None:
        """The next attention call's kept results on the device (fetched once, for every replay), or None."""
        if self.back is None:
            self.back = [None if held is None else held.fetch() for held in self.held]
        self.cursor += 1
        return self.back[self.cursor - 1]

    def done(self) -> None:
        """The recomputed attention's backward ran: the device copies go (its node held its own), and what
        comes after the attention (once) starts; what comes after the projections too, unless the attention's
        input said it would tell (:meth:`note_input`)."""
        after, self.after_attention = self.after_attention, _nothing
        self.back, self.held, self.holders = None, [], []
        after()
        if not self.input_hooked:
            self._projections_done()

    def note_input(self, hidden: Tensor) -> None:
        """The attention block's input in a recomputation whose attention runs on a kernel of
        :mod:`loralei.ops.attention` (kept or computed again): once its gradient is formed (the q/k/v
        projections' backward done, their output gradients let go), what comes after the projections starts."""
        if self.replaying and self.attends and hidden.requires_grad and not self.input_hooked:
            self.input_hooked = True
            hidden.register_hook(lambda _: self._projections_done())

    def _projections_done(self) -> None:
        after, self.after_projections = self.after_projections, _nothing
        after()

    @contextlib.contextmanager
    def running(
        self,
        replaying: bool,
        after_attention: Callable[[], None] = _nothing,
        after_projections: Callable[[], None] = _nothing,
    ) -> Iterator[None]:
        """This layer's forward (``replaying`` False) or one run of its recomputation: attention calls inside
        keep their results, or take them back; in a recomputation, ``after_attention`` runs once the attention
        backward is done and ``after_projections`` once the q/k/v projections' backward is (both once)."""
        previous, LayerAttention.current = LayerAttention.current, self
        self.replaying, self.cursor, self.input_hooked = replaying, 0, False
        self.after_attention, self.after_projections = after_attention, after_projections
        try:
            with kept_outputs.keeping(self):
                yield
        finally:
            LayerAttention.current = previous


def _plain_causal(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    mask: Tensor | None,
    dropout: float,
    causal: bool | None,
    kw: dict,
) -> bool:
    """Whether sdpa would run this call as causal attention over the whole row, with nothing else."""
    causal = causal if causal is not None else getattr(module, "is_causal", True)
    extras = ("position_bias", "softcap", "s_aux")
    return (
        causal
        and mask is None
        and not dropout
        and not any(kw.get(name) is not None for name in extras)
        and not kw.get("output_attentions")
        and query.shape[2] == key.shape[2] > 1
    )


def kept_sdpa_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """Transformers' attention-function signature: sdpa attention, kept or taken back inside a checkpointed
    layer (:class:`LayerAttention`), as usual elsewhere."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    layer = LayerAttention.current
    if layer is not None and _plain_causal(module, query, key, attention_mask, dropout, is_causal, kwargs):
        if layer.replaying:
            kept = layer.next() if layer.keeping else None
            if kept is None and layer.attends:  # computed again, through the kernel the forward ran
                kernel = attention.kernel_for(query, key, value, scaling)
                kept = None if kernel is None else attention.attend(kernel, query, key, value, scaling)
            if kept is not None:
                out = attention.replayed(query, key, value, kept, scaling, layer.done)
                return out.transpose(1, 2).contiguous(), None
        else:
            kernel = attention.kernel_for(query, key, value, scaling)
            layer.attends |= kernel is not None
            if layer.keeping:
                kept = None if kernel is None else attention.attend(kernel, query, key, value, scaling)
                layer.keep(kept)
                if kept is not None:
                    return kept.out.transpose(1, 2).contiguous(), None
    return sdpa_attention_forward(
        module,
        query,
        key,
        value,
        attention_mask,
        dropout=dropout,
        scaling=scaling,
        is_causal=is_causal,
        **kwargs,
    )


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, kept_sdpa_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)


class AttentionBudget(NamedTuple):
    """What a pass may keep in host memory beside its ``layers`` inputs (each like the first), within
    :func:`host_budget`: attention outputs and log-sum-exps in as many layers as fit, and where every layer's do,
    the outputs of the projections ``owners`` (module ids) in what is left."""

    layers: int
    hidden_size: int
    heads: int
    head_dim: int
    owners: frozenset[int] = frozenset()

    def _held(self, hidden: Tensor) -> tuple[int, int]:
        """Bytes a layer's input and its attention results take, each as the host buffer that holds it
        (:func:`~loralei.train.pinned.held_bytes`)."""
        tokens, pinned, size = hidden.numel() // self.hidden_size, hidden.is_cuda, hidden.element_size()
        layer_input = held_bytes(tokens * self.hidden_size * size, pinned)
        attention_output = held_bytes(tokens * self.heads * self.head_dim * size, pinned)
        log_sum_exp = held_bytes(tokens * self.heads * 4, pinned)  # fp32
        return layer_input, attention_output + log_sum_exp

    def spare(self, hidden: Tensor) -> int:
        """Bytes of the budget left once the pass's inputs and every layer's attention results are counted
        (negative: they do not fit)."""
        return host_budget() - self.layers * sum(self._held(hidden))

    def plan(self, hidden: Tensor) -> PassKeeping:
        """What the pass of this first layer input may keep: every layer's attention results and the spare bytes
        for projection outputs, or, where they do not all fit, the results of as many layers as the budget holds
        beside the inputs (the others recompute attention) and no projection outputs."""
        spare = self.spare(hidden)
        if spare >= 0:
            return PassKeeping(spare, self.layers)
        inputs, results = self._held(hidden)
        return PassKeeping(0, max(host_budget() - self.layers * inputs, 0) // results)


def _keepable(module: nn.Module) -> bool:
    """A projection whose output may be kept: a LoRA linear whose base does not take FP8 codes from a norm."""
    quant = getattr(module, "quant", None)
    return isinstance(module, LoRALinear) and (quant is None or quant.row_factors() is None)


def projection_owners(model: nn.Module) -> frozenset[int]:
    """Ids of ``model``'s attention projections (by its family's names) whose outputs may be kept."""
    names = spec_for(model).attention
    return frozenset(
        id(module)
        for name, module in model.named_modules()
        if name.rpartition(".")[2] in names and _keepable(module)
    )


# attention modules that tell the layer running them their input (:meth:`LayerAttention.note_input`)
_NOTING: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def _note_input(module: nn.Module, args: tuple, kwargs: dict) -> None:
    layer = LayerAttention.current
    hidden = kwargs.get("hidden_states", args[0] if args else None)
    if layer is not None and isinstance(hidden, Tensor):
        layer.note_input(hidden)


def _attention_modules(model: nn.Module) -> list[nn.Module]:
    """``model``'s attention modules: the parents of its family's attention projections."""
    names = spec_for(model).attention
    paths = {name.rpartition(".")[0] for name, _ in model.named_modules() if name.rpartition(".")[2] in names}
    return [model.get_submodule(path) for path in sorted(paths)]


def enable(model: nn.Module, layers: int) -> tuple[AttentionBudget, str] | None:
    """Makes ``model``'s sdpa attention keep its outputs in its ``layers`` checkpointed layers; the budget the
    checkpoint function applies and the line for the run's report, or None when the attention is not sdpa."""
    config = model.config
    if getattr(config, "_attn_implementation", None) != "sdpa":
        return None
    _register()
    model.set_attn_implementation(NAME)
    for module in _attention_modules(model):
        if module not in _NOTING:
            module.register_forward_pre_hook(_note_input, with_kwargs=True)
            _NOTING.add(module)
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    owners = projection_owners(model)
    note = (
        "attention: computed once per step (its outputs kept in host memory beside the offloaded layer inputs, "
        f"in as many layers as {HOST_SHARE:.0%} of it holds; the recomputation takes them back)"
    )
    if owners:
        note += (
            f"; the outputs of its {len(owners)} q/k/v and o projections too, as far as the rest of that share "
            "goes: those are not recomputed"
        )
    return AttentionBudget(layers, config.hidden_size, heads, head_dim, owners), note
