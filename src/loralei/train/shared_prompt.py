"""Preference pairs with their prompt run once (``preference.share_prompt``): the attention over a pair's two
virtual rows, and when the runner stores its pairs that way.

The batches (:mod:`loralei.train.data.shared_prompt`) store each pair with its prompt once; the projections,
norms and MLPs of every layer then run over the prompt's tokens once instead of twice. Attention runs as the
unshared rows would have it: the stored tokens' queries, keys and values are gathered into the pair's two virtual
rows (chosen: prompt and chosen completion; rejected: prompt and rejected completion), causal attention of the
model's own kind runs over them, and each stored token takes its output back from its row. The gathers' backward
adds the prompt's key and value gradients from both rows, so losses and gradients are the unshared ones (up to the
order of floating-point sums). The prompt's queries run in both rows; the rejected row's copy of their outputs is
not read. Each gather's backward is a gather too (:func:`loralei.kernels.gather_sum.gather_sum`, from the places
the batch lists): every gradient row is written once, without the atomic adds of ``index_select``'s backward, and
the same in every run.

Where it pays: the prompt's share of the tokens (a pair of prompt ``p`` and completions ``c``, ``r`` runs
``p + c + r + 1`` tokens instead of ``2p + c + r``), in rows of a pair each or packed. The pair objectives only (not
KTO's unpaired examples); where it does not run (``auto`` says why, ``true`` refuses): rows padded to one width
(``pad_to_max_length``, or CUDA graphs replaying them), ``torch_compile``, sequence parallelism, offloaded rows long
enough to keep their attention outputs, an attention other than ``sdpa``, sliding windows shorter than the
sequences, batches the caller collates.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import nn

from ..errors import ConfigError
from ..kernels.gather_sum import gather_sum
from . import kept_attention
from .losses import PAIR_MAPS, PAIR_ROWS

NAME = "loralei_shared_prompt"  # the attention implementation of a model whose batches share prompts
INNER = "sdpa"  # the attention that runs over the virtual rows
_ARGUMENT = "preference.share_prompt"
_UNPAIRED = ("sft", "kto")  # the objectives whose rows are not pairs
_CALLS = [0]  # attention calls that read pair rows, this process (a model that drops them: checked_forward)
T = TypeVar("T")


def checked_forward(forward: Callable[[], T], batch: dict[str, torch.Tensor]) -> T:
    """``forward()`` of a batch; for one whose pairs store their prompts once, raises unless the model's attention
    read their virtual rows (a family whose attention module does not pass its keyword arguments on would attend
    over the stored rows as they stand, the rejected completion seeing the chosen one).

    Raises:
        ConfigError: naming the setting to turn off.
    """
    if PAIR_ROWS not in batch:
        return forward()
    before = _CALLS[0]
    out = forward()
    if _CALLS[0] == before:
        raise ConfigError(
            f"{_ARGUMENT}: the model's attention never received the batch's pair rows (its attention modules do "
            "not pass their keyword arguments on to the attention function), so it cannot run each pair's two "
            "sequences apart; set preference.share_prompt: false"
        )
    return out


class _Gather(torch.autograd.Function):
    """``states.index_select(0, index)`` whose backward gathers: each source row's gradient is the gradient rows
    at its ``places`` (``(N,)`` or ``(N, 2)``, -1 for none: every place that reads it), added."""

    @staticmethod
    def forward(ctx, states: torch.Tensor, index: torch.Tensor, places: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(places)
        return states.index_select(0, index)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (places,) = ctx.saved_tensors
        first, second = (places, None) if places.dim() == 1 else places.unbind(1)
        rows = gather_sum(grad.reshape(grad.shape[0], -1), first, second)
        return rows.view(-1, *grad.shape[1:]), None, None


def _virtual(states: torch.Tensor, rows: torch.Tensor, places: torch.Tensor) -> torch.Tensor:
    """(B, heads, L, D) stored tokens' states as the (V, heads, W, D) states of the virtual rows ``rows``
    (``places``: :data:`PAIR_PLACES`)."""
    heads, dim = states.shape[1], states.shape[3]
    tokens = states.transpose(1, 2).reshape(-1, heads, dim)
    gathered = _Gather.apply(tokens, rows.flatten(), places.view(-1, 2))
    return gathered.view(*rows.shape, heads, dim).transpose(1, 2)


def shared_prompt_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Transformers' attention-function signature: causal attention over each pair's virtual rows (the batch's
    :data:`PAIR_ROWS`), every stored token's output taken from its own row (:data:`PAIR_OUTPUTS`); a call without
    them (a batch of other rows) is the inner attention's."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    maps = [kwargs.pop(name, None) for name in PAIR_MAPS]
    inner = ALL_ATTENTION_FUNCTIONS[INNER]
    if any(m is None for m in maps):
        return inner(module, query, key, value, attention_mask, **kwargs)
    rows, outputs, places, output_tokens = maps
    _CALLS[0] += 1
    kwargs.pop("position_ids", None)  # the stored tokens'; the virtual rows run in order
    kwargs.pop("is_causal", None)
    q, k, v = (_virtual(states, rows, places) for states in (query, key, value))
    out, _ = inner(module, q, k, v, None, is_causal=True, **kwargs)  # (V, W, heads, D)
    stored = _Gather.apply(out.reshape(-1, *out.shape[2:]), outputs.flatten(), output_tokens.flatten())
    return stored.view(*outputs.shape, *out.shape[2:]), None


def _register() -> None:
    """:data:`NAME` in Transformers' registries, with :data:`INNER`'s mask function: a call without pair rows (the
    model generating after training, say) gets the mask its own attention takes; the virtual rows read none."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(NAME, shared_prompt_attention)
    AttentionMaskInterface.register(NAME, ALL_MASK_ATTENTION_FUNCTIONS[INNER])


def enable(model: nn.Module) -> None:
    """Switches ``model``'s attention to :func:`shared_prompt_attention` (which runs :data:`INNER` within)."""
    _register()
    model.set_attn_implementation(NAME)


def refusal(cfg: Any, own_batches: bool = False) -> str | None:
    """Why this run cannot store its pairs' prompts once, or ``None`` when it can (module docstring)."""
    t = cfg.training
    reasons = [
        (
            t.pad_to_max_length,
            "rows padded to one width (training.pad_to_max_length) would pad twice the tokens",
        ),
        (t.cuda_graphs is True, "CUDA graphs replay rows of one width (training.cuda_graphs)"),
        (t.torch_compile, "training.torch_compile is not run with it"),
        (t.sequence_parallel_size > 1, "sequence parallelism splits rows, not pairs"),
        (
            kept_attention.keeps(t.gradient_checkpointing, t.max_seq_length),
            f"offloaded rows of {kept_attention.AUTO_TOKENS:,} tokens or more keep their whole rows' attention outputs",
        ),
        (cfg.attn_implementation != INNER, f"it runs {INNER} attention, not {cfg.attn_implementation}"),
        (own_batches, "the batches are the caller's"),
    ]
    return next((why for refused, why in reasons if refused), None)


def model_refusal(model: nn.Module, max_seq_length: int) -> str | None:
    """Why ``model``'s own attention is not what the virtual rows run (:data:`INNER`, causal, no window), or
    ``None``."""
    config = model.config
    implementation = getattr(config, "_attn_implementation", None)
    if implementation != INNER:
        return f"the model runs {implementation} attention, not {INNER}"
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    windowed = getattr(config, "use_sliding_window", True) and (
        layer_types is None or "sliding_attention" in layer_types
    )
    if window and windowed and max_seq_length > window:
        return (
            f"the model's sliding-window layers ({window} tokens) need their mask for sequences of up to "
            f"{max_seq_length} tokens"
        )
    return None


def requested(cfg: Any) -> bool | str:
    """``preference.share_prompt`` as set (``"auto"`` without a preference section)."""
    return "auto" if cfg.preference is None else cfg.preference.share_prompt


def resolve(cfg: Any, model: nn.Module, collate: Any, own_batches: bool) -> tuple[Any, list[str]]:
    """The collator, storing each pair's prompt once where ``preference.share_prompt`` asks for it (``auto``: where
    it can), with ``model``'s attention switched to match; and the note saying what ``auto`` chose.

    Raises:
        ConfigError: ``share_prompt: true`` for a run that cannot (:func:`refusal`).
    """
    wanted = requested(cfg)
    if cfg.training.objective in _UNPAIRED or wanted is False:
        return collate, []
    refused = refusal(cfg, own_batches) or model_refusal(model, cfg.training.max_seq_length)
    if refused is not None:
        if wanted is True:
            raise ConfigError(f"{_ARGUMENT}: true cannot run here: {refused}; set it to auto or false")
        return collate, [f"{_ARGUMENT}: auto -> off: {refused}"]
    enable(model)
    base = dataclasses.replace(collate.base, max_seq_length=2 * cfg.training.max_seq_length)
    note = "each pair's prompt stored and run once; attention over each pair's two sequences as they read"
    return dataclasses.replace(collate, base=base, share_prompt=True), [
        f"{_ARGUMENT}: {'auto -> ' if wanted == 'auto' else ''}on: {note}"
    ]
