"""Causal-LM losses that return ``sum of token losses / num_items``.

The loop passes ``num_items`` = the trainable tokens of the whole gradient-accumulation window (over all
ranks), so a window's gradient is the mean over its tokens, however they are split into micro batches.

Labels are aligned with ``input_ids`` (Transformers' convention); token ``t+1`` is predicted at position ``t``.
The first token of every sample (``position_ids == 0``) is never a target: in a packed row it would otherwise be
predicted from the end of the previous sample.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError
from ..ops.linear_cross_entropy import linear_cross_entropy

IGNORE_INDEX = -100
Batch = dict[str, torch.Tensor]
# The window's trainable tokens: an int, or a 0-dim device tensor (a CUDA graph reads it at each replay)
Count = int | torch.Tensor
LossFn = Callable[[nn.Module, Batch, torch.Tensor, Count], torch.Tensor]

# The virtual rows of a batch of pairs stored with their prompt once, which the attention reads (their layout:
# data/shared_prompt.py)
PAIR_ROWS = "pair_rows"
PAIR_OUTPUTS = "pair_outputs"
PAIR_PLACES = "pair_places"
PAIR_OUTPUT_TOKENS = "pair_output_tokens"
# what the attention reads, in this order
PAIR_MAPS = (PAIR_ROWS, PAIR_OUTPUTS, PAIR_PLACES, PAIR_OUTPUT_TOKENS)
_MODEL_INPUTS = ("input_ids", "attention_mask", "position_ids", *PAIR_MAPS)
# A batch cut along the sequence after the shift (a sequence-parallel shard: the target of its last position is
# the next shard's first token) carries its targets per position under this key instead of "labels".
SHIFTED = "shift_labels"
# An eager step's batch lists its trained positions (flat over rows × positions), counted on the host as it is
# collated, so that the losses that apply the head themselves score those rows alone without reading the device
# (prompt tokens of chat data, padding); a CUDA graph's batch has fixed shapes and no such list.
TRAINED_ROWS = "trained_rows"


def trainable_labels(batch: Batch) -> torch.Tensor:
    """``batch["labels"]`` with every sample's first token masked (see the module docstring); a shard's targets
    (:data:`SHIFTED`) as they are."""
    if SHIFTED in batch:
        return batch[SHIFTED]
    labels = batch["labels"]
    positions = batch.get("position_ids")
    if positions is None:
        return labels
    return labels.masked_fill(positions == 0, IGNORE_INDEX)


def shift_targets(labels: torch.Tensor) -> torch.Tensor:
    """Targets per position: ``labels[:, t + 1]`` at position ``t``, ignored at the last position."""
    targets = torch.full_like(labels, IGNORE_INDEX)
    targets[:, :-1] = labels[:, 1:]
    return targets


def batch_targets(batch: Batch, labels: torch.Tensor) -> torch.Tensor:
    """The targets per position of ``batch``, whose trainable labels are ``labels``: a shard's own, else
    :func:`shift_targets`."""
    return batch[SHIFTED] if SHIFTED in batch else shift_targets(labels)


def with_trained_rows(batch: Batch) -> Batch:
    """``batch`` (on the host) with :data:`TRAINED_ROWS`: the flat indices of the positions whose target is
    trained."""
    targets = batch_targets(batch, trainable_labels(batch)).flatten()
    return {**batch, TRAINED_ROWS: (targets != IGNORE_INDEX).nonzero().squeeze(1)}


def scored_rows(
    batch: Batch, hidden: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The flat hidden states ``(N, H)`` and targets ``(N,)`` of the rows the head must score: the trained rows
    where ``batch`` lists them (:data:`TRAINED_ROWS`), else every row (an untrained row's loss is 0 either way)."""
    rows = batch.get(TRAINED_ROWS)
    if rows is None:
        return hidden, targets
    return hidden.index_select(0, rows), targets.index_select(0, rows)


def count_trainable_tokens(batch: Batch) -> int:
    """Number of positions whose next token is trained on (what the loss is averaged over)."""
    return int((batch_targets(batch, trainable_labels(batch)) != IGNORE_INDEX).sum())


def check_token_ids(batch: Batch, vocab_size: int) -> None:
    """Checks a batch on the host, before it goes to the device (where a bad id fails deep inside a kernel, or
    not at all): every input id is in the vocabulary, every label too or ``IGNORE_INDEX``.

    Raises:
        DataError: an id outside ``[0, vocab_size)``, naming the field and the value.
    """
    labels = SHIFTED if SHIFTED in batch else "labels"  # a shard's targets are its labels, shifted
    for field, key, ignore in (("input_ids", "input_ids", None), ("labels", labels, IGNORE_INDEX)):
        ids = batch[key]
        bad = (ids < 0) | (ids >= vocab_size)
        if ignore is not None:
            bad &= ids != ignore
        if bool(bad.any()):
            from .data.errors import DataError  # the data pipeline's modules, loaded only for this error

            raise DataError(
                f"{field}: token id {int(ids[bad][0])} is outside the model's vocabulary [0, {vocab_size})"
                + (f" and is not the ignore index {ignore}" if ignore is not None else "")
                + "; check that the tokenizer and the data belong to this model"
            )


def _model_inputs(batch: Batch) -> Batch:
    return {k: batch[k] for k in _MODEL_INPUTS if k in batch}


def cross_entropy_loss(
    model: nn.Module, batch: Batch, labels: torch.Tensor, num_items: Count
) -> torch.Tensor:
    """Full-logits cross entropy in FP32, summed and divided by ``num_items``."""
    logits = model(**_model_inputs(batch), use_cache=False).logits
    targets = batch_targets(batch, labels)
    loss = F.cross_entropy(
        logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    return loss / num_items


def missing_package_error(field: str, module: str, extra: str) -> ConfigError:
    """The error for an option (``field``) whose package ``module`` is not installed (extra ``loralei[extra]``)."""
    return ConfigError(
        f"{field} needs the '{module}' package, which is not installed; "
        f"run `pip install 'loralei[{extra}]'` or turn the option off"
    )


def _require(module: str, extra: str, field: str) -> object:
    try:
        return importlib.import_module(module)
    except ImportError:
        raise missing_package_error(field, module, extra) from None


def head_refusal(model: nn.Module, field: str) -> str | None:
    """Why the losses that apply the output head themselves cannot train ``model`` (``field`` names the option
    in the message), or None when they can."""
    head = model.get_output_embeddings()
    if type(head) is not nn.Linear:
        return (
            f"{field} applies the output head itself and takes a plain nn.Linear head, but this model's head is "
            f"{type(head).__name__} (an adapter or a quantized head); use loss: cross_entropy"
        )
    if head.bias is not None:
        return (
            f"{field} takes an output head without bias, but this model's head has one; use loss: cross_entropy "
            "(or liger_kernel: true)"
        )
    if getattr(model.config, "output_router_logits", False):
        return (
            f"{field} computes the loss from the backbone's hidden states, without the MoE load-balancing loss "
            "this model's config asks for (output_router_logits: true); use loss: cross_entropy or "
            "liger_kernel: true, which keep it"
        )
    return None


def hidden_and_head(model: nn.Module, batch: Batch, field: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The backbone's last hidden states and the output head's weight, for the losses that apply the head
    themselves (``field`` names the option in errors)."""
    if (refusal := head_refusal(model, field)) is not None:
        raise ConfigError(refusal)
    head = model.get_output_embeddings()
    hidden = model.base_model(**_model_inputs(batch), use_cache=False).last_hidden_state
    return hidden.to(head.weight.dtype), head.weight


def logit_softcap(model: nn.Module) -> float | None:
    """The model's final logit soft-capping (Gemma 2's ``final_logit_softcapping``), or None."""
    return getattr(model.config, "final_logit_softcapping", None)


def make_cut_cross_entropy_loss(impl: str) -> LossFn:
    """Cut Cross Entropy: the loss from backbone hidden states and the head weight, never the full logits.

    Args:
        impl: ``cut_cross_entropy.linear_cross_entropy``'s implementation name (``"cce"``, ...).

    Raises:
        ConfigError: ``cut-cross-entropy`` is not installed.
    """
    cce = _require("cut_cross_entropy", "cce", "training.loss: cut_cross_entropy")

    def loss_fn(model: nn.Module, batch: Batch, labels: torch.Tensor, num_items: Count) -> torch.Tensor:
        hidden, weight = hidden_and_head(model, batch, "training.loss: cut_cross_entropy")
        hidden, targets = scored_rows(batch, hidden.flatten(0, 1), batch_targets(batch, labels).flatten())
        loss = cce.linear_cross_entropy(
            hidden,
            weight,
            targets,
            ignore_index=IGNORE_INDEX,
            softcap=logit_softcap(model),
            reduction="sum",
            impl=impl,
        )
        return loss / num_items

    return loss_fn


def linear_cross_entropy_loss(
    model: nn.Module, batch: Batch, labels: torch.Tensor, num_items: Count
) -> torch.Tensor:
    """loralei's chunked linear cross entropy (``ops.linear_cross_entropy``): one chunk of logits at a time, over
    the trained rows where the batch lists them (:func:`scored_rows`). The labels were checked on the host
    (:func:`check_token_ids`), so the op does not check them again on the device, which would make the host wait
    for the forward."""
    hidden, weight = hidden_and_head(model, batch, "training.loss: linear_cross_entropy")
    hidden, targets = scored_rows(batch, hidden.flatten(0, 1), batch_targets(batch, labels).flatten())
    loss = linear_cross_entropy(
        hidden, weight, targets, IGNORE_INDEX, logit_softcap(model), check_targets=False
    )
    return loss / num_items


def liger_loss(model: nn.Module, batch: Batch, labels: torch.Tensor, num_items: Count) -> torch.Tensor:
    """The model's own loss, for models patched by Liger (its fused linear cross entropy never makes logits).

    ``num_items_in_batch`` makes the patched forward sum the token losses and divide by ``num_items``.
    """
    out = model(**_model_inputs(batch), labels=labels, num_items_in_batch=num_items, use_cache=False)
    return out.loss


def build_loss(name: str, *, liger: bool, cce_impl: str = "cce") -> LossFn:
    """The loss function for ``training.loss`` (and ``training.liger_kernel``).

    Raises:
        ConfigError: the loss needs a package that is not installed.
    """
    if name == "linear_cross_entropy":
        return linear_cross_entropy_loss
    if liger:
        return liger_loss
    builders: dict[str, Callable[[], LossFn]] = {
        "cross_entropy": lambda: cross_entropy_loss,
        "cut_cross_entropy": lambda: make_cut_cross_entropy_loss(cce_impl),
    }
    return builders[name]()


def apply_liger(model: nn.Module, *, layers: bool) -> None:
    """Patches ``model`` in place with Liger kernels through Liger's Transformers integration: the fused linear
    cross entropy always.

    Args:
        model: a Transformers causal LM (before LoRA injection).
        layers: also RMSNorm, RoPE and the gated MLP (off where loralei's fused kernels take them over).

    Raises:
        ConfigError: ``liger-kernel`` is not installed.
    """
    _require("liger_kernel", "liger", "training.liger_kernel")
    from liger_kernel.transformers import _apply_liger_kernel_to_instance

    _apply_liger_kernel_to_instance(
        model=model,
        fused_linear_cross_entropy=True,
        cross_entropy=False,
        rms_norm=layers,
        rope=layers,
        swiglu=layers,
        geglu=layers,
    )
