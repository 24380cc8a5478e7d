"""Attention computed once per step under offloaded checkpointing: each layer's forward keeps its attention
output and log-sum-exp in host memory beside the layer's input, and the backward's recomputation of the layer
takes them back instead of running attention again (:mod:`loralei.ops.attention`).

At long context attention is most of a step's time, and its second forward about a fifth of the step at 32K
tokens (Llama-3-8B shape on an H200: 14 ms of the 57 ms forward + backward, per layer). Keeping the output costs
host memory (the output's bytes per layer: as much again as the layer input for Llama-3) and a copy each way,
which overlaps compute as the inputs' copies do: the output of the layer before comes back while this one's
attention backward ends and the layer's recomputation starts.

It applies to causal attention without a mask under ``sdpa`` (one sequence per row, or rows with no padding),
where PyTorch would run the cuDNN or flash kernel (:func:`loralei.ops.attention.kernel_for`); any other call
(a mask, dropout, a kernel that is neither) runs Transformers' sdpa attention as it would have. Host memory is
bounded: a pass keeps the outputs only when every layer's input and output fit in :data:`HOST_SHARE` of the
host's memory; otherwise that pass recomputes attention, as before. The backward is the kernel's own, on the
same operands as after ``scaled_dot_product_attention``: losses and gradients are unchanged (bit for bit on the
CPU; on CUDA the query gradient of cuDNN's backward varies from run to run in the last bits either way).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

from torch import Tensor, nn

from ..ops import attention
from . import tiled_mlp

NAME = "loralei_kept_sdpa"  # the attention implementation a model runs under while it keeps attention outputs
HOST_SHARE = 0.5  # of the host's memory that offloaded inputs and kept outputs may take together
AUTO_TOKENS = tiled_mlp.AUTO_TOKENS  # rows at least this long keep attention (shorter: little to gain)


def host_budget() -> int:
    """Bytes of host memory the offloaded layer inputs and kept attention outputs may take."""
    return int(HOST_SHARE * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


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

    def prefetch(self) -> None:
        self.out.prefetch()
        self.lse.prefetch()

    def fetch(self) -> attention.Kept:
        return attention.Kept(
            self.kernel, _undone(self.out.fetch(), self.order), self.lse.fetch(), self.extras
        )


class LayerAttention:
    """The attention results of one checkpointed layer's forward, kept for its recomputation.

    ``store`` sends a tensor to where it waits (a pinned host buffer on CUDA) and returns its holder: an object
    with ``prefetch()`` (start the copy back) and ``fetch()`` (the tensor on its device).
    """

    current: LayerAttention | None = None  # the layer running now: forward (recording) or recomputation

    def __init__(self, keeping: bool, store: Callable[[Tensor], Any]) -> None:
        self.keeping, self.store = keeping, store
        self.held: list[_Held | None] = []  # per attention call; None: it runs again in the recomputation
        self.back: list[attention.Kept | None] | None = None  # the kept results on the device, once fetched
        self.replaying, self.cursor = False, 0
        self.after: Callable[[], None] = _nothing

    def keep(self, kept: attention.Kept | None) -> None:
        """Keeps one attention call's results (None: the call ran as usual and will again)."""
        if kept is None:
            self.held.append(None)
            return
        out, order = _dense(kept.out)
        self.held.append(_Held(kept.kernel, self.store(out), order, self.store(kept.lse), kept.extras))

    def prefetch(self) -> None:
        """Starts bringing the kept results back to the device."""
        for held in self.held:
            if held is not None:
                held.prefetch()

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
        comes after (once) starts."""
        after, self.after = self.after, _nothing
        self.back, self.held = None, []
        after()

    @contextlib.contextmanager
    def running(self, replaying: bool, after: Callable[[], None] = _nothing) -> Iterator[None]:
        """This layer's forward (``replaying`` False) or one run of its recomputation: attention calls inside
        keep their results, or take them back."""
        previous, LayerAttention.current = LayerAttention.current, self
        self.replaying, self.cursor, self.after = replaying, 0, after
        try:
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
    if (
        layer is not None
        and layer.keeping
        and _plain_causal(module, query, key, attention_mask, dropout, is_causal, kwargs)
    ):
        if layer.replaying and (kept := layer.next()) is not None:
            out = attention.replayed(query, key, value, kept, scaling, layer.done)
            return out.transpose(1, 2).contiguous(), None
        kernel = None if layer.replaying else attention.kernel_for(query, key, value, scaling)
        if kernel is not None:
            kept = attention.attend(kernel, query, key, value, scaling)
            layer.keep(kept)
            return kept.out.transpose(1, 2).contiguous(), None
        if not layer.replaying:
            layer.keep(None)
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
    """Whether a pass may keep its layers' attention results in host memory: its ``layers`` inputs (each like
    the first) and their attention outputs and log-sum-exps within :func:`host_budget`."""

    layers: int
    hidden_size: int
    heads: int
    head_dim: int

    def fits(self, hidden: Tensor) -> bool:
        tokens = hidden.numel() // self.hidden_size
        per_layer = tokens * (self.hidden_size + self.heads * self.head_dim) * hidden.element_size()
        per_layer += tokens * self.heads * 4  # the log-sum-exp, fp32
        return self.layers * per_layer <= host_budget()


def enable(model: nn.Module, layers: int) -> tuple[AttentionBudget, str] | None:
    """Makes ``model``'s sdpa attention keep its outputs in its ``layers`` checkpointed layers; the budget the
    checkpoint function applies and the line for the run's report, or None when the attention is not sdpa."""
    config = model.config
    if getattr(config, "_attn_implementation", None) != "sdpa":
        return None
    _register()
    model.set_attn_implementation(NAME)
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    note = (
        "attention: computed once per step (its outputs kept in host memory beside the offloaded layer inputs, "
        f"while both fit in {HOST_SHARE:.0%} of it; the recomputation takes them back)"
    )
    return AttentionBudget(layers, config.hidden_size, heads, head_dim), note
