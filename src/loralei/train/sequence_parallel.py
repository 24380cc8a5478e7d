"""Sequence parallelism, Ulysses-style: one sequence split over the ``N`` ranks of a group.

Each rank holds ``L / N`` consecutive positions of every row (:func:`shard_batch`): its embeddings, norms, MLPs,
LoRA products and its share of the loss run on those alone. Around attention an all-to-all trades the split:
before it a rank holds all heads of its positions, after it ``H / N`` heads of every position, so attention runs
over the whole sequence, head group by head group, and a second all-to-all trades back
(:func:`ulysses_attention`). Both exchanges are differentiable: the backward exchanges the gradients the same way.
Where ``N`` does not divide the heads, some ranks take one head more (the step waits for them), and a key/value
head whose query heads fall on two ranks goes to both (:func:`head_plan`): any ``N`` up to the head count runs.

Why the gradients are exact: every rank's loss is the sum of its positions' token losses over the window's
trainable tokens counted on every rank (:func:`loralei.train.loop.window_counts`), and the gradients are summed
over all ranks (DDP's FP32 sum hook, or FSDP2's sum of the replicated LoRA factors). The sum over a group of its
ranks' losses is the loss of the whole sequence, and the sum of the ranks' gradients is that loss's gradient: the
trained parameters are replicated, and each rank's backward carries the other ranks' contributions to its
positions through the exchanges. Groups are consecutive ranks (``[0, N)``, ``[N, 2N)``, ...); data parallelism
runs over the groups, which draw different batches (:func:`data_rank`), and composes with it unchanged; FSDP2
shards the frozen base over every rank, whatever its group.

The targets are shifted before the sequence is cut (position ``t`` predicts token ``t + 1``, which may sit on the
next rank), so a shard carries them pre-shifted (:data:`loralei.train.losses.SHIFTED`). Rows are padded on the
right to a multiple of ``N``; padding comes after every real token, and causal attention never lets a real token
see it, so the attention mask is dropped: the model attends causally over each whole row. Packed rows keep their
documents apart: the ranks gather the whole rows' position ids, and the attention gets the mask its backend takes
(:mod:`loralei.train.sequence_rows`).

A preference objective's loss is not a sum over positions: each rank sums its shard's token log-probabilities per
sequence (each position's sequence id travels with its shifted target), :func:`sum_over_shards` adds the sums over
the group, and every rank of the group computes the pair loss from the whole sums.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from ..errors import ConfigError, LoraleiError
from . import distributed, sequence_rows
from .losses import IGNORE_INDEX, SHIFTED, Batch, shift_targets, trainable_labels

NAME = "loralei_ulysses"  # the attention implementation a sequence-parallel model runs under
GROUP = "loralei_sequence_group"  # set on a model whose sequences are split: the ranks that split them
INNER = ("sdpa", "flash_attention_2", "flex_attention")  # the attention kernels it wraps
SPLIT = "_loralei_sequence_split"  # set on each attention module: its Split


class Split(NamedTuple):
    """How an attention module's sequences are split: over ``group``, around the ``inner`` attention, with rows
    that may be packed (their documents kept apart by :mod:`.sequence_rows`)."""

    group: Any
    inner: str
    packed: bool


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
    shard = {
        "input_ids": ids[:, cut].contiguous(),
        "position_ids": positions[:, cut].contiguous(),
        SHIFTED: targets[:, cut].contiguous(),
    }
    return shard | _preference_shard(batch, cut, extra)


def _preference_shard(batch: Batch, cut: slice, extra: int) -> Batch:
    """A preference batch's own fields in a shard: the sequence of each position's target, shifted as the targets
    are (padding: -1), and the pairs' (or KTO's examples') fields whole, every rank of the group holding the same
    pairs."""
    from .preference.logps import DESIRABLE, PAIR_IDS, SEQUENCE_IDS

    if SEQUENCE_IDS not in batch:
        return {}
    sequences = shift_targets(batch[SEQUENCE_IDS])
    sequences = torch.cat([sequences, sequences.new_full((sequences.shape[0], extra), -1)], 1)
    whole = {key: batch[key] for key in (PAIR_IDS, DESIRABLE) if key in batch}
    return {SEQUENCE_IDS: sequences[:, cut].contiguous(), **whole}


class _SumOverGroup(torch.autograd.Function):
    """``values`` summed over ``group``'s ranks; the backward sums the ranks' gradients of the sum, since each
    rank's ``values`` reach every rank's result."""

    @staticmethod
    def forward(ctx, values: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        summed = values.clone()
        dist.all_reduce(summed, group=group)
        return summed

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        summed = grad.contiguous().clone()
        dist.all_reduce(summed, group=ctx.group)
        return summed, None


def sum_over_shards(model: nn.Module, values: torch.Tensor) -> torch.Tensor:
    """``values``, sums over this rank's positions (a preference objective's per-sequence sums), summed over the
    ranks that split ``model``'s sequences, differentiably; unchanged where its sequences are whole.

    Every rank of the group then computes the same loss from the same sums, each over the group's pairs, which the
    loop counts on every rank: the ranks' losses add up to the loss, and through the backward's sum each rank's
    positions get the whole loss's gradient."""
    group = getattr(model, GROUP, None)
    return values if group is None else _SumOverGroup.apply(values, group)


def sharding_collate(collate: Callable[[list], Batch], group: Any) -> Callable[[list], Batch]:
    """``collate`` followed by :func:`shard_batch` for this rank's place in ``group``."""
    index, size = dist.get_rank(group), dist.get_world_size(group)

    def collate_shard(samples: list) -> Batch:
        return shard_batch(collate(samples), index, size)

    return collate_shard


class HeadPlan(NamedTuple):
    """Which heads one rank of a group sends to each rank and attends over (:func:`head_plan`)."""

    queries: tuple[range, ...]  # the query heads of each rank's group, consecutive, covering every head
    kv: tuple[range, ...]  # the key/value heads each rank's query heads read (neighbours' may overlap)
    # how many of this rank's query heads read each key/value head it receives, where not all alike
    kv_counts: tuple[int, ...] | None


@functools.cache
def head_plan(heads: int, kv_heads: int, size: int, rank: int) -> HeadPlan:
    """How ``heads`` query heads and ``kv_heads`` key/value heads split over ``size`` ranks, for rank ``rank``.

    Query heads go to the ranks in consecutive groups, ``heads // size`` each and one more for the first
    ``heads % size`` ranks: where ``size`` does not divide ``heads`` the ranks with one more head set the pace.
    Each rank receives the key/value heads its query heads read (head ``h`` reads ``h // (heads / kv_heads)``); a
    key/value head shared by two ranks' query heads goes to both. Where this rank's query heads do not read its
    key/value heads in equal runs (grouped-query attention's layout), ``kv_counts`` says how many query heads read
    each, and the received heads are repeated to one per query head before attention.
    """
    small, extra = divmod(heads, size)
    bounds = [s * small + min(s, extra) for s in range(size + 1)]
    queries = tuple(range(bounds[s], bounds[s + 1]) for s in range(size))
    per_kv = heads // kv_heads
    kv = tuple(range(q.start // per_kv, (q.stop - 1) // per_kv + 1) for q in queries)
    mine, theirs = queries[rank], kv[rank]
    counts = tuple(sum(h // per_kv == j for h in mine) for j in theirs)
    uniform = len(set(counts)) == 1
    return HeadPlan(queries, kv, None if uniform else counts)


def _exchange(x: torch.Tensor, group: Any, received: list[int], sent: list[int]) -> torch.Tensor:
    """All-to-all over ``group`` along ``x``'s first dimension: ``sent[s]`` rows to rank ``s``, ``received[s]``
    rows from it; differentiable (torch's functional collectives: what its deprecation of
    ``torch.distributed.nn.functional`` points to)."""
    from torch.distributed import _functional_collectives as collectives

    out = collectives.all_to_all_single_autograd(x.contiguous(), received, sent, group)
    return collectives.wait_tensor(out)


def _to_heads(x: torch.Tensor, group: Any, sends: tuple[range, ...], rank: int) -> torch.Tensor:
    """(B, H, n, D) of this rank's positions -> (B, H_r, size * n, D): heads ``sends[s]`` go to rank ``s``, and
    this rank gets its heads (``sends[rank]``) for every position, in rank order."""
    b, _, n, d = x.shape
    size, mine = len(sends), len(sends[rank])
    by_head = x.transpose(0, 1)  # (H, B, n, D)
    sent = torch.cat([by_head[r.start : r.stop] for r in sends])  # what each rank gets, in rank order
    chunks = _exchange(sent, group, [mine] * size, [len(r) for r in sends])  # (src rank x H_r, B, n, D)
    return chunks.view(size, mine, b, n, d).permute(2, 1, 0, 3, 4).reshape(b, mine, size * n, d)


def _to_positions(x: torch.Tensor, group: Any, queries: tuple[range, ...], rank: int) -> torch.Tensor:
    """(B, size * n, H_r, D), attention's output layout -> (B, n, H, D): every head, this rank's positions."""
    b, length, mine, d = x.shape
    size = len(queries)
    n = length // size
    per_head = b * n * d
    sent = x.view(b, size, n, mine, d).transpose(0, 1).reshape(-1)  # (dst rank, B, n, H_r, D), flat
    got = _exchange(sent, group, [len(r) * per_head for r in queries], [mine * per_head] * size)
    pieces = got.split([len(r) * per_head for r in queries])
    return torch.cat([p.view(b, n, len(r), d) for p, r in zip(pieces, queries, strict=True)], 2)


def _repeated(x: torch.Tensor, counts: tuple[int, ...]) -> torch.Tensor:
    """(B, K, L, D) with head ``j`` repeated ``counts[j]`` times along the heads."""
    return torch.cat([x[:, j : j + 1].expand(-1, c, -1, -1) for j, c in enumerate(counts)], 1)


@contextlib.contextmanager
def _kv_groups(module: nn.Module, groups: int) -> Iterator[None]:
    """``module.num_key_value_groups`` (what Transformers' sdpa path repeats key/value heads by) set to this
    rank's ratio of query to key/value heads for one call."""
    saved = getattr(module, "num_key_value_groups", None)
    if saved is None or saved == groups:
        yield
        return
    module.num_key_value_groups = groups
    try:
        yield
    finally:
        module.num_key_value_groups = saved


def ulysses_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Transformers' attention-function signature: causal attention over the whole sequence for this rank's
    positions, over this rank's query heads and the key/value heads they read (:func:`head_plan`)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    split: Split = getattr(module, SPLIT)
    # this rank's positions; the exchanged rows hold every position in order
    positions = kwargs.pop("position_ids", None)
    masked = split.packed or split.inner == "flex_attention"
    if masked and positions is None:
        raise LoraleiError(
            f"{type(module).__name__} does not pass its position ids to the attention function, and the "
            "sequence-parallel ranks need them for the whole rows' mask (packed rows' documents, flex "
            "attention's causal mask); set training.packing: false and model.attn_implementation: sdpa"
        )
    group = split.group
    rank = dist.get_rank(group)
    plan = head_plan(query.shape[1], key.shape[1], dist.get_world_size(group), rank)
    q = _to_heads(query, group, plan.queries, rank)
    k, v = (_to_heads(t, group, plan.kv, rank) for t in (key, value))
    if plan.kv_counts is not None:
        k, v = _repeated(k, plan.kv_counts), _repeated(v, plan.kv_counts)
    mask = None
    if masked:
        mask, extra = sequence_rows.attention_inputs(split.inner, positions, group)
        kwargs |= extra
    with _kv_groups(module, q.shape[1] // k.shape[1]):
        out, _ = ALL_ATTENTION_FUNCTIONS[split.inner](module, q, k, v, mask, is_causal=True, **kwargs)
    return _to_positions(out, group, plan.queries, rank), None


def _no_mask(*_args: Any, **_kwargs: Any) -> None:
    """The mask function of :data:`NAME`: none for the shard; :func:`ulysses_attention` makes the whole rows'."""
    return None


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, ulysses_attention)
    AttentionMaskInterface.register(NAME, _no_mask)


def heads_refusal(heads: int, size: int) -> str | None:
    """Why a model with ``heads`` attention heads cannot split its sequences over ``size`` ranks, or ``None``."""
    if size <= heads:
        return None
    return (
        f"training.sequence_parallel_size: {size} is more ranks than this model's {heads} attention heads "
        f"(Ulysses gives each rank at least one head); choose at most {heads}, ideally a divisor of {heads} "
        "(every rank then attends over as many heads)"
    )


def refusal(config: Any, size: int, attn_implementation: str) -> str | None:
    """Why a model of ``config`` cannot run with ``size`` ranks per sequence under ``attn_implementation``, or
    ``None`` when it can."""
    if (problem := heads_refusal(config.num_attention_heads, size)) is not None:
        return problem
    if attn_implementation not in INNER:
        return (
            f"training.sequence_parallel_size: {size} runs the attention as {', '.join(INNER)} over each whole "
            f"row, but the model's attention is {attn_implementation}; set model.attn_implementation: sdpa"
        )
    return None


def enable(model: nn.Module, group: Any, packed: bool = False) -> str:
    """Makes ``model``'s attention layers exchange their heads over ``group``, keeping the documents of ``packed``
    rows apart; returns the note for the run.

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
            setattr(module, SPLIT, Split(group, inner, packed))
    setattr(model, GROUP, group)
    model.set_attn_implementation(NAME)
    heads = model.config.num_attention_heads
    documents = "; packed documents kept apart" if packed else ""
    return (
        f"sequence parallelism: each sequence split over {size} ranks (Ulysses around {inner} attention; "
        f"{head_split_text(heads, size)}{documents}), {distributed.world_size() // size} data-parallel group(s)"
    )


def head_split_text(heads: int, size: int) -> str:
    """How the run note names the head split, with the cost of an uneven one."""
    if heads % size == 0:
        return f"{heads} heads, {heads // size} a rank"
    most = -(-heads // size)
    return (
        f"{heads} heads, {most} or {heads // size} a rank: attention {most * size / heads:.2f}x an even split's "
        f"time, which a divisor of {heads} ranks avoids"
    )
