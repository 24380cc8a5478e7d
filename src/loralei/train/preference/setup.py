"""Building the preference objective of a run (``training.objective: dpo | orpo | cpo | simpo | kto``) from its
config and parts, before the output directory is touched: the head check, the reference adapter, the precomputed
reference."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import nn
from torch.utils.data import DataLoader

from ...errors import ConfigError
from ..losses import LossFn, head_refusal
from .checks import cpo_loss_type, kto_loss_type
from .kto import KTOLoss, KTOObjective
from .losses import CPOLoss, DPOLoss, ORPOLoss
from .objective import DPOObjective, ReferenceFreeObjective, count_pairs
from .reference import InStepReference, precompute_reference, reference_context


class Objective(NamedTuple):
    """The loop's loss function, what it averages over, and the metrics it logs."""

    loss_fn: LossFn
    count_items: Any
    metrics: Any


def build_objective(
    cfg: Any, model: nn.Module, dataset: Any, collate_fn: Any, device: torch.device
) -> Objective:
    """The DPO, ORPO, CPO, SimPO or KTO objective of ``cfg`` for ``model`` (LoRA injected, on ``device``).

    Args:
        cfg: the run config (a preference ``training.objective``).
        model: the model that trains.
        dataset: the training pairs (``PreferenceDataset``), for ``precompute_reference``.
        collate_fn: their collator.
        device: where the model runs.

    Raises:
        ConfigError: the model's head cannot be applied by loralei, or the reference adapter does not fit.
    """
    from ..schema import PreferenceSection

    objective, p = cfg.training.objective, cfg.preference or PreferenceSection()
    if (refusal := head_refusal(model, f"training.objective: {objective}")) is not None:
        raise ConfigError(refusal)
    if objective == "orpo":
        loss_fn: Any = ReferenceFreeObjective(ORPOLoss(p.beta))
    elif objective in ("cpo", "simpo"):
        loss_type = cpo_loss_type(objective, p.loss_type)
        cpo = CPOLoss(p.beta, loss_type, p.label_smoothing, p.cpo_alpha, p.simpo_gamma, p.alpha)
        loss_fn = ReferenceFreeObjective(cpo)
    elif objective == "kto":
        in_step = InStepReference(reference_context(model, p.reference))
        kto = KTOLoss(p.beta, p.desirable_weight, p.undesirable_weight, kto_loss_type(cfg.preference))
        loss_fn = KTOObjective(kto, in_step, in_step)
    else:
        in_step = InStepReference(reference_context(model, p.reference), p.ld_alpha)
        reference: Any = in_step
        if p.precompute_reference:
            batches = DataLoader(dataset, batch_size=cfg.training.batch_size, collate_fn=collate_fn)
            reference = precompute_reference(model, batches, in_step, len(dataset.pairs), device)
        divergence = (p.f_divergence_type, p.f_alpha_divergence_coef)
        loss = DPOLoss(p.beta, p.loss_type, p.label_smoothing, p.loss_weights, *divergence, p.discopop_tau)
        loss_fn = DPOObjective(loss, reference, in_step, p.ld_alpha, p.use_weighting)
    return Objective(loss_fn, count_pairs, loss_fn.metrics.read)
