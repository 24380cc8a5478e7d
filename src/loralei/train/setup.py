"""What a run builds before its first step: the data, the model with LoRA, the engine, the optimizer and the
streams of batches. Everything here can fail on bad input, and all of it runs before the output directory is
touched (:mod:`loralei.train.run`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from ..errors import ConfigError, LoraleiError, together
from . import build, build_data, distributed, launch, sequence_parallel
from .distributed import ShardedBatchSampler
from .loop import DataStream, EvenRuns, LoopSettings, evaluate
from .losses import build_loss, count_trainable_tokens
from .result import Phases
from .schema import RunConfig
from .state import RunIdentity, Trainables, TrainState


@dataclass
class Inputs:
    """What a caller of ``train`` passes instead of loading it from the config (None: load it)."""

    model: nn.Module | None = None
    tokenizer: Any = None
    dataset: Any = None
    eval_dataset: Any = None
    collate_fn: Any = None


@dataclass
class Parts:
    """The run's model (LoRA injected, fused, checkpointed as configured), tokenizer and data."""

    model: nn.Module
    tokenizer: Any
    dataset: Any
    eval_dataset: Any
    collate_fn: Any
    notes: list[str]


def _data(cfg: RunConfig, inputs: Inputs) -> tuple[Any, Any, Any, Any]:
    """(tokenizer, dataset, evaluation set, collate function), from the inputs or the config."""
    tokenizer = inputs.tokenizer
    if tokenizer is None and (inputs.model is None or inputs.dataset is None):
        tokenizer = build.load_tokenizer(cfg)
    if inputs.dataset is None:
        return (tokenizer, *build_data.build_data(cfg, tokenizer))
    if inputs.collate_fn is None:
        raise ConfigError("train(): a dataset passed in needs its collate_fn too")
    return tokenizer, inputs.dataset, inputs.eval_dataset, inputs.collate_fn


def _model(cfg: RunConfig, inputs: Inputs, resume: Path | None) -> tuple[nn.Module, list[str]]:
    if inputs.model is not None and cfg.model.config_overrides:
        raise ConfigError(
            "model.config_overrides: the model passed to train() is built already, and its rotary tables with "
            "it; build it from the overridden config yourself, or let the runner load model.name_or_path"
        )
    device = build.default_device()
    if inputs.model is not None and (config := getattr(inputs.model, "config", None)) is not None:
        build.check_config_fits(cfg, config, inputs.model.dtype, device)
    model, how = (inputs.model, None) if inputs.model is not None else build.load_model(cfg, device)
    notes = [how, *build.prepare_model(model, cfg, device, resume)]
    return model, [n for n in notes if n]


def build_parts(cfg: RunConfig, inputs: Inputs, phases: Phases, resume: Path | None = None) -> Parts:
    """Prepares the data, then loads the model and injects LoRA (from ``resume``'s PiSSA/OLoRA factors, when
    the run continues from that checkpoint). The two stages are independent: a problem in the data does not hide
    one in the model, and both are reported together.

    Raises:
        LoraleiError: every problem found (a ``ConfigError`` listing them when there are several).
    """
    problems: list[LoraleiError] = []
    data = None
    with phases("data"):
        try:
            data = _data(cfg, inputs)
        except LoraleiError as exc:
            problems.append(exc)
    with phases("model"):
        try:
            model, notes = _model(cfg, inputs, resume)
        except LoraleiError as exc:
            problems.append(exc)
    if problems:
        raise together(problems)
    tokenizer, dataset, eval_dataset, collate_fn = data
    summaries = [str(s) for s in (getattr(dataset, "summary", None),) if s is not None]
    return Parts(model, tokenizer, dataset, eval_dataset, collate_fn, [*summaries, *notes])


def split_sequences(cfg: RunConfig, parts: Parts) -> Parts:
    """``parts`` with each sequence split over ``training.sequence_parallel_size`` ranks: the model's attention
    exchanging heads, the batches cut into this rank's shard (unchanged for one rank per sequence). Every rank
    calls it at the same point (it makes the process groups).

    Raises:
        ConfigError: the processes or the model's heads do not divide into the groups, or its attention does
            not fit (:func:`loralei.train.sequence_parallel.refusal`).
    """
    if (size := cfg.training.sequence_parallel_size) == 1:
        return parts
    group = sequence_parallel.new_group(size)
    note = sequence_parallel.enable(parts.model, group, packed=cfg.training.packing)
    collate_fn = sequence_parallel.sharding_collate(parts.collate_fn, group)
    return dataclasses.replace(parts, collate_fn=collate_fn, notes=[*parts.notes, note])


def data_ranks(cfg: RunConfig) -> tuple[int, int]:
    """This process's rank among the processes that draw different batches, and their number: every process,
    or one per sequence-parallel group."""
    return sequence_parallel.data_rank(cfg.training.sequence_parallel_size)


def identity(cfg: RunConfig, parts: Parts, run_config: dict[str, Any]) -> RunIdentity:
    """What a checkpoint of this run records to be resumed: the adapter, the data layout, the user's config."""
    layout = {
        "data.num_samples": len(parts.dataset),
        "training.batch_size": cfg.training.batch_size,
        "training.seed": cfg.training.seed,
        "world_size": distributed.world_size(),
    }
    return RunIdentity(cfg.lora, layout, run_config)


def pin_memory(setting: bool | str, device: torch.device) -> bool:
    """``training.pin_memory``: ``auto`` pins the host batches when training on CUDA. From pageable memory a
    copy to the device is synchronous for the host (the driver stages it through a pinned buffer of its own);
    from pinned memory it is a transfer queued on the stream, and the host goes on issuing the step (or
    replaying its graph)."""
    return device.type == "cuda" if setting == "auto" else bool(setting)


def _sampler(cfg: RunConfig, parts: Parts) -> ShardedBatchSampler:
    """This rank's batches of the training set.

    Raises:
        ConfigError: the dataset holds less than one global batch.
    """
    t = cfg.training
    rank, ranks = data_ranks(cfg)
    sampler = ShardedBatchSampler(len(parts.dataset), t.batch_size, seed=t.seed, rank=rank, world_size=ranks)
    if len(sampler) == 0:
        raise ConfigError(
            f"training.batch_size: the dataset has {len(parts.dataset)} samples, fewer than one batch of "
            f"{t.batch_size} x {ranks} data-parallel process(es); lower batch_size or add data"
        )
    return sampler


def make_stream(cfg: RunConfig, parts: Parts, state: TrainState, device: torch.device) -> DataStream:
    """The training batches of this rank, from the data position of ``state``.

    Raises:
        ConfigError: the dataset holds less than one global batch.
    """
    t, sampler = cfg.training, _sampler(cfg, parts)
    workers = {"num_workers": t.dataloader_num_workers, "pin_memory": pin_memory(t.pin_memory, device)}
    return DataStream(
        parts.dataset,
        parts.collate_fn,
        sampler,
        epoch=state.epoch,
        batch_in_epoch=state.batch_in_epoch,
        **workers,
    )


def make_evaluator(cfg: RunConfig, parts: Parts, engine: nn.Module, settings: LoopSettings) -> Any:
    """A function returning the evaluation loss, or None without an evaluation set."""
    if parts.eval_dataset is None:
        return None
    t = cfg.training
    rank, ranks = data_ranks(cfg)
    sampler = ShardedBatchSampler(
        len(parts.eval_dataset),
        t.eval_batch_size or t.batch_size,
        shuffle=False,
        rank=rank,
        world_size=ranks,
        drop_last=False,
    )
    loader = DataLoader(
        parts.eval_dataset, batch_sampler=sampler, collate_fn=parts.collate_fn, generator=torch.Generator()
    )
    even = EvenRuns(len(sampler), lambda: parts.collate_fn([parts.eval_dataset[0]]))
    # through the engine: under FSDP2 only its forward gathers the sharded weights
    return lambda: evaluate(
        parts.model,
        loader,
        lambda _model, *args: engine(*args),
        settings.device,
        settings.vocab_size,
        settings.count_items,
        even,
    )


def total_steps(cfg: RunConfig, num_samples: int) -> int:
    """Optimizer steps of the run, with an epoch of the sampler's full global batches (at least one)."""
    batches = num_samples // (cfg.training.batch_size * data_ranks(cfg)[1])
    return build.total_steps(cfg, max(batches, 1))


def _vocab_size(model: nn.Module) -> int | None:
    """The rows of the input embedding: the token ids the model can take (None where it has no such table)."""
    return getattr(model.get_input_embeddings(), "num_embeddings", None)


def _objective(cfg: RunConfig, parts: Parts, device: torch.device) -> tuple[Any, Any, Any]:
    """(loss function, what it averages over, its metrics) of ``training.objective``."""
    t = cfg.training
    if t.objective == "sft":
        loss_fn = build_loss(t.loss, liger=t.liger_kernel, cce_impl=t.cut_cross_entropy.impl)
        return loss_fn, count_trainable_tokens, None
    from .preference.setup import build_objective

    return build_objective(cfg, parts.model, parts.dataset, parts.collate_fn, device)


def setup_training(
    cfg: RunConfig, parts: Parts, run_launch: launch.Launch, device: torch.device
) -> tuple[Trainables, LoopSettings, Any]:
    """The loss, the engine (the model and loss in DDP or FSDP2 for a distributed launch), and then the
    optimizer: FSDP2 replaces the parameters with sharded ones, which are what the optimizer must hold.

    Raises:
        ConfigError: the dataset holds less than one global batch, or the optimizer's settings do not fit.
    """
    _sampler(cfg, parts)  # checked with the rest, before anything changes
    t = cfg.training
    loss_fn, count_items, metrics = _objective(cfg, parts, device)
    engine = launch.wrap(parts.model, loss_fn, run_launch, device)
    steps = total_steps(cfg, len(parts.dataset))
    optimizer, scheduler = build.build_optimizer(cfg, parts.model, steps)
    scaler = torch.amp.GradScaler(device.type) if cfg.model.dtype == "float16" else None
    settings = LoopSettings(
        total_steps=steps,
        gradient_accumulation_steps=t.gradient_accumulation_steps,
        max_grad_norm=t.max_grad_norm,
        logging_steps=t.logging_steps,
        save_steps=t.save_steps,
        eval_steps=t.eval_steps,
        max_consecutive_skipped_steps=t.max_consecutive_skipped_steps,
        device=device,
        vocab_size=_vocab_size(parts.model),
        count_items=count_items,
        objective_metrics=metrics,
    )
    return Trainables(parts.model, optimizer, scheduler, scaler, engine), settings, loss_fn


def check_fsdp2(cfg: RunConfig) -> None:
    """What FSDP2 runs cannot do yet: a merged export (merging needs the whole base weights on one rank), and
    int4 or FP8 bases (int4 is tile-packed for one GPU's kernel; sharding FP8 codes with their per-row scales is
    untested; only NF4 is known to shard)."""
    if cfg.lora.quantize_base and cfg.lora.quantization_type != "nf4":
        raise ConfigError(
            f"lora.quantization_type: {cfg.lora.quantization_type!r} bases are not supported with distributed: "
            "fsdp2 (their packed layout is not known to shard); use quantization_type: nf4, or distributed: ddp"
        )
    if cfg.training.save_merged:
        raise ConfigError(
            "training.save_merged: true is not supported with distributed: fsdp2 yet (merging needs the whole "
            "base weights on one process); merge the saved adapter afterwards (loralei.merge_and_unload_lora) or "
            "use distributed: ddp"
        )
