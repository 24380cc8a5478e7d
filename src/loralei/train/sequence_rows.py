"""The documents of whole rows under sequence parallelism: what keeps a packed row's documents apart once
attention runs over the whole row (:mod:`loralei.train.sequence_parallel`).

Each rank holds the position ids of its own shard; a new document starts wherever a position does not follow
its left neighbour (:func:`loralei.train.data.collate.segment_ids`), which may be on another rank.
:func:`attention_inputs` gathers the shards' position ids into the whole rows' once per forward (every layer's
attention receives the same tensor of this rank's ids) and turns them into what the wrapped attention takes to
attend causally within each document only:

- ``sdpa``: a boolean ``[B, 1, L, L]`` mask (L² values a row, as sdpa's packed rows have without sequence
  parallelism);
- ``flash_attention_2``: the whole rows' position ids, from which Transformers' flash path cuts the documents
  (variable-length attention);
- ``flex_attention``: a block-sparse document mask (``BlockMask``: which tiles of the score matrix to compute, never
  an L×L tensor), also for rows that are not packed, since flex attention has no causal flag.

Rows that are not packed run ``sdpa`` and ``flash_attention_2`` causally without any of this.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.distributed as dist

from .data.collate import block_causal_mask, segment_ids


class _Gathered:
    """The last gathered rows: a weak reference to the shard's position ids they came from, the rows, and the
    inputs made from them per attention backend."""

    def __init__(self) -> None:
        self.source: weakref.ref | None = None
        self.version = -1
        self.rows: torch.Tensor | None = None
        self.inputs: dict[str, tuple[Any, dict[str, Any]]] = {}

    def holds(self, positions: torch.Tensor) -> bool:
        return self.source is not None and self.source() is positions and positions._version == self.version


_LAST = _Gathered()


def attention_inputs(inner: str, positions: torch.Tensor, group: Any) -> tuple[Any, dict[str, Any]]:
    """The attention mask and the extra keyword arguments that keep the whole rows' documents apart under the
    ``inner`` attention, from this rank's ``(B, n)`` shard of their position ids, gathered over ``group`` into
    ``(B, size * n)`` (every rank calls it at the same point of the forward). Both are reused while the same
    unchanged tensor comes back (the next layers, a checkpoint's recomputation)."""
    if not _LAST.holds(positions):
        shards = [torch.empty_like(positions) for _ in range(dist.get_world_size(group))]
        dist.all_gather(shards, positions.contiguous(), group=group)
        _LAST.source, _LAST.version = weakref.ref(positions), positions._version
        _LAST.rows, _LAST.inputs = torch.cat(shards, 1), {}
    if inner not in _LAST.inputs:
        _LAST.inputs[inner] = _made(inner, _LAST.rows)
    return _LAST.inputs[inner]


def _made(inner: str, rows: torch.Tensor) -> tuple[Any, dict[str, Any]]:
    if inner == "flash_attention_2":
        return None, {"position_ids": rows}
    if inner == "flex_attention":
        return document_block_mask(rows), {}
    return block_causal_mask(rows), {}


def document_mask_mod(rows: torch.Tensor):
    """Flex attention's mask function for ``rows``: a query attends to keys at or before it in its document."""
    documents = segment_ids(rows)

    def same_document_causal(batch, head, q, kv):
        return (documents[batch, q] == documents[batch, kv]) & (kv <= q)

    return same_document_causal


def document_block_mask(rows: torch.Tensor) -> Any:
    """The ``BlockMask`` of :func:`document_mask_mod` for rows of ``rows``' shape, on their device: on CUDA made
    by a compiled pass over the tiles, as Transformers makes its own (uncompiled, the mask function would run over
    all L×L pairs at once)."""
    from torch.nn.attention.flex_attention import create_block_mask

    batch, length = rows.shape
    mod = document_mask_mod(rows)
    return create_block_mask(mod, batch, None, length, length, device=rows.device, _compile=rows.is_cuda)
