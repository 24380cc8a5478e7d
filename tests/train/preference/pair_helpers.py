"""Preference pairs of random tokens for the objective tests, and their batches (no tokenizer, no files)."""

from __future__ import annotations

import numpy as np
import torch

from loralei.train.data import make_collator
from loralei.train.data.preference_collate import PreferenceCollator
from loralei.train.losses import IGNORE_INDEX

VOCAB = 128


def make_pairs(n: int, seed: int) -> list[tuple]:
    """``n`` pairs of (prompt + chosen, prompt + rejected), labels on the completions."""
    rng = np.random.default_rng(seed)
    pairs = []
    for i in range(n):
        prompt = rng.integers(3, VOCAB, int(rng.integers(2, 6)))
        sequences = []
        for _ in range(2):
            completion = rng.integers(3, VOCAB, int(rng.integers(1, 6)))
            ids = np.concatenate([prompt, completion])
            sequences.append((ids, np.where(np.arange(len(ids)) >= len(prompt), ids, IGNORE_INDEX)))
        pairs.append((i, *sequences))
    return pairs


def collate(
    pairs: list[tuple], packed: bool, per_row: int = 2, share: bool = False
) -> dict[str, torch.Tensor]:
    """The pairs' batch: packed ``per_row`` to a row, or a row per sequence, or (``share``) a row per pair with
    its prompt stored once (the model's attention then needs ``loralei.train.shared_prompt.enable``)."""
    base = make_collator(0, max_seq_length=64, pad_to_max_length=False, packed=packed, attention_mask=True)
    rows = [pairs[i : i + per_row] for i in range(0, len(pairs), per_row)] if packed else [[p] for p in pairs]
    return PreferenceCollator(base, share_prompt=share)([{"pairs": row} for row in rows])
