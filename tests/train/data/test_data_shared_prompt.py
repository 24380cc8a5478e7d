"""Pairs stored with their prompt once (``preference.share_prompt``): the shared length, the stored row, and the
batch's virtual rows, which read every sequence as it is unshared, with each stored token's output taken from its
own row and every trained target where the unshared rows have it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from loralei.train.data import make_collator
from loralei.train.data.preference_collate import PreferenceCollator
from loralei.train.data.shared_prompt import (
    PAIR_OUTPUT_TOKENS,
    PAIR_OUTPUTS,
    PAIR_PLACES,
    PAIR_ROWS,
    SEQUENCE_TOKENS,
    shared_length,
    shared_pair,
)
from loralei.train.losses import IGNORE_INDEX, shift_targets, trainable_labels
from loralei.train.preference.logps import PAIR_IDS, SEQUENCE_IDS

X = IGNORE_INDEX


def seq(ids: list[int], prompt: int) -> tuple[np.ndarray, np.ndarray]:
    """A sequence whose first ``prompt`` tokens are untrained."""
    ids_array = np.array(ids, dtype=np.int64)
    labels = ids_array.copy()
    labels[:prompt] = X
    return ids_array, labels


@pytest.mark.parametrize(
    ("chosen", "rejected", "expected"),
    [
        (seq([1, 2, 3, 4, 5], 3), seq([1, 2, 3, 6, 7, 8], 3), 3),  # the prompt
        (seq([1, 2, 3, 4, 5], 3), seq([1, 2, 9, 6, 7], 3), 2),  # the ids part before the prompt's end
        (seq([9, 2, 3, 4], 3), seq([1, 2, 3, 4], 3), 0),  # nothing in common
        (seq([1, 2, 3, 4, 5], 2), seq([1, 2, 3, 4, 6], 4), 2),  # up to the first trained label of either
        (seq([1, 2, 3], 3), seq([1, 2, 3, 4], 3), 2),  # a completion keeps at least one token
        (seq([1], 1), seq([1, 2], 1), 0),
    ],
)
def test_shared_length_is_the_untrained_common_start_short_of_each_last_token(
    chosen, rejected, expected
) -> None:
    assert shared_length(chosen, rejected) == expected


def test_the_stored_row_holds_the_prompt_once_and_a_bridge_token_before_the_rejected_completion() -> None:
    pair = shared_pair(seq([1, 2, 3, 4, 5], 3), seq([1, 2, 3, 6, 7, 8], 3))
    assert pair.ids.tolist() == [1, 2, 3, 4, 5, 3, 6, 7, 8]
    assert pair.labels.tolist() == [X, X, X, 4, 5, X, 6, 7, 8]
    assert pair.positions.tolist() == [0, 1, 2, 3, 4, 2, 3, 4, 5]
    assert pair.rejected.tolist() == [False] * 5 + [True] * 4
    assert [rows.tolist() for rows in pair.rows] == [[0, 1, 2, 3, 4], [0, 1, 5, 6, 7, 8]]


def test_without_a_shared_token_the_row_is_both_sequences() -> None:
    pair = shared_pair(seq([9, 2, 3], 1), seq([1, 5], 1))
    assert pair.ids.tolist() == [9, 2, 3, 1, 5] and pair.positions.tolist() == [0, 1, 2, 0, 1]
    assert [rows.tolist() for rows in pair.rows] == [[0, 1, 2], [3, 4]]


def _sequences(rng: np.random.Generator, pairs: int) -> list[tuple]:
    """Random pairs: a prompt of 0-5 shared tokens (sometimes differing inside), completions of 1-6 tokens."""
    out = []
    for index in range(pairs):
        prompt = rng.integers(1, 50, rng.integers(0, 6)).tolist()
        other = list(prompt)
        if prompt and rng.random() < 0.3:
            other[rng.integers(len(prompt))] = 99
        chosen = prompt + rng.integers(1, 50, rng.integers(1, 7)).tolist()
        rejected = other + rng.integers(1, 50, rng.integers(1, 7)).tolist()
        out.append((index, seq(chosen, len(prompt)), seq(rejected, len(prompt))))
    return out


def _collate(share: bool, packed: bool = False):
    base = make_collator(0, max_seq_length=128, pad_to_max_length=False, packed=packed, attention_mask=True)
    return PreferenceCollator(base, share_prompt=share)


def _targets(batch: dict) -> list[tuple[int, int, int]]:
    """(sequence, place in it, target) of every trained position, the place read from the position ids."""
    targets = shift_targets(trainable_labels(batch))
    sequences = shift_targets(batch[SEQUENCE_IDS])
    trained = targets != X
    return sorted(
        zip(
            sequences[trained].tolist(),
            batch["position_ids"][trained].tolist(),
            targets[trained].tolist(),
            strict=True,
        )
    )


@pytest.mark.parametrize("packed", [False, True], ids=["row-a-pair", "packed"])
@pytest.mark.parametrize("seed", range(4))
def test_virtual_rows_read_every_sequence_and_the_targets_are_the_unshared_ones(
    seed: int, packed: bool
) -> None:
    """Each virtual row gathers its sequence's ids at positions 0, 1, ... (the unshared row) from its item's batch
    row, every stored token's output index points back at itself, and the trained (sequence, place, target) triples
    are the unshared batch's; a pair stores s - 1 tokens fewer (s its shared length)."""
    items = _sequences(np.random.default_rng(seed), 6)
    per_row = 3 if packed else 1
    features = [{"pairs": items[i : i + per_row]} for i in range(0, len(items), per_row)]
    shared, plain = _collate(True, packed)(features), _collate(False, packed)(features)
    assert shared["input_ids"].shape[0] == len(features) and torch.equal(shared[PAIR_IDS], plain[PAIR_IDS])
    width = shared["input_ids"].shape[1]
    flat_ids, flat_positions = shared["input_ids"].flatten(), shared["position_ids"].flatten()
    for k, (_, chosen, rejected) in enumerate(items):
        for side, (ids, _) in enumerate((chosen, rejected)):
            rows = shared[PAIR_ROWS][2 * k + side, : len(ids)]
            assert flat_ids[rows].tolist() == ids.tolist()
            assert flat_positions[rows].tolist() == list(range(len(ids)))
            assert (rows // width == k // per_row).all()  # its item's batch row
    stored = shared[SEQUENCE_IDS].flatten() >= 0
    flat = torch.arange(stored.numel())
    assert torch.equal(shared[PAIR_ROWS].flatten()[shared[PAIR_OUTPUTS].flatten()][stored], flat[stored])
    assert _targets(shared) == _targets(plain)
    lengths = [len(seq[0]) for _, chosen, rejected in items for seq in (chosen, rejected)]
    assert int(shared[SEQUENCE_TOKENS]) == sum(lengths)
    saved = sum(max(shared_length(chosen, rejected) - 1, 0) for _, chosen, rejected in items)
    assert int(stored.sum()) == sum(lengths) - saved


def test_the_rejected_rows_output_of_the_prompt_is_not_read() -> None:
    """The prompt's tokens take their outputs from the chosen row; the rejected row's copies of them (its first
    s - 1 places) are never an output's source."""
    batch = _collate(True)([{"pairs": [(0, *[seq([1, 2, 3, 4, 5], 3), seq([1, 2, 3, 6, 7], 3)])]}])
    virtual_width = batch[PAIR_ROWS].shape[1]
    sources = set(batch[PAIR_OUTPUTS][0, :9].tolist())
    assert {virtual_width + 0, virtual_width + 1}.isdisjoint(sources)
    assert {0, 1, 2, virtual_width + 2} <= sources


@pytest.mark.parametrize("packed", [False, True], ids=["row-a-pair", "packed"])
@pytest.mark.parametrize("seed", range(3))
def test_the_backward_maps_invert_the_gathers(seed: int, packed: bool) -> None:
    """PAIR_PLACES lists every virtual place that reads a stored token (its own row's first; -1 for none, padding
    included) and PAIR_OUTPUT_TOKENS the stored token each virtual place gives its output to (-1 for none): the
    inverses of PAIR_ROWS over the virtual rows' lengths and of PAIR_OUTPUTS over the stored tokens."""
    items = _sequences(np.random.default_rng(seed + 10), 6)
    per_row = 3 if packed else 1
    batch = _collate(True, packed)([{"pairs": items[i : i + per_row]} for i in range(0, len(items), per_row)])
    rows, virtual_width = batch[PAIR_ROWS], batch[PAIR_ROWS].shape[1]
    lengths = [len(s[0]) for _, chosen, rejected in items for s in (chosen, rejected)]
    reads: dict[int, list[int]] = {}
    for v, length in enumerate(lengths):
        for place in range(length):
            reads.setdefault(int(rows[v, place]), []).append(v * virtual_width + place)
    places = batch[PAIR_PLACES].view(-1, 2).tolist()
    outputs, stored = batch[PAIR_OUTPUTS].flatten(), batch[SEQUENCE_IDS].flatten() >= 0
    for token, (first, second) in enumerate(places):
        want = reads.get(token, [])
        assert sorted(p for p in (first, second) if p >= 0) == sorted(want)
        assert first == (int(outputs[token]) if stored[token] else -1)  # its own row's place first
        assert second < 0 or first >= 0
    owners = batch[PAIR_OUTPUT_TOKENS].flatten()
    for token in torch.nonzero(stored).flatten().tolist():
        assert int(owners[outputs[token]]) == token
    assert int((owners >= 0).sum()) == int(stored.sum())  # no other place gives its output
    shared_reads = sum(max(shared_length(chosen, rejected) - 1, 0) for _, chosen, rejected in items)
    assert int((batch[PAIR_PLACES][..., 1] >= 0).sum()) == shared_reads
