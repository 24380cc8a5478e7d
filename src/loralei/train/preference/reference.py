"""The reference policy of DPO: the same model with its adapter off, or with a frozen adapter in place of the one
that trains; its log-probabilities computed in each step (no autograd, so no activation is kept) or once, before
training, for every pair of the dataset."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn

from ...checkpoint import load_pretrained, lora_state_dict
from ...errors import CheckpointError, ConfigError
from ...merge import disable_lora
from ...principal_adapter import initial_adapter
from ..data import progress
from ..losses import Batch, trainable_labels
from .checks import ADAPTER_OFF
from .logps import PAIR_IDS, PairLogps, pair_logps

# turns ``model`` into the reference policy inside the block
ReferenceContext = Callable[[nn.Module], contextlib.AbstractContextManager]


@torch.no_grad()
def load_reference_adapter(model: nn.Module, path: str) -> dict[str, torch.Tensor]:
    """Loads the adapter at ``path`` into ``model``'s LoRA factors (the policy starts from it) and returns a
    frozen copy of its tensors (the reference).

    Raises:
        ConfigError: the directory is not an adapter of this model's shape and LoRA settings.
    """
    try:
        load_pretrained(model, path)
    except CheckpointError as exc:
        raise ConfigError(
            f"preference.reference: {path!r} cannot be the reference adapter: {exc}; give the directory of an "
            "adapter saved for this model with the same lora settings (r, lora_alpha, target_modules), or "
            f"reference: {ADAPTER_OFF}"
        ) from None
    return {name: tensor.detach().clone() for name, tensor in lora_state_dict(model).items()}


def frozen_adapter(tensors: dict[str, torch.Tensor]) -> ReferenceContext:
    """A reference context that puts ``tensors`` in place of the model's adapter factors (their storage is
    swapped, nothing is copied) and puts the trained ones back after."""

    @contextlib.contextmanager
    def context(model: nn.Module) -> Iterator[nn.Module]:
        params = lora_state_dict(model)
        trained = {name: param.data for name, param in params.items()}
        for name, param in params.items():
            param.data = tensors[name]
        try:
            yield model
        finally:
            for name, param in params.items():
                param.data = trained[name]

    return context


def reference_context(model: nn.Module, reference: str) -> ReferenceContext:
    """The context for ``preference.reference``: ``adapter_off`` (a PiSSA/OLoRA adapter: its initial factors in
    place, the model the policy started from) or an adapter directory (loaded here).

    Raises:
        ConfigError: the adapter directory does not fit the model.
    """
    if reference == ADAPTER_OFF:
        # PiSSA/OLoRA: the adapter off leaves the residual base; the start is the residual plus the initial factors
        initial = initial_adapter(model)
        return disable_lora if initial is None else frozen_adapter(initial)
    return frozen_adapter(load_reference_adapter(model, reference))


class InStepReference:
    """Reference log-probabilities computed in each step, before the policy's, without autograd (LD-DPO's weighted
    sums with ``ld_alpha``)."""

    def __init__(self, context: ReferenceContext, ld_alpha: float | None = None) -> None:
        self.context, self.ld_alpha = context, ld_alpha

    def logps(self, model: nn.Module, batch: Batch, labels: torch.Tensor) -> PairLogps:
        """The reference log-probabilities of ``batch``'s pairs."""
        with torch.no_grad(), self.context(model):
            return pair_logps(model, batch, labels, self.ld_alpha)


class PrecomputedReference:
    """Reference log-probabilities of every pair of the dataset, computed once before training.

    Args:
        table: ``(pairs, 4)`` FP32: chosen sum, rejected sum, chosen tokens, rejected tokens, by dataset index.
    """

    def __init__(self, table: torch.Tensor) -> None:
        self.table = table

    def logps(self, model: nn.Module, batch: Batch, labels: torch.Tensor) -> PairLogps:
        """The stored log-probabilities of ``batch``'s pairs (``model`` is not run)."""
        rows = self.table.to(labels.device)[batch[PAIR_IDS]]
        return PairLogps(*rows.unbind(1))


def precompute_reference(
    model: nn.Module,
    batches: Iterable[Batch],
    reference: InStepReference,
    pairs: int,
    device: torch.device,
) -> PrecomputedReference:
    """Runs the reference policy over ``batches`` (every pair of the dataset once) in eval mode, with a progress
    bar of the pairs (shown after a second, on the main process).

    Args:
        model: the model with its adapter.
        batches: collated preference batches on the host.
        reference: the reference pass (its context, its LD-DPO weighting).
        pairs: the dataset's pairs (the table's rows).
        device: where the model runs.

    Returns:
        The table, kept on ``device``.
    """
    table = torch.zeros(pairs, 4, dtype=torch.float32, device=device)
    was_training = model.training
    model.eval()
    with progress.bar(total=pairs, desc="reference log-probabilities", unit="pair") as bar:
        for micro in batches:
            batch = {key: value.to(device) for key, value in micro.items()}
            logps = reference.logps(model, batch, trainable_labels(batch))
            table[batch[PAIR_IDS]] = torch.stack(logps[: table.shape[1]], dim=1)
            bar.update(len(batch[PAIR_IDS]))
    model.train(was_training)
    return PrecomputedReference(table)
