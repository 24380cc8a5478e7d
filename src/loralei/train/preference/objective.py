"""The preference objectives as the loop's loss functions: ``objective(model, batch, labels, num_items)`` returns
the sum of the batch's per-pair losses divided by ``num_items`` (the window's pairs, over all ranks), and keeps the
metrics TRL logs (``rewards/chosen``, ``rewards/rejected``, ``rewards/accuracies``, ``rewards/margins``,
``logps/chosen``, ``logps/rejected``, ``logits/chosen``, ``logits/rejected``, ORPO's ``nll_loss``,
``log_odds_ratio``, ``log_odds_chosen``, and CPO's ``nll_loss``; with WPO, ``wpo_weight``, the pairs' mean weight)
until the next log record reads them."""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from ..losses import Batch, Count
from .logps import PAIR_IDS, PairLogits, PairLogps, policy_logps
from .losses import CPOLoss, DPOLoss, ORPOLoss, PairTerms
from .step_sums import StepSums


class Reference(Protocol):
    """Where the reference log-probabilities come from (``reference.py``)."""

    def logps(self, model: nn.Module, batch: Batch, labels: torch.Tensor) -> PairLogps: ...


def count_pairs(batch: Batch) -> int:
    """The pairs of a preference batch: what its loss averages over."""
    return int(batch[PAIR_IDS].numel())


# the per-token means (TRL's): sums over the completion tokens, divided by the tokens
TOKEN_MEANS = ("logits/chosen", "logits/rejected")


class PairMetrics:
    """Sums of the logged values over the pairs of the training steps since the last read, on the device
    (``step_sums``): per-pair values and, for :data:`TOKEN_MEANS`, per-token sums and the chosen and rejected
    tokens."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.sums = StepSums()

    def add(self, terms: PairTerms, policy: PairLogps, logits: PairLogits) -> None:
        """Adds one batch's pairs: their terms, the policy's token counts and summed mean logits."""
        values = {
            "rewards/chosen": terms.chosen_rewards,
            "rewards/rejected": terms.rejected_rewards,
            "rewards/accuracies": (terms.chosen_rewards > terms.rejected_rewards).float(),
            "rewards/margins": terms.chosen_rewards - terms.rejected_rewards,
            "logps/chosen": terms.chosen_logps,
            "logps/rejected": terms.rejected_logps,
            **terms.extras,
        }
        self.names = list(values)
        sums = [v.detach().float().sum() for v in values.values()]
        tokens = [t.sum() for t in (*logits, policy.chosen_tokens, policy.rejected_tokens)]
        self.sums.add(torch.stack(sums + tokens), terms.losses.numel())

    def read(self) -> dict[str, float]:
        """The means per pair (per token for :data:`TOKEN_MEANS`) over all ranks (every rank calls it at the same
        step), then starts over."""
        read = self.sums.read()
        if read is None:
            return {}
        totals, pairs = read
        means = {name: total / max(pairs, 1.0) for name, total in zip(self.names, totals, strict=False)}
        chosen, rejected, chosen_tokens, rejected_tokens = totals[len(self.names) :]
        means[TOKEN_MEANS[0]] = chosen / max(chosen_tokens, 1.0)
        means[TOKEN_MEANS[1]] = rejected / max(rejected_tokens, 1.0)
        return means


class DPOObjective:
    """DPO: the reference's log-probabilities first (no autograd), then the policy's, then the pair loss.

    Args:
        loss: the DPO loss and its settings.
        reference: the training steps' reference log-probabilities (in the step or precomputed).
        evaluation: the evaluation batches' (autograd off; a table of the training pairs does not hold them).
        ld_alpha: LD-DPO's weight of the policy's tokens past a pair's shared length (the references weigh theirs
            alike); None: no weighting.
        use_weighting: WPO: each pair's loss times its weight from the policy (``logps.PolicyLogps``).
    """

    def __init__(
        self,
        loss: DPOLoss,
        reference: Reference,
        evaluation: Reference,
        ld_alpha: float | None = None,
        use_weighting: bool = False,
    ) -> None:
        self.loss, self.metrics = loss, PairMetrics()
        self.reference, self.evaluation = reference, evaluation
        self.ld_alpha, self.use_weighting = ld_alpha, use_weighting

    def __call__(
        self, model: nn.Module, batch: Batch, labels: torch.Tensor, num_items: Count
    ) -> torch.Tensor:
        source = self.reference if torch.is_grad_enabled() else self.evaluation
        reference = source.logps(model, batch, labels)
        policy = policy_logps(model, batch, labels, self.ld_alpha, self.use_weighting)
        terms = self.loss(policy.logps, reference)
        if policy.weights is not None:
            extras = {**terms.extras, "wpo_weight": policy.weights}
            terms = terms._replace(losses=terms.losses * policy.weights, extras=extras)
        return _finish(terms, (policy.logps, policy.logits), self.metrics, num_items)


class ReferenceFreeObjective:
    """ORPO, CPO and SimPO: the policy's log-probabilities and a loss of them alone (no reference pass).

    Args:
        loss: the loss and its settings.
    """

    def __init__(self, loss: ORPOLoss | CPOLoss) -> None:
        self.loss, self.metrics = loss, PairMetrics()

    def __call__(
        self, model: nn.Module, batch: Batch, labels: torch.Tensor, num_items: Count
    ) -> torch.Tensor:
        policy = policy_logps(model, batch, labels)
        return _finish(self.loss(policy.logps), (policy.logps, policy.logits), self.metrics, num_items)


def _finish(
    terms: PairTerms, policy: tuple[PairLogps, PairLogits], metrics: PairMetrics, num_items: Count
) -> torch.Tensor:
    """The batch's share of the window loss; a training step's pairs (autograd on) go to the metrics."""
    if torch.is_grad_enabled():  # evaluation runs without autograd and logs its loss alone
        metrics.add(terms, *policy)
    return terms.losses.sum() / num_items
