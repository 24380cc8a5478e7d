"""Sequence parallelism, Ulysses-style: one sequence split over the ``N`` ranks of a group.

Each rank holds ``L / N`` consecutive positions of every row (:func:`shard_batch`): its embeddings, norms, MLPs,
LoRA products and its share of the loss run on those alone. Around attention an all-to-all trades the split:
before it a rank holds all heads of its positions, after it ``H / N`` heads of every position, so attention runs
over the whole sequence, head group by head group, and a second all-to-all trades back
(:func:`ulysses_attention`). Both exchanges are differentiable: the backward exchanges the gradients the same way.

Why the gradients are exact: every rank's loss is the sum of its positions' token losses over the window's
trainable tokens counted on every rank (:func:`loralei.train.loop.window_counts`), and the gradients are summed
over all ranks (DDP's FP32 sum hook). The sum over a group of its ranks' losses is the loss of the whole
sequence, and the sum of the ranks' gradients is that loss's gradient: the parameters are replicated, and each
rank's backward carries the other ranks' contributions to its positions through the exchanges. Groups are
consecutive ranks (``[0, N)``, ``[N, 2N)``, ...); data parallelism runs over the groups, which draw different
batches (:func:`data_rank`), and composes with it unchanged.

The targets are shifted before the sequence is cut (position ``t`` predicts token ``t + 1``, which may sit on the
next rank), so a shard carries them pre-shifted (:data:`loralei.train.losses.SHIFTED`). Rows are padded on the
right to a multiple of ``N``; padding comes after every real token, and causal attention never lets a real token
see it, so the attention mask is dropped: the model attends causally over each whole row.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..errors import ConfigError
from . import distributed
from .losses import IGNORE_INDEX, SHIFTED, Batch, shift_targets, trainable_labels

NAME = "loralei_ulysses"  # the attention implementation a sequence-parallel model runs under
INNER = ("sdpa", "flash_attention_2")  # the attention kernels it wraps (causal without a mask)
GROUP, WRAPPED = "_loralei_sequence_group", "_loralei_wrapped_attention"  # set on each attention module


def data_rank(size: int) -> tuple[int, int]:
    """This process's data-parallel rank and the number of data-parallel groups, for ``size`` ranks per sequence:
    the ranks of one group read the same batches (one group in a process that is not launched yet)."""
    return distributed.rank() // size, max(distributed.world_size() // size, 1)


def new_group(size: int) -> Any:
    """This rank's sequence-parallel process group (consecutive ranks); every rank makes every group, as
    ``torch.distributed.new_group`` requires.

    Raises:
        ConfigError: the number of processes is not a multiple of ``size``.
    """
    world = distributed.world_size()
    if world % size:
        raise ConfigError(
            f"training.sequence_parallel_size: {size} does not divide the {world} processes torchrun started; "
            f"start a multiple of {size} processes (torchrun --nproc_per_node) or choose a divisor of {world}"
        )
    mine = None
    for first in range(0, world, size):
        group = dist.new_group(list(range(first, first + size)))
        if first <= distributed.rank() < first + size:
            mine = group
    return mine


def shard_batch(batch: Batch, index: int, size: int) -> Batch:
    """Rank ``index`` of ``size``'s share of a collated batch: ``input_ids``, ``position_ids`` and the pre-shifted
    targets (``SHIFTED``) of its ``L / size`` consecutive positions, rows padded on the right to a multiple of
    ``size`` (padding: token 0, no target)."""
    ids = batch["input_ids"]
    rows, length = ids.shape
    targets = shift_targets(trainable_labels(batch))
    positions = batch.get("position_ids")
    if positions is None:
        positions = torch.arange(length).expand(rows, length)
    extra = -length % size
    if extra:
        ids = torch.cat([ids, ids.new_zeros(rows, extra)], 1)
        targets = torch.cat([targets, targets.new_full((rows, extra), IGNORE_INDEX)], 1)
        tail = positions[:, -1:] + torch.arange(1, extra + 1)
        positions = torch.cat([positions, tail], 1)
    width = (length + extra) // size
    cut = slice(index * width, (index + 1) * width)
    return {
        "input_ids": ids[:, cut].contiguous(),
        "position_ids": positions[:, cut].contiguous(),
        SHIFTED: targets[:, cut].contiguous(),
    }


def sharding_collate(collate: Callable[[list], Batch], group: Any) -> Callable[[list], Batch]:
    """``collate`` followed by :func:`shard_batch` for this rank's place in ``group``."""
    index, size = dist.get_rank(group), dist.get_world_size(group)

    def collate_shard(samples: list) -> Batch:
        return shard_batch(collate(samples), index, size)

    return collate_shard


def _exchange(x: torch.Tensor, group: Any) -> torch.Tensor:
    """All-to-all over ``group`` along ``x``'s first dimension (one chunk per rank), differentiable (torch's
    functional collectives: what its deprecation of ``torch.distributed.nn.functional`` points to)."""
    from torch.distributed import _functional_collectives as collectives

    return collectives.wait_tensor(collectives.all_to_all_single_autograd(x.contiguous(), None, None, group))


def _to_heads(x: torch.Tensor, group: Any, size: int) -> torch.Tensor:
    """(B, H, n, D) of this rank's positions -> (B, H / size, size * n, D): a group of heads, every position."""
    b, h, n, d = x.shape
    chunks = _exchange(x.view(b, size, h // size, n, d).transpose(0, 1), group)  # (src rank, B, H/size, n, D)
    return chunks.permute(1, 2, 0, 3, 4).reshape(b, h // size, size * n, d)


def _to_positions(x: torch.Tensor, group: Any, size: int) -> torch.Tensor:
    """(B, size * n, H', D), attention's output layout -> (B, n, size * H', D): every head, this rank's positions."""
    b, length, h, d = x.shape
    n = length // size
    chunks = _exchange(x.view(b, size, n, h, d).transpose(0, 1), group)  # (src head group, B, n, H', D)
    return chunks.permute(1, 2, 0, 3, 4).reshape(b, n, size * h, d)


def _repeat_kv(x: torch.Tensor, times: int) -> torch.Tensor:
    return x if times == 1 else x.repeat_interleave(times, dim=1)


def ulysses_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Transformers' attention-function signature: causal attention over the whole sequence for this rank's
    positions. Key/value heads that ``N`` does not divide are repeated to the query heads first."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    group = getattr(module, GROUP)
    size = dist.get_world_size(group)
    heads, kv_heads = query.shape[1], key.shape[1]
    if kv_heads % size:
        key, value = _repeat_kv(key, heads // kv_heads), _repeat_kv(value, heads // kv_heads)
    q, k, v = (_to_heads(t, group, size) for t in (query, key, value))
    kwargs.pop("position_ids", None)  # this rank's positions; the exchanged rows hold every position in order
    out, _ = ALL_ATTENTION_FUNCTIONS[getattr(module, WRAPPED)](
        module, q, k, v, None, is_causal=True, **kwargs
    )
    return _to_positions(out, group, size), None


def _no_mask(*_args: Any, **_kwargs: Any) -> None:
    """The mask function of :data:`NAME`: none, the attention is causal over each whole row."""
    return None


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, ulysses_attention)
    AttentionMaskInterface.register(NAME, _no_mask)


def refusal(config: Any, size: int, attn_implementation: str) -> str | None:
    """Why a model of ``config`` cannot run with ``size`` ranks per sequence under ``attn_implementation``, or
    ``None`` when it can."""
    heads = config.num_attention_heads
    if heads % size:
        return (
            f"training.sequence_parallel_size: {size} does not divide this model's {heads} attention heads "
            "(Ulysses splits the heads over the ranks; ring attention, which would not need it, is not built); "
            "choose a divisor of the head count"
        )
    if attn_implementation not in INNER:
        return (
            f"training.sequence_parallel_size: {size} runs the attention as {' or '.join(INNER)}, causal over each "
            f"whole row, but the model's attention is {attn_implementation}; set model.attn_implementation: sdpa"
        )
    return None


def enable(model: nn.Module, group: Any) -> str:
    """Makes ``model``'s attention layers exchange their heads over ``group``; returns the note for the run.

    Raises:
        ConfigError: see :func:`refusal`.
    """
    size = dist.get_world_size(group)
    inner = model.config._attn_implementation
    if (problem := refusal(model.config, size, inner)) is not None:
        raise ConfigError(problem)
    _register()
    for module in model.modules():
        if type(module).__name__.endswith("Attention"):  # what calls the attention function, as ``module``
            setattr(module, GROUP, group)
            setattr(module, WRAPPED, inner)
    model.set_attn_implementation(NAME)
    return (
        f"sequence parallelism: each sequence split over {size} ranks (Ulysses: {model.config.num_attention_heads} "
        f"heads exchanged around {inner} attention), {distributed.world_size() // size} data-parallel group(s)"
    )
