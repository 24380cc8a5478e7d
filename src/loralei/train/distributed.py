"""Process-group helpers and a resumable, shardable batch sampler.

Single-process runs need no process group: every helper degrades to the one-process answer, so the loop is
written once for both (:mod:`loralei.train.launch` adds the process group and the DDP / FSDP2 engine).
"""

from __future__ import annotations

import contextlib
import pickle
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Sampler

from ..errors import LoraleiError


def _active() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """This process's rank (0 without a process group)."""
    return dist.get_rank() if _active() else 0


def world_size() -> int:
    """Number of processes (1 without a process group)."""
    return dist.get_world_size() if _active() else 1


def is_main_process() -> bool:
    """True on the process that logs and writes files."""
    return rank() == 0


def all_reduce_sum(value: torch.Tensor) -> torch.Tensor:
    """Sum of ``value`` over all processes (``value`` itself without a process group)."""
    if _active():
        value = value.clone()
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return value


def mean_over_ranks(value: torch.Tensor) -> torch.Tensor:
    """The mean of ``value`` over all processes (``value`` itself in one process)."""
    ranks = world_size()
    return value if ranks == 1 else all_reduce_sum(value) / ranks


def gather_to_main(obj: Any) -> list[Any]:
    """Every rank's ``obj`` in rank order on the main process, ``[]`` on the others (``[obj]`` without a
    process group)."""
    if not _active():
        return [obj]
    out = [None] * world_size() if is_main_process() else None
    dist.gather_object(obj, out, dst=0)
    return out or []


def broadcast_from_main(obj: Any) -> Any:
    """The main process's ``obj`` on every process (``obj`` itself without a process group)."""
    if not _active():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier() -> None:
    """Waits for every process (no-op without a process group)."""
    if _active():
        dist.barrier()


class MainProcessFailed(LoraleiError):
    """The main process failed in a block the others wait for; it reports the failure itself."""


def _shareable(exc: Exception) -> Exception:
    """``exc`` if the other processes can receive it (a loralei error), else a stand-in."""
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:
        return MainProcessFailed(f"the main process failed: {type(exc).__name__}")
    return exc if isinstance(exc, LoraleiError) else MainProcessFailed(str(exc))


@contextlib.contextmanager
def main_process_first() -> Iterator[None]:
    """Runs the block on the main process first, then on the others: for work that writes shared files (the
    output-directory claim, dataset caches) or fills caches the others then read. When the block fails on the
    main process, the others raise its error (a bad config or data fails every rank the same way) instead of
    waiting for a process that is gone."""
    if not is_main_process():
        failure = broadcast_from_main(None)
        if failure is not None:
            raise failure
    try:
        yield
    except Exception as exc:  # an interruption reaches every process by itself
        if is_main_process() and _active():
            with contextlib.suppress(RuntimeError):  # a process that is gone already
                broadcast_from_main(_shareable(exc))
        raise
    if is_main_process():
        broadcast_from_main(None)


class ShardedBatchSampler(Sampler[list[int]]):
    """Yields batches of dataset indices for one rank, in an order fixed by ``(seed, epoch)``.

    Every epoch is a fresh permutation (or ``range`` without shuffling) split into global batches of
    ``batch_size * world_size`` indices; rank ``r`` takes the ``r``-th slice of each. An incomplete final
    global batch is dropped (unless ``drop_last=False``, for evaluation) so every rank steps the same number of
    times. ``start_batch`` skips batches of the
    current epoch without touching the data, which is how a resumed run continues exactly where it stopped.

    Args:
        num_samples: dataset length.
        batch_size: samples per batch on each rank.
        seed: base seed of the shuffle.
        shuffle: permute the indices every epoch.
        rank: this process's rank.
        world_size: number of processes.
        drop_last: drop the incomplete final global batch (training); keep it, split over ranks (evaluation).
    """

    def __init__(
        self,
        num_samples: int,
        batch_size: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        rank: int = 0,
        world_size: int = 1,
        drop_last: bool = True,
    ) -> None:
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.rank = rank
        self.world_size = world_size
        self.drop_last = drop_last
        self.epoch = 0
        self.start_batch = 0

    def set_position(self, epoch: int, start_batch: int = 0) -> None:
        """Makes the next iteration yield epoch ``epoch`` from its ``start_batch``-th batch."""
        self.epoch = epoch
        self.start_batch = start_batch

    def __len__(self) -> int:
        span = self.batch_size * self.world_size
        return self.num_samples // span if self.drop_last else -(-self.num_samples // span)

    def _order(self) -> list[int]:
        if not self.shuffle:
            return list(range(self.num_samples))
        generator = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)
        return torch.randperm(self.num_samples, generator=generator).tolist()

    def __iter__(self) -> Iterator[list[int]]:
        order = self._order()
        span = self.batch_size * self.world_size
        for b in range(self.start_batch, len(self)):
            first = b * span + self.rank * self.batch_size
            batch = order[first : first + self.batch_size]
            if batch:  # an incomplete last global batch may leave nothing for the last ranks
                yield batch
