r"""The preference losses, per pair, as TRL defines them.

DPO, with ``z = (log π(c) - log π(r)) - (log π_ref(c) - log π_ref(r))`` (log-probabilities summed over each
completion's tokens; IPO uses their per-token means) and label smoothing ``ε``::

    sigmoid  -(1-ε)·log σ(βz) - ε·log σ(-βz)                 (ε > 0: conservative DPO)
    robust   (-(1-ε)·log σ(βz) + ε·log σ(-βz)) / (1 - 2ε)     (robust DPO: unbiased under label noise)
    hinge    max(0, 1 - βz)
    ipo      (z - 1/(2β))²

and the rewards ``β(log π(c) - log π_ref(c))``, ``β(log π(r) - log π_ref(r))``.

ORPO (reference-free), with ``ℓ_c``, ``ℓ_r`` the per-token mean log-probabilities::

    log odds = (ℓ_c - ℓ_r) - (log(1 - e^{ℓ_c}) - log(1 - e^{ℓ_r}))
    loss     = -ℓ_c - β·log σ(log odds)

with the rewards ``βℓ_c``, ``βℓ_r``. Its NLL term is the chosen completion's mean token loss, per pair (TRL
averages it over the batch's chosen tokens: the same when the chosen completions are equally long).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .logps import PairLogps

DPO_LOSS_TYPES = ("sigmoid", "robust", "hinge", "ipo")
# the DPO losses that read the label smoothing
SMOOTHED = ("sigmoid", "robust")


class PairTerms(NamedTuple):
    """One batch's losses per pair and what is logged of it (``(P,)`` tensors; ``extras`` by TRL's names)."""

    losses: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor
    chosen_logps: torch.Tensor
    rejected_logps: torch.Tensor
    extras: dict[str, torch.Tensor]


def _sigmoid(z: torch.Tensor, beta: float, eps: float) -> torch.Tensor:
    return -(1 - eps) * F.logsigmoid(beta * z) - eps * F.logsigmoid(-beta * z)


def _robust(z: torch.Tensor, beta: float, eps: float) -> torch.Tensor:
    return (-(1 - eps) * F.logsigmoid(beta * z) + eps * F.logsigmoid(-beta * z)) / (1 - 2 * eps)


def _hinge(z: torch.Tensor, beta: float, eps: float) -> torch.Tensor:
    return torch.relu(1 - beta * z)


def _ipo(z: torch.Tensor, beta: float, eps: float) -> torch.Tensor:
    return (z - 1 / (2 * beta)) ** 2


DPO_LOSSES: dict[str, Callable[[torch.Tensor, float, float], torch.Tensor]] = {
    "sigmoid": _sigmoid,
    "robust": _robust,
    "hinge": _hinge,
    "ipo": _ipo,
}


@dataclass(frozen=True)
class DPOLoss:
    """DPO's loss of a batch from the policy's and the reference's log-probabilities.

    Attributes:
        beta: the temperature β (> 0).
        loss_type: one of :data:`DPO_LOSS_TYPES`.
        label_smoothing: ε in ``[0, 0.5)``, read by ``sigmoid`` and ``robust``.
    """

    beta: float
    loss_type: str = "sigmoid"
    label_smoothing: float = 0.0

    def __call__(self, policy: PairLogps, reference: PairLogps) -> PairTerms:
        """Per-pair losses and rewards (rewards and log-probabilities detached)."""
        if self.loss_type == "ipo":  # IPO compares per-token means (TRL)
            policy, reference = policy.means(), reference.means()
        chosen = policy.chosen - reference.chosen
        rejected = policy.rejected - reference.rejected
        losses = DPO_LOSSES[self.loss_type](chosen - rejected, self.beta, self.label_smoothing)
        return PairTerms(
            losses,
            self.beta * chosen.detach(),
            self.beta * rejected.detach(),
            policy.chosen.detach(),
            policy.rejected.detach(),
            {},
        )


def _log1m_exp(logp: torch.Tensor) -> torch.Tensor:
    """``log(1 - e^x)`` for ``x < 0``, accurate also where ``e^x`` is close to 1."""
    return torch.log(-torch.expm1(logp))


@dataclass(frozen=True)
class ORPOLoss:
    """ORPO's loss of a batch from the policy's log-probabilities (no reference).

    Attributes:
        beta: the weight β of the odds-ratio term (> 0).
    """

    beta: float

    def __call__(self, policy: PairLogps) -> PairTerms:
        """Per-pair losses and rewards; ``extras``: ``nll_loss``, ``log_odds_ratio``, ``log_odds_chosen``."""
        means = policy.means()
        chosen, rejected = means.chosen, means.rejected
        log_odds = (chosen - rejected) - (_log1m_exp(chosen) - _log1m_exp(rejected))
        ratio = F.logsigmoid(log_odds)
        losses = -chosen - self.beta * ratio
        extras = {
            "nll_loss": -chosen.detach(),
            "log_odds_ratio": ratio.detach(),
            "log_odds_chosen": log_odds.detach(),
        }
        return PairTerms(
            losses,
            self.beta * chosen.detach(),
            self.beta * rejected.detach(),
            chosen.detach(),
            rejected.detach(),
            extras,
        )
