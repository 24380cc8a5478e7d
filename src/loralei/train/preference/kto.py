r"""KTO (Ethayarajh et al., 2024), as TRL defines it (``loss_type: kto``), on batches of examples each beside its KL
sequence (``data/kto.py``): with ``r = log π(y|x) - log π_ref(y|x)`` an example's log-ratio (sums over its
completion tokens) and ``z`` the mean over the micro batch of the same for the KL sequences (the prompts with other
examples' completions), without a gradient and clamped at 0::

    desirable     λ_D · (1 - σ(β·(r - z)))
    undesirable   λ_U · (1 - σ(β·(z - r)))

``λ_D``, ``λ_U`` = ``preference.desirable_weight``, ``undesirable_weight``; the loss is their mean over the examples.
``preference.loss_type: apo_zero_unpaired`` (TRL's unpaired APO-zero, D'Oosterlinck et al., 2024) is the same with
``z`` = 0: a desirable example's loss ``λ_D·(1 - σ(β·r))``, an undesirable one's ``λ_U·σ(β·r)``; its steps skip the
KL sequences (they stay in the batch, unread).
The rewards are ``β·r``. In training, with several processes, ``z`` is the mean of the processes' micro batches'
means before the clamp, as TRL gathers it; in evaluation each process's own (where the last global batch left a
rank none, it evaluates an uncounted filler batch, whose estimate must not move the others').

A step runs the reference over the examples and their KL sequences (no autograd), the policy over the KL sequences
without autograd and over the examples with it: the examples are the batch's even rows and their KL sequences the
odd ones (KTO batches are not packed), so each pass takes its rows alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

from .. import distributed
from ..losses import TRAINED_ROWS, Batch, Count
from .logps import DESIRABLE, PairLogits, PairLogps, pair_logps, policy_logps
from .objective import Reference
from .step_sums import StepSums


class KTOTerms(NamedTuple):
    """One micro batch's losses per example (``(E,)``), the rewards ``β·r`` and the KL estimate ``z`` (a scalar)."""

    losses: torch.Tensor
    rewards: torch.Tensor
    kl: torch.Tensor


@dataclass(frozen=True)
class KTOLoss:
    """KTO's loss (module docstring), or with ``loss_type`` apo_zero_unpaired APO-zero's unpaired form."""

    beta: float
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0
    loss_type: str = "kto"

    @property
    def uses_kl(self) -> bool:
        """Whether the loss reads the KL estimate ``z`` (apo_zero_unpaired has none)."""
        return self.loss_type == "kto"

    def __call__(
        self,
        ratios: torch.Tensor,
        kl_ratios: torch.Tensor | None,
        desirable: torch.Tensor,
        over_ranks: bool = False,
    ) -> KTOTerms:
        """The terms from the examples' log-ratios ``r``, their KL sequences' (None without a KL term) and which
        examples are desirable; ``over_ranks``: ``z`` from every process's micro batch (each process calls it at the
        same micro batch)."""
        kl = torch.zeros((), dtype=ratios.dtype, device=ratios.device)
        if kl_ratios is not None:
            kl = kl_ratios.detach().mean()
            kl = (distributed.mean_over_ranks(kl) if over_ranks else kl).clamp(min=0)
        gain = self.desirable_weight * (1 - torch.sigmoid(self.beta * (ratios - kl)))
        loss = self.undesirable_weight * (1 - torch.sigmoid(self.beta * (kl - ratios)))
        return KTOTerms(torch.where(desirable, gain, loss), self.beta * ratios.detach(), kl)


def _rows(batch: Batch, labels: torch.Tensor, first: int) -> tuple[Batch, torch.Tensor]:
    """The batch's examples (``first`` 0) or KL sequences (1): every second row of its per-row tensors (the list of
    trained positions, which counts the whole batch's, left out: the head scores every row)."""
    rows = {
        key: value[first::2] if value.dim() > 1 else value
        for key, value in batch.items()
        if key != TRAINED_ROWS
    }
    return rows, labels[first::2]


# the logged means: over the desirable (chosen) and the undesirable (rejected) examples
_SIDES = ("chosen", "rejected")


class KTOMetrics:
    """Sums over the training steps since the last read, on the device, of what TRL logs for KTO: per side
    (desirable: ``chosen``, undesirable: ``rejected``) the rewards, the log-probabilities and the mean logits (per
    token), and the KL estimate per micro batch."""

    def __init__(self) -> None:
        self.sums = StepSums()

    def add(self, terms: KTOTerms, policy: PairLogps, logits: PairLogits, desirable: torch.Tensor) -> None:
        """Adds one micro batch (``step_sums``: after each replay under CUDA graphs)."""
        sides = (desirable, ~desirable)
        values = (terms.rewards, policy.chosen.detach(), logits.chosen, policy.chosen_tokens)
        sums = torch.stack(
            [torch.where(side, value, 0).sum() for side in sides for value in values]
            + [side.sum().float() for side in sides]
            + [terms.kl.float()]
        )
        self.sums.add(sums, 1)

    def read(self) -> dict[str, float]:
        """The means over all ranks (every rank calls it at the same step), then starts over."""
        read = self.sums.read()
        if read is None:
            return {}
        totals, batches = read
        means: dict[str, float] = {}
        for k, side in enumerate(_SIDES):
            rewards, logps, logits, tokens = totals[4 * k : 4 * k + 4]
            examples = totals[8 + k]
            if examples:
                means |= {f"rewards/{side}": rewards / examples, f"logps/{side}": logps / examples}
                means[f"logits/{side}"] = logits / max(tokens, 1.0)
        if "rewards/chosen" in means and "rewards/rejected" in means:
            means["rewards/margins"] = means["rewards/chosen"] - means["rewards/rejected"]
        means["kl"] = totals[10] / max(batches, 1.0)
        return means


class KTOObjective:
    """KTO: the reference's log-probabilities (no autograd), the policy's on the KL sequences (no autograd) and on
    the examples, then the loss.

    Args:
        loss: the KTO loss and its settings.
        reference: the training steps' reference log-probabilities (in the step).
        evaluation: the evaluation batches'.
    """

    def __init__(self, loss: KTOLoss, reference: Reference, evaluation: Reference) -> None:
        self.loss, self.metrics = loss, KTOMetrics()
        self.reference, self.evaluation = reference, evaluation

    def __call__(
        self, model: nn.Module, batch: Batch, labels: torch.Tensor, num_items: Count
    ) -> torch.Tensor:
        training = torch.is_grad_enabled()
        reference_logps = (self.reference if training else self.evaluation).logps
        examples, kl_ratios = _rows(batch, labels, 0), None
        if self.loss.uses_kl:
            reference = reference_logps(model, batch, labels)
            with torch.no_grad():
                kl_ratios = pair_logps(model, *_rows(batch, labels, 1)).rejected - reference.rejected
        else:  # the examples alone: their KL sequences are not read
            reference = reference_logps(model, *examples)
        policy = policy_logps(model, *examples)
        desirable = batch[DESIRABLE]
        ratios = policy.logps.chosen - reference.chosen
        terms = self.loss(ratios, kl_ratios, desirable, over_ranks=training)
        if training:  # evaluation logs its loss alone
            self.metrics.add(terms, policy.logps, policy.logits, desirable)
        return terms.losses.sum() / num_items
