"""In-memory token data for runner tests (no tokenizer, no files)."""

from __future__ import annotations

import torch

from loralei.train.losses import IGNORE_INDEX


def token_dataset(n: int = 24, vocab: int = 128, seed: int = 0) -> list[dict[str, list[int]]]:
    """Rows of an easy task: a random prompt, then a fixed answer sequence (the trained part)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        length = int(torch.randint(3, 7, (1,), generator=g))
        prompt = torch.randint(3, vocab - 1, (length,), generator=g).tolist()
        answer = list(range(5, 5 + length))
        rows.append({"input_ids": prompt + answer, "labels": [IGNORE_INDEX] * length + answer})
    return rows


def collate(rows: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
    """Right-pads to the longest row; pads get label -100 and attention 0."""
    width = max(len(r["input_ids"]) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        ids[i, :n] = torch.tensor(r["input_ids"])
        labels[i, :n] = torch.tensor(r["labels"])
        mask[i, :n] = 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}
