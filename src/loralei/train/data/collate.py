"""Batching: padding, per-sample position ids, and keeping packed samples from attending to each other.

How a packed batch isolates its samples depends on the attention backend:

* ``sdpa`` / ``eager`` without an attention mask: Transformers 5 detects packed rows from ``position_ids``
  (a position that is not the previous one plus one starts a new sample) and builds a block-diagonal causal mask,
  but ONLY when the model is called without a cache: pass ``use_cache=False`` (or set
  ``model.config.use_cache = False``); with the default cache it silently attends across samples.
* ``sdpa`` / ``eager`` with ``attention_mask=True``: the collator builds the block-diagonal causal mask itself
  (4D, boolean for sdpa, additive float for eager), which works whatever the cache setting.
* ``flash_attention_2`` / ``flash_attention_3``: Transformers only derives varlen boundaries from ``position_ids``
  for a batch of one row, so the collator lays the whole packed batch out as one row ``[1, B * L]``. These
  backends take no attention mask with packing.
* ``flex_attention``: Transformers builds a block-sparse document mask from ``position_ids`` (a ``BlockMask``:
  which tiles of the score matrix to compute, never an L×L tensor), so the collator adds no mask at all; the
  model runs without a cache (``prepare_model`` sets ``use_cache=False``). No flash-attn package needed. Its rows
  are padded to at least :data:`FLEX_MIN_TOKENS`.

The masks of ``sdpa`` and ``eager`` hold L² values per row (32 GiB at 128K tokens in bf16): long packed rows
want ``flex_attention`` or flash attention.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .errors import DataError, check_max_seq_length
from .template import IGNORE_INDEX

# Attention backend -> how packed samples are kept apart (see the module docstring).
PACKING_ISOLATION = {
    "sdpa": "bool_mask",
    "eager": "additive_mask",
    "flash_attention_2": "varlen",
    "flash_attention_3": "varlen",
    "flex_attention": "position_ids",
}


# flex_attention batches are at least this wide: PyTorch 2.11's Inductor has no flex backward kernel for shorter
# rows (NoValidChoicesError on an H200 at 96 tokens; 128, 200 and 256 run: benchmarks/results/archive/
# 2026-12-04-h200-flex-backward-lengths.txt)
FLEX_MIN_TOKENS = 128


def check_packing_backend(attn_implementation: str, packing: bool) -> None:
    """Checks that packed samples can be kept apart on this attention backend.

    Args:
        attn_implementation: the model's attention implementation (``model.attn_implementation``).
        packing: whether packing is on; without it every backend is fine.

    Raises:
        DataError: packing is on and the backend cannot isolate packed samples.
    """
    if packing and attn_implementation not in PACKING_ISOLATION:
        raise DataError(
            f"model.attn_implementation: packing needs an attention backend that keeps packed samples apart; "
            f"{attn_implementation!r} cannot, so samples would attend to each other. Use one of "
            f"{', '.join(PACKING_ISOLATION)}, or set training.packing: false"
        )


def segment_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """Numbers the samples of each packed row: a new one starts wherever a position does not follow its left one."""
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    return starts.long().cumsum(-1)


def block_causal_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """``[B, 1, L, L]`` boolean mask: a token attends to itself and earlier tokens of its own sample only."""
    seg = segment_ids(position_ids)
    same = seg[:, :, None] == seg[:, None, :]
    causal = torch.ones(seg.shape[1], seg.shape[1], dtype=torch.bool, device=seg.device).tril()
    return (same & causal).unsqueeze(1)


def _additive(mask: torch.Tensor) -> torch.Tensor:
    # eager attention adds the mask to the scores; a float32 mask also works for bf16/fp16 scores (upcast).
    return torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)


MASK_FORMATS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "bool_mask": lambda mask: mask,
    "additive_mask": _additive,
}


@dataclass(frozen=True)
class Collator:
    """Pads and stacks samples; see ``make_collator``. A class (not a closure) so DataLoader workers can pickle it."""

    pad_token_id: int
    max_seq_length: int
    pad_to_max_length: bool
    packed: bool
    attention_mask: bool
    attn_implementation: str
    # without pad_to_max_length, the narrowest batch (the data's widest row: one width for CUDA graphs)
    pad_width: int = 0

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        longest = max(len(f["input_ids"]) for f in features)
        if longest > self.max_seq_length:
            raise DataError(
                f"training.max_seq_length: a sample has {longest} tokens, more than {self.max_seq_length}"
            )
        width = self.max_seq_length if self.pad_to_max_length else max(longest, self.pad_width)
        if self.attn_implementation == "flex_attention":
            width = max(width, FLEX_MIN_TOKENS)
        shape = (len(features), width)
        input_ids = torch.full(shape, self.pad_token_id, dtype=torch.long)
        labels = torch.full(shape, IGNORE_INDEX, dtype=torch.long)
        position_ids = torch.empty(shape, dtype=torch.long)
        for row, feature in enumerate(features):
            n = len(feature["input_ids"])
            input_ids[row, :n] = torch.as_tensor(feature["input_ids"])
            labels[row, :n] = torch.as_tensor(feature["labels"])
            positions = feature.get("position_ids")
            position_ids[row, :n] = torch.as_tensor(positions) if positions is not None else torch.arange(n)
            # Packed: the padding is a sample of its own (positions restart), so no real token attends to it.
            position_ids[row, n:] = torch.arange(width - n) if self.packed else torch.arange(n, width)
        batch = {"input_ids": input_ids, "labels": labels, "position_ids": position_ids}
        if self.packed:
            return self._isolate(batch)
        if self.attention_mask:
            lengths = torch.tensor([len(f["input_ids"]) for f in features])
            batch["attention_mask"] = (torch.arange(width)[None, :] < lengths[:, None]).long()
        return batch

    def _isolate(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        # A sample's first token is never a target, also when a caller's labels say otherwise: otherwise the
        # previous sample's last token would be trained to predict it.
        batch["labels"] = batch["labels"].masked_fill(batch["position_ids"] == 0, IGNORE_INDEX)
        isolation = PACKING_ISOLATION[self.attn_implementation]
        if isolation == "varlen":
            return {key: value.reshape(1, -1) for key, value in batch.items()}
        if isolation == "position_ids":  # the model builds its block-sparse document mask from them
            return batch
        if self.attention_mask:
            batch["attention_mask"] = MASK_FORMATS[isolation](block_causal_mask(batch["position_ids"]))
        return batch


def make_collator(
    pad_token_id: int | None,
    *,
    max_seq_length: int,
    pad_to_max_length: bool,
    packed: bool,
    attention_mask: bool,
    attn_implementation: str = "sdpa",
) -> Callable[[list[dict]], dict[str, torch.Tensor]]:
    """Builds the batch collate function.

    Args:
        pad_token_id: id used for padding (the tokenizer's pad token).
        max_seq_length: the longest allowed sample.
        pad_to_max_length: pad every batch to ``max_seq_length`` (fixed shapes for ``torch.compile``) instead of
            to its longest sample; ``flex_attention`` batches are padded to at least ``FLEX_MIN_TOKENS`` either
            way.
        packed: samples are packed sequences with ``position_ids`` restarting at 0 per sample.
        attention_mask: add an attention mask: ``[B, L]`` padding mask when not packed; when packed (sdpa/eager)
            a ``[B, 1, L, L]`` block-diagonal causal mask. Without it, packed sdpa/eager batches rely on
            Transformers' detection from ``position_ids``, which needs the model called with ``use_cache=False``.
        attn_implementation: the model's attention backend; decides how packed samples are isolated (see
            ``PACKING_ISOLATION``).

    Returns:
        ``collate(features) -> {"input_ids", "labels", "position_ids"[, "attention_mask"]}``, all long tensors
        except a 4D mask (bool for sdpa, float32 for eager). Padding has label -100.

    Raises:
        DataError: no pad token, ``max_seq_length`` < 2, a backend that cannot isolate packed samples, or an
            attention mask requested for packed flash attention.
    """
    if isinstance(pad_token_id, bool) or not isinstance(pad_token_id, int) or pad_token_id < 0:
        raise DataError(
            f"model.tokenizer: pad token id is {pad_token_id!r}; set tokenizer.pad_token (e.g. to the eos token "
            "or a reserved token) before building batches"
        )
    check_max_seq_length(max_seq_length)
    if packed:
        check_packing_backend(attn_implementation, packed)
        if attention_mask and PACKING_ISOLATION[attn_implementation] == "varlen":
            raise DataError(
                f"training.omit_attention_mask_when_packed: {attn_implementation} keeps packed samples apart "
                "through position_ids and takes no attention mask; set it to true"
            )
    return Collator(
        pad_token_id, max_seq_length, pad_to_max_length, packed, attention_mask, attn_implementation
    )
