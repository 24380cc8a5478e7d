"""The sharded, resumable batch sampler and the single-process fallbacks."""

from __future__ import annotations

import torch

from loralei.train import distributed
from loralei.train.distributed import ShardedBatchSampler


def test_single_process_defaults():
    assert distributed.rank() == 0 and distributed.world_size() == 1 and distributed.is_main_process()
    assert distributed.all_reduce_sum(torch.tensor(3)).item() == 3
    assert distributed.mean_over_ranks(torch.tensor(3.0)).item() == 3.0


def test_ranks_get_disjoint_shards_of_each_global_batch():
    shards = [list(ShardedBatchSampler(20, 3, seed=1, rank=r, world_size=2)) for r in range(2)]
    assert len(shards[0]) == len(shards[1]) == 3  # 20 // (3 * 2); the incomplete global batch is dropped
    flat = [i for shard in shards for batch in shard for i in batch]
    assert len(flat) == len(set(flat)) == 18


def test_epochs_reshuffle_and_start_batch_resumes_mid_epoch():
    sampler = ShardedBatchSampler(12, 2, seed=5)
    epoch0 = list(sampler)
    sampler.set_position(1)
    epoch1 = list(sampler)
    assert epoch0 != epoch1 and sorted(i for b in epoch0 for i in b) == list(range(12))
    sampler.set_position(1, start_batch=4)
    assert list(sampler) == epoch1[4:]
    assert list(ShardedBatchSampler(6, 2, shuffle=False)) == [[0, 1], [2, 3], [4, 5]]


def test_evaluation_keeps_the_incomplete_last_batch():
    shards = [
        list(ShardedBatchSampler(7, 2, shuffle=False, rank=r, world_size=2, drop_last=False))
        for r in range(2)
    ]
    assert shards == [[[0, 1], [4, 5]], [[2, 3], [6]]]
    assert len(ShardedBatchSampler(7, 2, drop_last=False)) == 4
