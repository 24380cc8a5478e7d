"""Batching preference items: every pair's two sequences in one batch, through the SFT collator.

Unpacked, each sequence is a row of its own (chosen, rejected, chosen, ...), padded with an attention mask. Packed,
each item is one row whose sequences restart their positions (the SFT collator keeps them apart, see
``collate.py``). With ``share_prompt`` each pair is stored with its prompt once, a row each unpacked or an item's
pairs one after another packed, and the batch carries the indices of the pairs' virtual rows, over which the
attention runs (``shared_prompt.py``). Either way the batch also carries the sequence of every token and the
dataset index of every pair (``loralei.train.preference.logps``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..preference.logps import PAIR_IDS, SEQUENCE_IDS
from .collate import Collator
from .shared_prompt import (
    PAIR_OUTPUT_TOKENS,
    PAIR_OUTPUTS,
    PAIR_PLACES,
    PAIR_ROWS,
    SEQUENCE_TOKENS,
    SharedPair,
    shared_pair,
    virtual_indices,
)


@dataclass(frozen=True)
class PreferenceCollator:
    """Collates :class:`~loralei.train.data.preference.PreferenceDataset` items (a class: workers pickle it).

    Attributes:
        base: the SFT collator (packed, or storing shared prompts, with ``max_seq_length`` twice the sequences').
        share_prompt: each pair's prompt stored once (``shared_prompt.py``).
    """

    base: Collator
    share_prompt: bool = False

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        if self.share_prompt:
            return self._shared(features)
        rows: list[list[tuple[np.ndarray, np.ndarray, int]]] = []  # per row: (ids, labels, sequence id)
        pair_ids = []
        for feature in features:
            packed_row = []
            for index, chosen, rejected in feature["pairs"]:
                k = len(pair_ids)
                pair_ids.append(index)
                packed_row += [(*chosen, 2 * k), (*rejected, 2 * k + 1)]
            rows += [packed_row] if self.base.packed else [[sequence] for sequence in packed_row]
        batch = self.base([_feature(row) for row in rows])
        width = max(batch["input_ids"].numel() // len(rows), 1)
        sequences = torch.full((len(rows), width), -1, dtype=torch.long)
        for r, row in enumerate(rows):
            ids = np.concatenate([np.full(len(seq_ids), seq) for seq_ids, _, seq in row])
            sequences[r, : len(ids)] = torch.from_numpy(ids)
        batch[SEQUENCE_IDS] = sequences.reshape(batch["input_ids"].shape)
        batch[PAIR_IDS] = torch.tensor(pair_ids, dtype=torch.long)
        return batch

    def _shared(self, features: list[dict]) -> dict[str, torch.Tensor]:
        """Each pair stored with its prompt once (``shared_prompt.py``): a row each unpacked, an item's pairs one
        after another in its row packed."""
        rows = [[shared_pair(chosen, rejected) for _, chosen, rejected in f["pairs"]] for f in features]
        batch = self.base([_stored(row) for row in rows])
        maps = virtual_indices(rows, batch["input_ids"].shape[1])
        batch[PAIR_ROWS], batch[PAIR_OUTPUTS], batch[SEQUENCE_IDS] = maps.rows, maps.outputs, maps.sequences
        batch[PAIR_PLACES], batch[PAIR_OUTPUT_TOKENS] = maps.places, maps.output_tokens
        batch[PAIR_IDS] = torch.tensor(
            [index for f in features for index, _, _ in f["pairs"]], dtype=torch.long
        )
        batch[SEQUENCE_TOKENS] = torch.tensor(sum(len(s) for row in rows for p in row for s in p.rows))
        return batch


def _stored(row: list[SharedPair]) -> dict[str, np.ndarray]:
    """One collator row from the stored rows of its pairs."""
    fields = {"input_ids": "ids", "labels": "labels", "position_ids": "positions"}
    return {key: np.concatenate([getattr(pair, field) for pair in row]) for key, field in fields.items()}


def _feature(row: list[tuple[np.ndarray, np.ndarray, int]]) -> dict[str, np.ndarray]:
    """One collator row from its sequences, positions restarting at each."""
    return {
        "input_ids": np.concatenate([ids for ids, _, _ in row]),
        "labels": np.concatenate([labels for _, labels, _ in row]),
        "position_ids": np.concatenate([np.arange(len(ids)) for ids, _, _ in row]),
    }
