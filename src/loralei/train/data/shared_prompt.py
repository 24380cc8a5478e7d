"""A preference pair stored with its prompt once, so that the prompt runs through the layers once.

A pair's chosen and rejected sequences begin with the same prompt: their longest common prefix of token ids in
which neither trains a label, short of each sequence's last token (:func:`shared_length`). Run as two rows, the
prompt's tokens go through every layer twice. Stored once, a pair of ``s`` shared tokens is (a row of its own, or
packed after the pairs before it in theirs)::

    tokens     P (the prompt)   C (chosen's completion)   b (the prompt's last token again)   R (rejected's)
    positions  0 .. s-1         s .. s+c-1                s-1                                  s .. s+r-1
    labels     ignored          chosen's                  ignored                              rejected's

so every stored token's target is still the next stored token's label, as in any row: P's last token predicts C's
first token, ``b`` (the same token at the same position, seeing the same prompt) predicts R's first, and C's last
predicts nothing (``b``'s label is ignored). Without a shared token (``s`` = 0) the row is ``C R``.

Attention cannot run over that row as it stands (R must not see C). It runs over two virtual rows per pair, each a
whole sequence as it reads unshared: chosen ``[P, C]`` and rejected ``[P without its last token, b, R]``
(:data:`PAIR_ROWS`: the stored tokens of each virtual row); each stored token takes its output from its own
virtual row, P's from the chosen one (:data:`PAIR_OUTPUTS`). :mod:`loralei.train.shared_prompt` gathers the queries,
keys and values of the virtual rows from the stored ones, so the prompt's keys and values get both rows'
gradients, as unshared.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from ..losses import PAIR_OUTPUT_TOKENS, PAIR_OUTPUTS, PAIR_PLACES, PAIR_ROWS
from .template import IGNORE_INDEX

# The batch's keys (the first four are model inputs, passed on to the attention; the last two are the backward's):
# PAIR_ROWS (2·pairs, W) long: each virtual row's stored tokens, as flat indices (row · width + position) into the
#   batch's (B, width) tokens; chosen at 2k, rejected at 2k + 1; past a row's end 0 (right padding, never read:
#   causal)
# PAIR_OUTPUTS (B, width) long: the flat index (virtual row · W + place) of each stored token's output; 0 for padding
# PAIR_PLACES (B, width, 2) long: the flat virtual places that read each stored token, its own row's first, then
#   the other row's for a shared prompt token but the last; -1 for none
# PAIR_OUTPUT_TOKENS (2·pairs, W) long: the flat stored token that takes each virtual place's output, -1 for none
#   (the rejected row's prompt places, padding)
# SEQUENCE_TOKENS 0-dim long: the tokens of the batch's sequences as they read unshared (what a run's tokens/s
#   counts, so that it compares with unshared runs: the same pairs, in less time)
SEQUENCE_TOKENS = "sequence_tokens"
__all__ = [
    "PAIR_OUTPUTS", "PAIR_OUTPUT_TOKENS", "PAIR_PLACES", "PAIR_ROWS", "SEQUENCE_TOKENS", "SharedPair",
    "VirtualIndices", "shared_length", "shared_pair", "virtual_indices",
]  # fmt: skip

Sequence = tuple[np.ndarray, np.ndarray]  # (input_ids, labels)


def _first_trained(labels: np.ndarray) -> int:
    trained = np.flatnonzero(labels != IGNORE_INDEX)
    return int(trained[0]) if trained.size else len(labels)


def shared_length(chosen: Sequence, rejected: Sequence) -> int:
    """The tokens the two sequences share at their start: equal ids, no trained label in either, and at least
    one token of each left after them."""
    limit = min(
        len(chosen[0]) - 1, len(rejected[0]) - 1, _first_trained(chosen[1]), _first_trained(rejected[1])
    )
    if limit <= 0:
        return 0
    differs = np.flatnonzero(chosen[0][:limit] != rejected[0][:limit])
    return int(differs[0]) if differs.size else limit


class SharedPair(NamedTuple):
    """One pair's stored row (the module docstring) and its two virtual rows.

    Attributes:
        ids, labels, positions: the stored row; a token's position is also its place in its own virtual row.
        rejected: per stored token, whether it belongs to the rejected sequence (``b`` and R; P and C are the
            chosen one's).
        rows: the stored tokens of the chosen and of the rejected virtual row, in order.
    """

    ids: np.ndarray
    labels: np.ndarray
    positions: np.ndarray
    rejected: np.ndarray
    rows: tuple[np.ndarray, np.ndarray]


def shared_pair(chosen: Sequence, rejected: Sequence) -> SharedPair:
    """The stored row of a pair and its virtual rows (module docstring)."""
    s = shared_length(chosen, rejected)
    (chosen_ids, chosen_labels), (rejected_ids, rejected_labels) = chosen, rejected
    bridge = 1 if s else 0
    n_chosen, n_rest = len(chosen_ids), bridge + len(rejected_ids) - s
    ignored = np.full(bridge, IGNORE_INDEX, dtype=chosen_labels.dtype)
    rest_start = s - bridge  # b's position and place: the prompt's last token's
    return SharedPair(
        ids=np.concatenate([chosen_ids, rejected_ids[s - bridge : s], rejected_ids[s:]]),
        labels=np.concatenate([chosen_labels, ignored, rejected_labels[s:]]),
        positions=np.concatenate([np.arange(n_chosen), rest_start + np.arange(n_rest)]),
        rejected=np.repeat([False, True], [n_chosen, n_rest]),
        rows=(np.arange(n_chosen), np.concatenate([np.arange(rest_start), n_chosen + np.arange(n_rest)])),
    )


class VirtualIndices(NamedTuple):
    """A batch's maps between its stored tokens (``B × width``, flat ``row · width + position``) and its virtual
    rows (``2·pairs × W``, flat ``virtual row · W + place``); each virtual place reads one stored token, each stored
    token is read by one virtual place or two (a shared prompt token but the last: both rows read it).

    Attributes:
        rows: :data:`PAIR_ROWS`.
        outputs: :data:`PAIR_OUTPUTS`.
        places: :data:`PAIR_PLACES`.
        output_tokens: :data:`PAIR_OUTPUT_TOKENS`.
        sequences: the sequence of every stored token (``2k`` for pair ``k``'s chosen sequence, ``2k + 1`` for its
            rejected one, -1 for padding: what ``SEQUENCE_IDS`` holds).
    """

    rows: torch.Tensor
    outputs: torch.Tensor
    places: torch.Tensor
    output_tokens: torch.Tensor
    sequences: torch.Tensor


def virtual_indices(rows: list[list[SharedPair]], width: int) -> VirtualIndices:
    """The maps of a batch whose row ``b`` holds the stored rows of ``rows[b]``'s pairs one after another (one
    pair a row unpacked, several packed), padded to ``width``; the pairs are numbered in that order."""
    pairs = [pair for row in rows for pair in row]
    virtual_width = max(len(stored) for pair in pairs for stored in pair.rows)
    virtual = torch.zeros(2 * len(pairs), virtual_width, dtype=torch.long)
    output_tokens = torch.full_like(virtual, -1)
    outputs = torch.zeros(len(rows), width, dtype=torch.long)
    places = torch.full((len(rows), width, 2), -1, dtype=torch.long)
    sequences = torch.full((len(rows), width), -1, dtype=torch.long)
    k = 0
    for b, row in enumerate(rows):
        offset = 0  # the pair's first token in its batch row
        for pair in row:
            for side, stored in enumerate(pair.rows):
                tokens = torch.from_numpy(b * width + offset + stored)
                virtual[2 * k + side, : len(stored)] = tokens
                own = torch.from_numpy(pair.rejected[stored] == bool(side))  # the places whose output is kept
                output_tokens[2 * k + side, : len(stored)] = torch.where(own, tokens, -1)
                read = (2 * k + side) * virtual_width + torch.arange(len(stored))
                places.view(-1, 2)[tokens, (~own).long()] = read  # a token's own row's place first
            tokens = slice(offset, offset + len(pair.ids))
            sequences[b, tokens] = torch.from_numpy(2 * k + pair.rejected.astype(np.int64))
            outputs[b, tokens] = sequences[b, tokens] * virtual_width + torch.from_numpy(pair.positions)
            offset, k = offset + len(pair.ids), k + 1
    return VirtualIndices(virtual, outputs, places, output_tokens, sequences)
