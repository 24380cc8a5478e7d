r"""The preference losses, per pair, as TRL (1.x) defines them.

DPO compares the policy π with the reference π_ref on each pair's chosen and rejected completions, through their
log-probabilities summed over the completion's tokens. With the log-ratios ``c = log π(c) - log π_ref(c)`` and
``r = log π(r) - log π_ref(r)``, their f-divergence scores ``f(c)``, ``f(r)`` (``f_divergence_type``, f-DPO:
``reverse_kl`` x, ``forward_kl`` 1 - e^-x, ``js_divergence`` log 2 + log σ(x), ``alpha_divergence``
(e^{(α-1)x} - 1)/(α - 1)), ``z = f(c) - f(r)`` and ``z̄`` the same with each score divided by its completion's
tokens, label smoothing ``ε`` and ``τ = discopop_tau``::

    sigmoid       -(1-ε)·log σ(βz) - ε·log σ(-βz)          (ε > 0: conservative DPO; TRL 1.x reads no ε here)
    robust        (-(1-ε)·log σ(βz) + ε·log σ(-βz)) / (1 - 2ε)    (robust DPO: unbiased under label noise)
    hinge         max(0, 1 - βz)                           (SLiC)
    ipo           (z̄ - 1/(2β))²
    sigmoid_norm  -log σ(βz̄)
    exo_pair      σ(βz)·(log σ(βz) - log(1-ε)) + σ(-βz)·(log σ(-βz) - log ε)    (EXO, ε > 0)
    nca_pair      -log σ(βc) - ½·log σ(-βc) - ½·log σ(-βr)
    bco_pair      -log σ(βc) - log σ(-βr)
    sppo_hard     (c - 1/(2β))² + (r + 1/(2β))²
    aot           sigmoid's form on d = sort(log π(c) - log π(r)) - sort(log π_ref(c) - log π_ref(r))
    aot_unpaired  sigmoid's form on d = sort(c) - sort(r)
    apo_zero      1 - σ(βc) + σ(βr)
    apo_down      σ(βc) + 1 - σ(β(c - r))
    discopop      with l = βz and m = σ(l/τ): -log σ(l)·(1 - m) + e^{-l}·m   (computed without overflow)
    sft           -log π(c) / (c's tokens)                 (the chosen completion's mean token loss)

Several loss types are summed with their weights (TRL's ``loss_weights``: MPO; ``[sigmoid, sft]`` is RPO). The AOT
losses sort over the batch's pairs (one device's micro-batch, as in TRL). ``sft`` is each pair's own token mean (the
RPO paper's length-normalised NLL); TRL takes one token mean over the micro-batch's chosen tokens, the same when
the chosen completions are equally long. The rewards are ``βc`` and ``βr`` whatever the loss.

ORPO (reference-free), with ``ℓ_c``, ``ℓ_r`` the per-token mean log-probabilities::

    log odds = (ℓ_c - ℓ_r) - (log(1 - e^{ℓ_c}) - log(1 - e^{ℓ_r}))
    loss     = -ℓ_c - β·log σ(log odds)

with the rewards ``βℓ_c``, ``βℓ_r``. Its NLL term is the chosen completion's mean token loss, per pair (as ``sft``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .checks import loss_types
from .logps import PairLogps

# exponents above this overflow FP32 (the alpha divergence's e^{(α-1)x}, AlphaPO's p^-α)
_MAX_EXPONENT = 80.0


class PairTerms(NamedTuple):
    """One batch's losses per pair and what is logged of it (``(P,)`` tensors; ``extras`` by TRL's names)."""

    losses: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor
    chosen_logps: torch.Tensor
    rejected_logps: torch.Tensor
    extras: dict[str, torch.Tensor]


class DPOInputs(NamedTuple):
    """What the DPO losses read, per pair: both models' log-probabilities, the log-ratios and the margins."""

    policy: PairLogps
    reference: PairLogps
    chosen: torch.Tensor  # c = log π(c) - log π_ref(c)
    rejected: torch.Tensor  # r
    margin: torch.Tensor  # z = f(c) - f(r)
    mean_margin: torch.Tensor  # z̄: the scores divided by their completions' tokens


def _smoothed(d: torch.Tensor, beta: float, eps: float) -> torch.Tensor:
    """``-(1-ε)·log σ(βd) - ε·log σ(-βd)``: sigmoid's, the AOT losses' and SimPO's form."""
    return -(1 - eps) * F.logsigmoid(beta * d) - eps * F.logsigmoid(-beta * d)


def _hinge(d: torch.Tensor, beta: float) -> torch.Tensor:
    """``max(0, 1 - βd)``: DPO's and CPO's hinge."""
    return torch.relu(1 - beta * d)


def _ipo(d: torch.Tensor, beta: float) -> torch.Tensor:
    """``(d - 1/(2β))²``: DPO's and CPO's IPO."""
    return (d - 1 / (2 * beta)) ** 2


def _expm1_over(x: torch.Tensor, k: float) -> torch.Tensor:
    """``(e^{kx} - 1)/k`` with the exponent capped at :data:`_MAX_EXPONENT` (finite where ``kx`` is large): the
    alpha divergence's score and AlphaPO's reward."""
    return torch.expm1((k * x).clamp(max=_MAX_EXPONENT)) / k


def _robust(t: DPOInputs, loss: DPOLoss) -> torch.Tensor:
    eps, z = loss.label_smoothing, loss.beta * t.margin
    return (-(1 - eps) * F.logsigmoid(z) + eps * F.logsigmoid(-z)) / (1 - 2 * eps)


def _exo_pair(t: DPOInputs, loss: DPOLoss) -> torch.Tensor:
    eps, z = loss.label_smoothing, loss.beta * t.margin
    chosen, rejected = F.logsigmoid(z), F.logsigmoid(-z)
    return chosen.exp() * (chosen - math.log1p(-eps)) + rejected.exp() * (rejected - math.log(eps))


def _nca_pair(t: DPOInputs, loss: DPOLoss) -> torch.Tensor:
    c, r = loss.beta * t.chosen, loss.beta * t.rejected
    return -F.logsigmoid(c) - 0.5 * F.logsigmoid(-c) - 0.5 * F.logsigmoid(-r)


def _sppo_hard(t: DPOInputs, loss: DPOLoss) -> torch.Tensor:
    half = 0.5 / loss.beta
    return (t.chosen - half) ** 2 + (t.rejected + half) ** 2


def _aot(t: DPOInputs, loss: DPOLoss) -> torch.Tensor:
    policy = (t.policy.chosen - t.policy.rejected).sort().values
    reference = (t.reference.chosen - t.reference.rejected).sort().values
    return _smoothed(policy - reference, loss.beta, loss.label_smoothing)


def _apo_down(t: DPOInputs, loss: DPOLoss) -> torch.Tensor:
    return torch.sigmoid(loss.beta * t.chosen) + 1 - torch.sigmoid(loss.beta * (t.chosen - t.rejected))


def _discopop(t: DPOInputs, loss: DPOLoss) -> torch.Tensor:
    # e^{-l}·m as exp(-l + log m): e^{-l} alone overflows where m is 0 (a margin far below 0)
    z, tau = loss.beta * t.margin, loss.discopop_tau
    return -F.logsigmoid(z) * torch.sigmoid(-z / tau) + torch.exp(F.logsigmoid(z / tau) - z)


_Loss = Callable[[DPOInputs, "DPOLoss"], torch.Tensor]
DPO_LOSSES: dict[str, _Loss] = {
    "sigmoid": lambda t, loss: _smoothed(t.margin, loss.beta, loss.label_smoothing),
    "robust": _robust,
    "hinge": lambda t, loss: _hinge(t.margin, loss.beta),
    "ipo": lambda t, loss: _ipo(t.mean_margin, loss.beta),
    "sigmoid_norm": lambda t, loss: -F.logsigmoid(loss.beta * t.mean_margin),
    "exo_pair": _exo_pair,
    "nca_pair": _nca_pair,
    "bco_pair": lambda t, loss: -F.logsigmoid(loss.beta * t.chosen) - F.logsigmoid(-loss.beta * t.rejected),
    "sppo_hard": _sppo_hard,
    "aot": _aot,
    "aot_unpaired": lambda t, loss: _smoothed(
        t.chosen.sort().values - t.rejected.sort().values, loss.beta, loss.label_smoothing
    ),
    "apo_zero": lambda t, loss: (
        1 - torch.sigmoid(loss.beta * t.chosen) + torch.sigmoid(loss.beta * t.rejected)
    ),
    "apo_down": _apo_down,
    "discopop": _discopop,
    "sft": lambda t, loss: -t.policy.chosen_mean(),
}


def _alpha_score(x: torch.Tensor, alpha: float) -> torch.Tensor:
    if abs(alpha - 1) < 1e-6:  # the limit (e^{(α-1)x} - 1)/(α - 1) -> x
        return x
    return _expm1_over(x, alpha - 1)


# f'(t) at t = e^x of the f-DPO divergences, from the log-ratio x
F_SCORES: dict[str, Callable[[torch.Tensor, float], torch.Tensor]] = {
    "reverse_kl": lambda x, alpha: x,
    "forward_kl": lambda x, alpha: -torch.expm1(-x),
    "js_divergence": lambda x, alpha: math.log(2) + F.logsigmoid(x),
    "alpha_divergence": _alpha_score,
}


@dataclass(frozen=True)
class DPOLoss:
    """DPO's loss of a batch from the policy's and the reference's log-probabilities.

    Attributes:
        beta: the temperature β (> 0).
        loss_type: one of :data:`DPO_LOSSES`, or several, summed with ``loss_weights``.
        label_smoothing: ε in ``[0, 0.5)``, read by sigmoid, robust, exo_pair and the AOT losses.
        loss_weights: one weight per loss type (None: each weighs 1).
        f_divergence_type: one of :data:`F_SCORES`.
        f_alpha_divergence_coef: α of ``alpha_divergence``.
        discopop_tau: τ of ``discopop``.
    """

    beta: float
    loss_type: str | Sequence[str] = "sigmoid"
    label_smoothing: float = 0.0
    loss_weights: Sequence[float] | None = None
    f_divergence_type: str = "reverse_kl"
    f_alpha_divergence_coef: float = 0.5
    discopop_tau: float = 0.05

    def __call__(self, policy: PairLogps, reference: PairLogps) -> PairTerms:
        """Per-pair losses (the weighted sum of the loss types') and rewards (rewards and log-probabilities
        detached)."""
        chosen = policy.chosen - reference.chosen
        rejected = policy.rejected - reference.rejected
        score = F_SCORES[self.f_divergence_type]
        scores = score(chosen, self.f_alpha_divergence_coef), score(rejected, self.f_alpha_divergence_coef)
        tokens = policy.chosen_tokens.clamp(min=1), policy.rejected_tokens.clamp(min=1)
        mean_margin = scores[0] / tokens[0] - scores[1] / tokens[1]
        inputs = DPOInputs(policy, reference, chosen, rejected, scores[0] - scores[1], mean_margin)
        types = loss_types(self.loss_type)
        weights = self.loss_weights or [1.0] * len(types)
        terms = [w * DPO_LOSSES[name](inputs, self) for name, w in zip(types, weights, strict=True)]
        return PairTerms(
            torch.stack(terms).sum(0),
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


@dataclass(frozen=True)
class CPOLoss:
    """CPO's loss of a batch from the policy's log-probabilities (no reference), as TRL's CPO trainer: with ``d``
    the chosen minus the rejected log-probability (per-token means for ipo and simpo)::

        sigmoid  -(1-ε)·log σ(βd) - ε·log σ(-βd)
        hinge    max(0, 1 - βd)
        ipo      (d - 1/(2β))²
        simpo    sigmoid's form on d - γ/β  (SimPO: the length-normalised margin beyond γ)

    plus ``cpo_alpha`` times the chosen completion's mean token loss (per pair, as ORPO's NLL term). With ``alpha``
    α ≠ 0 (AlphaPO), ``d`` compares the rewards ``(1 - p^-α)/α`` of the probabilities ``p`` those log-probabilities
    give, in place of the log-probabilities themselves (α → 0).

    Attributes:
        beta: the temperature β (> 0).
        loss_type: sigmoid, hinge, ipo or simpo.
        label_smoothing: ε in ``[0, 0.5)``, read by sigmoid and simpo.
        cpo_alpha: the NLL term's weight (0: the SimPO paper's loss).
        simpo_gamma: SimPO's target margin γ.
        alpha: AlphaPO's α (0: the log-probabilities).
    """

    beta: float
    loss_type: str = "sigmoid"
    label_smoothing: float = 0.0
    cpo_alpha: float = 1.0
    simpo_gamma: float = 0.5
    alpha: float = 0.0

    def __call__(self, policy: PairLogps) -> PairTerms:
        """Per-pair losses and rewards (``β`` times what the loss compares: the log-probabilities, or AlphaPO's
        rewards of them); ``extras``: ``nll_loss``."""
        logps = policy.means() if self.loss_type in ("ipo", "simpo") else policy
        chosen, rejected = self.reward(logps.chosen), self.reward(logps.rejected)
        d = chosen - rejected
        if self.loss_type == "hinge":
            losses = _hinge(d, self.beta)
        elif self.loss_type == "ipo":
            losses = _ipo(d, self.beta)
        else:
            margin = self.simpo_gamma / self.beta if self.loss_type == "simpo" else 0.0
            losses = _smoothed(d - margin, self.beta, self.label_smoothing)
        nll = -policy.chosen_mean()
        return PairTerms(
            losses + self.cpo_alpha * nll,
            self.beta * chosen.detach(),
            self.beta * rejected.detach(),
            logps.chosen.detach(),
            logps.rejected.detach(),
            {"nll_loss": nll.detach()},
        )

    def reward(self, logp: torch.Tensor) -> torch.Tensor:
        """AlphaPO's ``(1 - p^-α)/α = -expm1(-α·log p)/α`` of ``p = exp(logp)``; ``logp`` itself when α is 0. The
        exponent ``-α·log p`` is capped at 80 (a summed log-probability of a long completion at α > 0 would overflow
        FP32 there; TRL's form gives inf, then NaN), where the reward stops following the probability."""
        return logp if self.alpha == 0 else _expm1_over(logp, -self.alpha)
