"""Multi-process launch: read torchrun's environment, start the process group, wrap the model for DDP.

``torchrun --nproc_per_node N -m loralei.cli config.yaml`` (or ``accelerate launch``, which sets the same
variables) starts N processes with ``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``, ``MASTER_ADDR`` and
``MASTER_PORT``. ``training.distributed: auto`` trains with DDP when ``WORLD_SIZE > 1`` and in one process
otherwise; ``ddp`` and ``fsdp2`` ask for one explicitly (also with one process under torchrun). NCCL serves
CUDA, gloo the CPU.

FSDP2 (``torch.distributed.fsdp.fully_shard``) shards the frozen base: every decoder layer
(``compile.decoder_layers``, the rule ``torch_compile`` uses) and the input embedding (when the output head does
not share its weight), each gathered for its forward and backward; the weights keep their dtype. The root
(:class:`LossModule`) shards nothing: the output head and final norm, in use from the loss to the end of the
backward, stay whole on every rank. So do the LoRA factors, a small fraction of the model (``ignored_params``):
FSDP2 gathers and reduce-scatters nothing for them, and :meth:`LossModule.reduce_gradients` sums their gradients
over the ranks in FP32 once per accumulation window. The fused LoRA kernels run inside each layer's forward, on
the base weights FSDP2 has just gathered. Each unit's forward starts the gather of the next one
(``FORWARD_PREFETCH``), so it runs while the GPU computes this one; the backward prefetches its next unit by
default.

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
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from ..errors import ConfigError
from .compile import decoder_layers
from .losses import Batch, Count, LossFn

TORCHRUN_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
# A collective that waits this long means a rank is gone; torchrun ends the job sooner when a rank exits.
_TIMEOUT = datetime.timedelta(minutes=30)
# Gradient elements summed per all-reduce under FSDP2 (a 128 MiB FP32 buffer at most).
_BUCKET_ELEMENTS = 1 << 25
# FSDP2 units whose gathers a unit starts as its forward begins (see _shard).
FORWARD_PREFETCH = 1


@dataclass(frozen=True)
class Launch:
    """How this process was started: its mode ("none", "ddp" or "fsdp2"), rank, local rank, world size."""

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
        mode: "auto", "none", "ddp" or "fsdp2".
        env: the process environment.

    Returns:
        The launch; ``mode`` "none" means one process without a process group.

    Raises:
        ConfigError: a partial torchrun environment, or a mode that needs a launcher and has none (or the
            reverse: several processes with ``distributed: none``).
    """
    present = [k for k in TORCHRUN_VARIABLES if k in env]
    if not present:
        if mode in ("ddp", "fsdp2"):
            raise ConfigError(
                f"training.distributed: {mode} needs processes started by torchrun (no RANK / WORLD_SIZE in the "
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
    return Launch("ddp" if mode == "auto" else mode, rank, local, world)


def under_launcher(env: Mapping[str, str] = os.environ) -> bool:
    """Whether torchrun (or a launcher built on it) started this process: it passes every signal it receives on
    to its processes, so a Ctrl-C in the terminal reaches them twice."""
    return "LOCAL_RANK" in env or "TORCHELASTIC_RUN_ID" in env


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


def local_processes(env: Mapping[str, str] = os.environ) -> int:
    """How many processes torchrun started on this machine (``LOCAL_WORLD_SIZE``; 1 outside torchrun)."""
    return max(1, int(env.get("LOCAL_WORLD_SIZE", "1") or 1))


def cpu_threads(env: Mapping[str, str] = os.environ) -> tuple[int, str]:
    """The intra-op thread count for a CPU run, and where it comes from: ``OMP_NUM_THREADS`` when set (torchrun
    sets 1 for several processes), else the cores this process may run on shared by the processes torchrun
    started on this machine (``LOCAL_WORLD_SIZE``). torch's own default, every core of the machine, makes
    processes that share the cores (two trainings at once, or torchrun's ranks) wait on each other's threads."""
    if env.get("OMP_NUM_THREADS", "").strip():
        try:
            return max(1, int(env["OMP_NUM_THREADS"])), "OMP_NUM_THREADS"
        except ValueError:
            raise ConfigError(
                f"OMP_NUM_THREADS={env['OMP_NUM_THREADS']!r} is not a whole number; set it to the threads each "
                "training process may use (e.g. 4), or unset it"
            ) from None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    local = local_processes(env)
    return max(1, cores // local), f"{cores} cores available / {local} process(es) on this machine"


def use_cpu_threads(device: torch.device) -> str | None:
    """Sets the intra-op thread count of a CPU run (see :func:`cpu_threads`); returns the note saying so, or
    None on an accelerator (its host threads stay as torch sets them)."""
    if device.type != "cpu":
        return None
    threads, source = cpu_threads()
    torch.set_num_threads(threads)
    return f"CPU: {threads} intra-op thread(s) ({source}; set OMP_NUM_THREADS to choose)"


def quiet_progress_bars() -> None:
    """Turns off the progress bars of loralei's data pipeline, Transformers, ``datasets`` and the hub client in
    this process: on ranks other than the main one, which would each draw their own over the main process's."""
    import datasets
    import huggingface_hub.utils
    from transformers.utils import logging as transformers_logging

    from .data import progress

    progress.hide()
    transformers_logging.disable_progress_bar()
    datasets.disable_progress_bars()
    huggingface_hub.utils.disable_progress_bars()


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

    It is what DDP wraps and FSDP2's root, so a loss that applies the head itself still runs inside their
    forward.
    """

    def __init__(self, model: nn.Module, loss_fn: LossFn) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn
        # FSDP2: the trainable parameters, replicated on every rank, whose gradients reduce_gradients sums
        self.replicated: list[nn.Parameter] = []

    def forward(self, batch: Batch, labels: torch.Tensor, num_items: Count) -> torch.Tensor:
        return self.loss_fn(self.model, batch, labels, num_items)

    def reduce_gradients(self) -> None:
        """After the window's last backward under FSDP2: sums the replicated parameters' gradients over the ranks
        in FP32 (bf16 / fp16 gradients are rounded once, after the sum), in buckets of at most
        ``_BUCKET_ELEMENTS``. A gradient that is missing on a rank counts as zeros, so every rank reduces the
        same buckets. A no-op otherwise (DDP reduces in its backward hooks; one process has nothing to sum)."""
        grads = []
        for param in self.replicated:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            grads.append(param.grad)
        start = 0
        while start < len(grads):
            end, size = start + 1, grads[start].numel()
            while end < len(grads) and size + grads[end].numel() <= _BUCKET_ELEMENTS:
                size += grads[end].numel()
                end += 1
            bucket = grads[start:end]
            total = torch.cat([g.reshape(-1).float() for g in bucket])
            dist.all_reduce(total)
            for grad, part in zip(bucket, total.split([g.numel() for g in bucket]), strict=True):
                grad.copy_(part.view_as(grad))
            start = end


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
    """The module the loop calls for a loss: a :class:`LossModule`, inside DDP or sharded by FSDP2 (mode
    "fsdp2", see :func:`_shard`) for a distributed launch.

    Under DDP, frozen parameters and all buffers are excluded from the broadcast and the reduction; the
    trainable (LoRA) parameters are bucketed and summed over ranks in FP32 (:func:`fp32_sum_hook`).
    """
    engine = LossModule(model, loss_fn)
    if not launch.distributed:
        return engine
    if launch.mode == "fsdp2":
        return _shard(engine)
    frozen = [name for name, p in engine.named_parameters() if not p.requires_grad]
    buffers = [name for name, _ in engine.named_buffers()]
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(engine, frozen + buffers)
    ids = [device.index] if device.type == "cuda" else None
    ddp = DistributedDataParallel(engine, device_ids=ids)
    ddp.register_comm_hook(None, fp32_sum_hook)
    return ddp


def _shard(engine: LossModule) -> nn.Module:
    """FSDP2 over the frozen base: every decoder layer and the input embedding (unless the output head shares
    its weight), then the root, which shards none of its own weights. The trainable (LoRA) parameters stay whole
    on every rank (see :meth:`LossModule.reduce_gradients`)."""
    layers = decoder_layers(engine.model)
    if layers is None:
        raise ConfigError(
            f"training.distributed: fsdp2 shards the model's decoder layers, but {type(engine.model).__name__} "
            "has no list of config.num_hidden_layers blocks; use distributed: ddp"
        )
    trainable = [p for p in engine.parameters() if p.requires_grad]
    units = list(layers)
    embedding, head = engine.model.get_input_embeddings(), engine.model.get_output_embeddings()
    if embedding is not None and (head is None or head.weight is not embedding.weight):
        units.insert(0, embedding)
    for unit in units:
        fully_shard(unit, ignored_params=set(trainable))
    # Without an explicit prefetch, FSDP2 issues a unit's gather when the host reaches that unit's forward: the
    # fused step's host is barely ahead of the GPU, so each gather would run in the open instead of under the
    # previous unit's compute.
    for i, unit in enumerate(units):
        unit.set_modules_to_forward_prefetch(units[i + 1 : i + 1 + FORWARD_PREFETCH])
    # The root's own weights (the output head, the final norm) are in use from the loss to the end of the
    # backward: FSDP2 would hold a shard and a gathered copy of them all that time. They stay whole instead.
    sharded = {id(p) for unit in units for p in unit.parameters()}
    fully_shard(engine, ignored_params={p for p in engine.parameters() if id(p) not in sharded})
    engine.replicated = trainable
    return engine
