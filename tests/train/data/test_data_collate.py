"""Best-fit-decreasing packing and the batch collator."""

from __future__ import annotations

import bisect
import dataclasses
import pickle
import random

import numpy as np
import pytest
import torch

from loralei.train.data import (
    DataError,
    best_fit_decreasing,
    block_causal_mask,
    check_packing_backend,
    make_collator,
)


def test_best_fit_decreasing_fills_the_tightest_bin() -> None:
    bins = best_fit_decreasing([6, 5, 4, 3, 2], capacity=10)
    assert sorted(map(sorted, bins)) == [[0, 2], [1, 3, 4]]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_best_fit_decreasing_keeps_every_sample_once_within_capacity(seed) -> None:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 33, (200,), generator=g).tolist()
    bins = best_fit_decreasing(lengths, capacity=32, seed=seed)
    assert sorted(i for b in bins for i in b) == list(range(200))
    assert all(sum(lengths[i] for i in b) <= 32 for b in bins)
    assert len(bins) <= -(-sum(lengths) // 32) * 1.25  # close to the lower bound on this easy mix
    assert bins == best_fit_decreasing(lengths, capacity=32, seed=seed)


def _reference_best_fit_decreasing(lengths: list[int], capacity: int, seed: int) -> list[list[int]]:
    """The packing as first written (Python sort, bisect over open bins): the bins must stay these."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    rooms: list[tuple[int, int]] = []
    for i in order:
        at = bisect.bisect_left(rooms, (lengths[i], -1))
        if at == len(rooms):
            bins.append([i])
            room, b = capacity - lengths[i], len(bins) - 1
        else:
            room, b = rooms.pop(at)
            bins[b].append(i)
            room -= lengths[i]
        if room > 0:
            bisect.insort(rooms, (room, b))
    random.Random(seed).shuffle(bins)
    return bins


@pytest.mark.parametrize("seed", [0, 3])
def test_best_fit_decreasing_gives_the_same_bins_as_before(seed) -> None:
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(5.5, 0.6, 3000).astype(int), 1, 512)
    expected = _reference_best_fit_decreasing(lengths.tolist(), 512, seed)
    assert best_fit_decreasing(lengths, 512, seed=seed) == expected
    assert best_fit_decreasing(lengths.tolist(), 512, seed=seed) == expected


def test_best_fit_decreasing_rejects_bad_lengths() -> None:
    with pytest.raises(ValueError, match="sample 1 has length 11"):
        best_fit_decreasing([3, 11], capacity=10)


FEATURES = [
    {"input_ids": [5, 6, 7], "labels": [-100, 6, 7]},
    {"input_ids": [8, 9], "labels": [-100, 9]},
]
PACKED = [
    {"input_ids": [5, 6, 7, 8, 9], "labels": [5, 6, 7, 8, 9], "position_ids": [0, 1, 2, 0, 1]},
    {"input_ids": [4, 3], "labels": [-100, 3], "position_ids": [0, 1]},
]


def _collate(features, **kw):
    args = {"max_seq_length": 6, "pad_to_max_length": False, "packed": False, "attention_mask": False}
    return make_collator(0, **{**args, **kw})(features)


def test_unpacked_batch_pads_right_with_ignored_labels() -> None:
    batch = _collate(FEATURES, attention_mask=True)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 9, 0]]
    assert batch["labels"].tolist() == [[-100, 6, 7], [-100, 9, -100]]
    assert batch["position_ids"].tolist() == [[0, 1, 2], [0, 1, 2]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    assert "attention_mask" not in _collate(FEATURES)
    assert _collate(FEATURES, pad_to_max_length=True)["input_ids"].shape == (2, 6)


def test_pad_width_is_the_narrowest_batch() -> None:
    """``pad_width`` (the runner's data's widest row, for CUDA graphs) pads a narrower batch to it, and a wider
    batch (an evaluation split's longer rows) keeps its own width."""
    args = {"max_seq_length": 6, "pad_to_max_length": False, "packed": False, "attention_mask": True}
    collate = dataclasses.replace(make_collator(0, **args), pad_width=5)
    batch = collate(FEATURES)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 0, 0], [8, 9, 0, 0, 0]]
    assert batch["labels"].tolist() == [[-100, 6, 7, -100, -100], [-100, 9, -100, -100, -100]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0, 0], [1, 1, 0, 0, 0]]
    narrow = dataclasses.replace(collate, pad_width=2)
    assert narrow(FEATURES)["input_ids"].shape == (2, 3)


def test_packed_batch_isolates_samples_and_padding() -> None:
    batch = _collate(PACKED, packed=True, attention_mask=True)
    # Padding restarts positions, so it is a segment of its own; sample starts are never targets.
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1], [0, 1, 0, 1, 2]]
    assert batch["labels"].tolist() == [[-100, 6, 7, -100, 9], [-100, 3, -100, -100, -100]]
    mask = batch["attention_mask"]
    assert mask.dtype == torch.bool and mask.shape == (2, 1, 5, 5)
    assert mask[0, 0].int().tolist() == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],
        [0, 0, 0, 1, 0],
        [0, 0, 0, 1, 1],
    ]
    assert not mask[1, 0, 2:, :2].any() and mask[1, 0, 2:, 2:].any()
    assert "attention_mask" not in _collate(PACKED, packed=True)


def test_eager_gets_an_additive_mask() -> None:
    batch = _collate(PACKED, packed=True, attention_mask=True, attn_implementation="eager")
    mask = batch["attention_mask"]
    expected = block_causal_mask(batch["position_ids"])
    assert mask.dtype == torch.float32
    assert torch.equal(mask == 0, expected)
    assert (mask[~expected] == torch.finfo(torch.float32).min).all()


def test_flash_attention_gets_one_flat_row() -> None:
    batch = _collate(PACKED, packed=True, attn_implementation="flash_attention_2", pad_to_max_length=True)
    assert set(batch) == {"input_ids", "labels", "position_ids"}
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 0, 1, 0, 1, 2, 3]]
    assert batch["input_ids"].shape == (1, 12)
    with pytest.raises(
        DataError, match=r"omit_attention_mask_when_packed: flash_attention_2 .* set it to true"
    ):
        make_collator(
            0,
            max_seq_length=6,
            pad_to_max_length=False,
            packed=True,
            attention_mask=True,
            attn_implementation="flash_attention_2",
        )


def test_backends_that_cannot_isolate_samples_are_refused() -> None:
    for backend in ("sdpa", "eager", "flash_attention_2", "flash_attention_3"):
        check_packing_backend(backend, packing=True)
    check_packing_backend("flex_attention", packing=False)
    with pytest.raises(DataError, match=r"model\.attn_implementation: packing .* 'paged_attention' cannot"):
        check_packing_backend("paged_attention", packing=True)
    with pytest.raises(DataError, match="attn_implementation"):
        make_collator(
            0,
            max_seq_length=8,
            pad_to_max_length=False,
            packed=True,
            attention_mask=False,
            attn_implementation="kernels-community/vllm-flash-attn3",
        )


def test_collator_bad_input() -> None:
    args = {"max_seq_length": 4, "pad_to_max_length": False, "packed": False, "attention_mask": False}
    with pytest.raises(DataError, match=r"model\.tokenizer: pad token id is None"):
        make_collator(None, **args)
    with pytest.raises(DataError, match=r"training\.max_seq_length: must be an integer >= 2, got 1"):
        make_collator(0, **{**args, "max_seq_length": 1})
    with pytest.raises(DataError, match="a sample has 5 tokens, more than 4"):
        make_collator(0, **args)([{"input_ids": [1] * 5, "labels": [1] * 5}])


def test_collator_pickles_for_dataloader_workers() -> None:
    collate = make_collator(0, max_seq_length=6, pad_to_max_length=False, packed=True, attention_mask=True)
    again = pickle.loads(pickle.dumps(collate))
    assert torch.equal(again(PACKED)["attention_mask"], collate(PACKED)["attention_mask"])


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "unpacked"])
def test_flex_batches_are_padded_to_the_width_its_backward_takes(packed: bool) -> None:
    from loralei.train.data.collate import FLEX_MIN_TOKENS

    features = [{"input_ids": [5, 6, 7], "labels": [5, 6, 7]}, {"input_ids": [8, 9], "labels": [8, 9]}]
    args = {"max_seq_length": 64, "pad_to_max_length": True, "packed": packed, "attention_mask": not packed}
    flex = make_collator(0, **args, attn_implementation="flex_attention")(features)
    sdpa = make_collator(0, **args, attn_implementation="sdpa")(features)
    assert flex["input_ids"].shape == (2, FLEX_MIN_TOKENS) and sdpa["input_ids"].shape == (2, 64)
    assert (flex["labels"][:, 3:] == -100).all() and (flex["input_ids"][:, 3:] == 0).all()
    tail = flex["position_ids"][1, 2:]
    # packed: the padding restarts the positions (a sample of its own); unpacked: they run on, masked out
    assert tail.tolist() == (list(range(FLEX_MIN_TOKENS - 2)) if packed else list(range(2, FLEX_MIN_TOKENS)))
    if not packed:
        assert flex["attention_mask"].sum(1).tolist() == [3, 2]
