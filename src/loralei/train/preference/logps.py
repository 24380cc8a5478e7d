"""Each pair's chosen and rejected log-probabilities, summed over their completion tokens, from the backbone's last
hidden states and the output head, one chunk of logits at a time (never ``[tokens, vocab]``); for the policy,
also their mean logits over the vocabulary (a logged metric), from the same hidden states.

A preference batch carries, besides ``input_ids`` / ``labels`` / ``position_ids``, the sequence of every token
(:data:`SEQUENCE_IDS`: ``2·pair + 0`` for a chosen token, ``2·pair + 1`` for a rejected one, ``-1`` for padding;
``pair`` counts the batch's pairs from 0) and the dataset index of every pair (:data:`PAIR_IDS`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn

from ...ops.linear_cross_entropy import linear_mean_logits, linear_token_losses
from ..losses import IGNORE_INDEX, Batch, batch_targets, hidden_and_head, logit_softcap, shift_targets

SEQUENCE_IDS = "sequence_ids"
PAIR_IDS = "pair_ids"
_FIELD = "training.objective"


class PairLogps(NamedTuple):
    """Per pair (``(P,)`` FP32): the summed log-probabilities of the chosen and rejected completions, and how many
    tokens each sums."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    chosen_tokens: torch.Tensor
    rejected_tokens: torch.Tensor

    def means(self) -> PairLogps:
        """The per-token mean log-probabilities (IPO and ORPO work with them)."""
        return self._replace(
            chosen=self.chosen / self.chosen_tokens.clamp(min=1),
            rejected=self.rejected / self.rejected_tokens.clamp(min=1),
        )


class PairLogits(NamedTuple):
    """Per pair (``(P,)`` FP32): the sums over the chosen and rejected completion tokens of the policy's mean logit
    over the vocabulary (TRL's ``logits/chosen`` and ``logits/rejected`` divide them by the tokens)."""

    chosen: torch.Tensor
    rejected: torch.Tensor


def pair_logps(model: nn.Module, batch: Batch, labels: torch.Tensor) -> PairLogps:
    """The log-probabilities of ``batch``'s pairs under ``model`` as it is now (adapter on or off, with or
    without autograd: the caller decides).

    Args:
        model: a causal LM with a plain ``nn.Linear`` head (see ``losses.head_refusal``).
        batch: a preference batch (module docstring), on the model's device.
        labels: its trainable labels (``losses.trainable_labels``).

    Returns:
        Sums and token counts per pair.

    Raises:
        ConfigError: the model's head cannot be applied here.
    """
    return _pair_pass(model, batch, labels)[0]


def policy_logps(model: nn.Module, batch: Batch, labels: torch.Tensor) -> tuple[PairLogps, PairLogits]:
    """:func:`pair_logps` of the policy, and its summed mean logits per pair (without autograd, from the same
    hidden states: ``linear_mean_logits``).

    Raises:
        ConfigError: the model's head cannot be applied here.
    """
    logps, mean_logits = _pair_pass(model, batch, labels)
    return logps, mean_logits()


def _pair_pass(
    model: nn.Module, batch: Batch, labels: torch.Tensor
) -> tuple[PairLogps, Callable[[], PairLogits]]:
    """One pass of the backbone and the chunked head: the per-pair sums, and what computes the summed mean logits
    from the same hidden states."""
    hidden, weight = hidden_and_head(model, batch, _FIELD)
    targets = batch_targets(batch, labels).flatten()
    # position t predicts token t + 1, which belongs to the sequence of token t + 1
    sequences = shift_targets(batch[SEQUENCE_IDS]).flatten()
    trained = targets != IGNORE_INDEX
    index = torch.where(trained, sequences, 0).clamp(min=0)
    pairs = batch[PAIR_IDS].shape[0]

    def by_sequence(values: torch.Tensor) -> torch.Tensor:
        """``values`` of the trained rows summed per sequence: (2P,), chosen at even, rejected at odd."""
        sums = torch.zeros(2 * pairs, dtype=torch.float32, device=values.device)
        return sums.index_add(0, index, torch.where(trained, values, 0))

    softcap = logit_softcap(model)
    losses = linear_token_losses(hidden.flatten(0, 1), weight, targets, IGNORE_INDEX, softcap)
    sums, counts = by_sequence(-losses), by_sequence(trained.float())
    logps = PairLogps(sums[0::2], sums[1::2], counts[0::2], counts[1::2])

    def mean_logits() -> PairLogits:
        logits = by_sequence(linear_mean_logits(hidden.detach().flatten(0, 1), weight, softcap))
        return PairLogits(logits[0::2], logits[1::2])

    return logps, mean_logits
