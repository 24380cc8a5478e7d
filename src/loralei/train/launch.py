"""Multi-process launch: read torchrun's environment, start the process group, wrap the model for DDP.

``torchrun --nproc_per_node N -m loralei.cli config.yaml`` (or ``accelerate launch``, which sets the same
variables) starts N processes with ``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``, ``MASTER_ADDR`` and
``MASTER_PORT``. ``training.distributed: auto`` trains with DDP when ``WORLD_SIZE > 1`` and in one process
otherwise; ``ddp`` asks for DDP explicitly (also with one process under torchrun). NCCL serves CUDA, gloo the
CPU.

DDP wraps a :class:`LossModule` (model and loss function as one module), so every loss, including those that
apply the output head themselves, runs inside DDP's forward. Only trainable parameters take part: frozen base
weights and buffers are neither broadcast nor reduced. Gradients are summed over ranks in FP32; the loop
normalises each rank's loss by the window's trainable tokens over all ranks, so the sum is the window's mean.
"""

from __future__ import annotations

import datetime
import gc
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..errors import ConfigError
from .losses import Batch, LossFn

TORCHRUN_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
# A collective that waits this long means a rank is gone; torchrun ends the job sooner when a rank exits.
_TIMEOUT = datetime.timedelta(minutes=30)


@dataclass(frozen=True)
class Launch:
    """How this process was started: its mode ("none" or "ddp"), rank, local rank, world size."""

    mode: str
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @property
    def distributed(self) -> bool:
        return self.mode != "none"


def read_launch(mode: str, env: Mapping[str, str] = os.environ) -> Launch:
    """Resolves ``training.distributed`` against the launcher's environment.

    Args:
        mode: "auto", "none" or "ddp".
        env: the process environment.

    Returns:
        The launch; ``mode`` "none" means one process without a process group.

    Raises:
        ConfigError: a partial torchrun environment, or a mode that needs a launcher and has none (or the
            reverse: several processes with ``distributed: none``).
    """
    present = [k for k in TORCHRUN_VARIABLES if k in env]
    if not present:
        if mode == "ddp":
            raise ConfigError(
                "training.distributed: ddp needs processes started by torchrun (no RANK / WORLD_SIZE in the "
                "environment); launch with `torchrun --nproc_per_node N -m loralei.cli CONFIG`, or set "
                "distributed: auto"
            )
        return Launch("none")
    if missing := [k for k in TORCHRUN_VARIABLES if k not in env]:
        raise ConfigError(
            f"the environment sets {', '.join(present)} but not {', '.join(missing)}: a multi-process run must be "
            "started by torchrun (or accelerate launch), which sets all of them; unset them to train in one process"
        )
    world, rank, local = int(env["WORLD_SIZE"]), int(env["RANK"]), int(env["LOCAL_RANK"])
    if mode == "none" and world > 1:
        raise ConfigError(
            f"training.distributed: none, but torchrun started {world} processes; use distributed: auto (DDP) "
            "or launch one process"
        )
    if mode == "none" or (mode == "auto" and world == 1):
        return Launch("none")
    return Launch("ddp", rank, local, world)


def device_for(launch: Launch) -> torch.device:
    """This process's device: CUDA device ``LOCAL_RANK`` when there is CUDA, else the CPU."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    if launch.local_rank >= torch.cuda.device_count():
        raise ConfigError(
            f"LOCAL_RANK={launch.local_rank} but this machine has {torch.cuda.device_count()} CUDA device(s); "
            "launch at most one process per GPU (torchrun --nproc_per_node)"
        )
    return torch.device("cuda", launch.local_rank)


def start(launch: Launch) -> torch.device:
    """Selects this process's device and, for a distributed launch, starts the process group on it (NCCL on
    CUDA, gloo on the CPU). Returns the device."""
    device = device_for(launch)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if launch.distributed and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend, timeout=_TIMEOUT, device_id=device if device.type == "cuda" else None
        )
    return device


def stop() -> None:
    """Ends the process group after a run that finished on every rank: a barrier, then its destruction.

    Call it after the DDP engine is gone (its reducer holds the group). The barrier lets gloo's worker thread
    finish and free the work of earlier collectives first: freeing a tensor that Python created needs the GIL,
    and destroying the group joins that thread while holding it (a deadlock at exit otherwise). A rank that
    fails skips this: it cannot wait for ranks still training (see :func:`exit_failed`).
    """
    if dist.is_initialized():
        gc.collect()  # an engine kept alive only by a reference cycle goes now, while the group is registered
        dist.barrier()
        dist.destroy_process_group()


def exit_failed(status: int) -> None:
    """Ends a failed rank of a multi-process run at once (no interpreter shutdown, whose destruction of the
    process group can wait forever on the other ranks or on gloo's worker thread), so that torchrun sees the
    failure and ends the other ranks. Without a process group it returns and the caller exits normally."""
    if dist.is_initialized():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


class LossModule(nn.Module):
    """A model and its loss function as one module: ``forward(batch, labels, num_items)`` returns the loss.

    It is what DDP wraps, so a loss that applies the head itself still runs inside DDP's forward.
    """

    def __init__(self, model: nn.Module, loss_fn: LossFn) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, batch: Batch, labels: torch.Tensor, num_items: int) -> torch.Tensor:
        return self.loss_fn(self.model, batch, labels, num_items)


def fp32_sum_hook(_state, bucket):  # unannotated: DDP rejects the string annotations of postponed evaluation
    """DDP communication hook: all-reduces a bucket (``dist.GradBucket``) of gradients as an FP32 sum (bf16 / fp16
    LoRA gradients are summed in FP32 and rounded once) instead of DDP's average in the gradients' own dtype, and
    returns a future of the bucket's tensor. The loss is already normalised by the window's tokens over all
    ranks, so the sum is the window's gradient."""
    grads = bucket.buffer()
    total = grads.float() if grads.dtype != torch.float32 else grads
    future = dist.all_reduce(total, async_op=True).get_future()

    def written_back(done: torch.futures.Future) -> torch.Tensor:
        return grads.copy_(done.value()[0]) if total is not grads else grads

    return future.then(written_back)


def wrap(model: nn.Module, loss_fn: LossFn, launch: Launch, device: torch.device) -> nn.Module:
    """The module the loop calls for a loss: a :class:`LossModule`, inside DDP for a distributed launch.

    Frozen parameters and all buffers are excluded from DDP's broadcast and reduction; the trainable
    (LoRA) parameters are bucketed and summed over ranks in FP32 (:func:`fp32_sum_hook`).
    """
    engine = LossModule(model, loss_fn)
    if not launch.distributed:
        return engine
    frozen = [name for name, p in engine.named_parameters() if not p.requires_grad]
    buffers = [name for name, _ in engine.named_buffers()]
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(engine, frozen + buffers)
    ids = [device.index] if device.type == "cuda" else None
    ddp = DistributedDataParallel(engine, device_ids=ids)
    ddp.register_comm_hook(None, fp32_sum_hook)
    return ddp
