"""Each pair's chosen and rejected log-probabilities, summed over their completion tokens, from the backbone's last
hidden states and the output head, one chunk of logits at a time (never ``[tokens, vocab]``); for the policy,
also their mean logits over the vocabulary (a logged metric), from the same hidden states.

A preference batch carries, besides ``input_ids`` / ``labels`` / ``position_ids``, the sequence of every token
(:data:`SEQUENCE_IDS`: ``2·pair + 0`` for a chosen token, ``2·pair + 1`` for a rejected one, ``-1`` for padding;
``pair`` counts the batch's pairs from 0) and the dataset index of every pair (:data:`PAIR_IDS`); a KTO batch also
says which of its examples are desirable (:data:`DESIRABLE`; its pairs are an example and its KL sequence).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn

from ...ops.linear_cross_entropy import linear_mean_logits, linear_token_losses
from ..losses import (
    IGNORE_INDEX,
    SHIFTED,
    TRAINED_ROWS,
    Batch,
    batch_targets,
    hidden_and_head,
    logit_softcap,
    scored_rows,
    shift_targets,
)
from ..sequence_parallel import sum_over_shards
from ..shared_prompt import checked_forward

SEQUENCE_IDS = "sequence_ids"
PAIR_IDS = "pair_ids"
DESIRABLE = "desirable"
_FIELD = "training.objective"


class PairLogps(NamedTuple):
    """Per pair (``(P,)`` FP32): the summed log-probabilities of the chosen and rejected completions (LD-DPO's
    weighted sums where ``preference.ld_alpha`` is set), and how many tokens each sums; with LD-DPO also the chosen
    completion's unweighted sum."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    chosen_tokens: torch.Tensor
    rejected_tokens: torch.Tensor
    unweighted_chosen: torch.Tensor | None = None

    def means(self) -> PairLogps:
        """The per-token mean log-probabilities (IPO and ORPO work with them)."""
        return self._replace(
            chosen=self.chosen / self.chosen_tokens.clamp(min=1),
            rejected=self.rejected / self.rejected_tokens.clamp(min=1),
        )

    def chosen_mean(self) -> torch.Tensor:
        """The chosen completion's mean token log-probability, unweighted (an NLL term's)."""
        chosen = self.chosen if self.unweighted_chosen is None else self.unweighted_chosen
        return chosen / self.chosen_tokens.clamp(min=1)


class PairLogits(NamedTuple):
    """Per pair (``(P,)`` FP32): the sums over the chosen and rejected completion tokens of the policy's mean logit
    over the vocabulary (TRL's ``logits/chosen`` and ``logits/rejected`` divide them by the tokens)."""

    chosen: torch.Tensor
    rejected: torch.Tensor


def pair_logps(
    model: nn.Module, batch: Batch, labels: torch.Tensor, ld_alpha: float | None = None
) -> PairLogps:
    """The log-probabilities of ``batch``'s pairs under ``model`` as it is now (adapter on or off, with or
    without autograd: the caller decides).

    Args:
        model: a causal LM with a plain ``nn.Linear`` head (see ``losses.head_refusal``).
        batch: a preference batch (module docstring), on the model's device.
        labels: its trainable labels (``losses.trainable_labels``).
        ld_alpha: LD-DPO's weight of the tokens past a pair's shared length (:func:`ld_weights`); None: none.

    Returns:
        Sums and token counts per pair.

    Raises:
        ConfigError: the model's head cannot be applied here.
    """
    return _pair_pass(model, batch, labels, ld_alpha, False)[0]


class PolicyLogps(NamedTuple):
    """The policy's pass over a batch: its log-probabilities, its summed mean logits, and WPO's weight of each pair
    (None without ``use_weighting``)."""

    logps: PairLogps
    logits: PairLogits
    weights: torch.Tensor | None


def policy_logps(
    model: nn.Module,
    batch: Batch,
    labels: torch.Tensor,
    ld_alpha: float | None = None,
    use_weighting: bool = False,
) -> PolicyLogps:
    """:func:`pair_logps` of the policy, its summed mean logits per pair and, with ``use_weighting``, WPO's pair
    weights (both without autograd, from the same hidden states).

    Raises:
        ConfigError: the model's head cannot be applied here.
    """
    logps, mean_logits, wpo_weights = _pair_pass(model, batch, labels, ld_alpha, use_weighting)
    return PolicyLogps(logps, mean_logits(), wpo_weights() if use_weighting else None)


def ld_weights(
    index: torch.Tensor, trained: torch.Tensor, counts: torch.Tensor, ld_alpha: float
) -> torch.Tensor:
    """LD-DPO's weight of each row (Liu et al., 2024, as TRL weighs the log-probabilities): 1 for the first
    ``min(chosen tokens, rejected tokens)`` trained tokens of each completion (the pair's shared length), ``ld_alpha``
    for those after; a row's place in its completion counts the trained rows from the completion's first, whose
    rows are contiguous.

    Args:
        index: (rows,) each row's sequence (``2·pair`` chosen, ``2·pair + 1`` rejected; any for untrained rows).
        trained: (rows,) whether the row's target is trained.
        counts: (2P,) trained rows per sequence.
        ld_alpha: the weight past the shared length, in ``[0, 1]``.
    """
    seen = trained.cumsum(0)  # trained rows up to and including each row
    last = torch.iinfo(seen.dtype).max
    first = torch.full(counts.shape, last, dtype=seen.dtype, device=seen.device)
    first = first.scatter_reduce(0, index, torch.where(trained, seen, last), "amin")
    place = seen - first[index] + 1  # 1 for a completion's first trained row
    shared = torch.minimum(counts[0::2], counts[1::2]).repeat_interleave(2)
    return torch.where(place <= shared[index], 1.0, ld_alpha)


def _token_losses(
    batch: Batch, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, softcap, sum_sq: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each row's ``-log p(target)`` (0 for an untrained row) and, with ``sum_sq``, its ``log Σ_v p_v²`` (WPO's),
    the head applied to the rows the batch lists as trained (:func:`~loralei.train.losses.scored_rows`) and each
    value put back at its row."""
    scored, scored_targets = scored_rows(batch, hidden, targets)
    squares = (
        torch.empty(scored_targets.shape, dtype=torch.float32, device=targets.device) if sum_sq else None
    )
    losses = linear_token_losses(scored, weight, scored_targets, IGNORE_INDEX, softcap, sum_sq=squares)
    rows = batch.get(TRAINED_ROWS)
    if rows is None:
        return losses, squares

    def at_rows(values: torch.Tensor) -> torch.Tensor:
        return values.new_zeros(targets.shape).index_copy(0, rows, values)

    return at_rows(losses), at_rows(squares) if squares is not None else None


def _pair_pass(
    model: nn.Module, batch: Batch, labels: torch.Tensor, ld_alpha: float | None, sum_sq: bool
) -> tuple[PairLogps, Callable[[], PairLogits], Callable[[], torch.Tensor]]:
    """One pass of the backbone and the chunked head (with each row's ``log Σ p²`` where ``sum_sq``): the per-pair
    sums, and what computes the summed mean logits and WPO's pair weights from the same pass."""
    hidden, weight = checked_forward(lambda: hidden_and_head(model, batch, _FIELD), batch)
    targets = batch_targets(batch, labels).flatten()
    # position t predicts token t + 1, which belongs to the sequence of token t + 1 (a shard's are shifted already)
    sequences = batch[SEQUENCE_IDS] if SHIFTED in batch else shift_targets(batch[SEQUENCE_IDS])
    sequences = sequences.flatten()
    trained = targets != IGNORE_INDEX
    index = torch.where(trained, sequences, 0).clamp(min=0)
    pairs = batch[PAIR_IDS].shape[0]

    def by_sequence(values: torch.Tensor) -> torch.Tensor:
        """``values`` of the trained rows summed per sequence: (2P,), chosen at even, rejected at odd (over the
        ranks that split the sequences, where they are split)."""
        sums = torch.zeros(2 * pairs, dtype=torch.float32, device=values.device)
        return sum_over_shards(model, sums.index_add(0, index, torch.where(trained, values, 0)))

    softcap = logit_softcap(model)
    losses, squares = _token_losses(batch, hidden.flatten(0, 1), weight, targets, softcap, sum_sq)
    sums, counts = by_sequence(-losses), by_sequence(trained.float())
    logps = PairLogps(sums[0::2], sums[1::2], counts[0::2], counts[1::2])
    if ld_alpha is not None:
        weighted = by_sequence(-losses * ld_weights(index, trained, counts, ld_alpha))
        logps = PairLogps(weighted[0::2], weighted[1::2], counts[0::2], counts[1::2], sums[0::2])

    def mean_logits() -> PairLogits:
        logits = by_sequence(linear_mean_logits(hidden.detach().flatten(0, 1), weight, softcap))
        return PairLogits(logits[0::2], logits[1::2])

    def wpo_weights() -> torch.Tensor:
        """WPO's weight of each pair (Zhou et al., 2024, as TRL's ``use_weighting``): over its two completions, the
        product of ``exp(mean over the completion's tokens of log p(token) - log Σ_v p_v²)``, without autograd."""
        aligned = (by_sequence(-losses.detach() - squares) / counts.clamp(min=1)).exp()
        return aligned[0::2] * aligned[1::2]

    return logps, mean_logits, wpo_weights
