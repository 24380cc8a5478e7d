"""``train`` and ``validate``: a whole fine-tuning job from a :class:`RunConfig`."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from ..checkpoint import save_pretrained
from ..errors import ConfigError
from ..inject import count_parameters
from ..merge import merge_and_unload_lora
from . import build, distributed, launch
from .distributed import ShardedBatchSampler
from .fast_path import resolve_cuda_graphs, resolve_liger, resolve_loss
from .graphs import GraphedSteps
from .loop import (
    DataStream,
    LoopSettings,
    StepCallback,
    evaluate,
    long_lived_objects_frozen,
    micro_step,
    train_loop,
    trainable_parameters,
)
from .losses import build_loss
from .metrics import MetricsLogger
from .result import RunResult, write_result
from .schema import RunConfig
from .state import RunIdentity, Trainables, TrainState, load_checkpoint, rng_state, save_checkpoint


@dataclass
class _Parts:
    model: nn.Module
    tokenizer: Any
    dataset: Any
    eval_dataset: Any
    collate_fn: Any
    notes: list[str]


def _build_parts(cfg: RunConfig, model: nn.Module | None, tokenizer: Any, data: dict[str, Any]) -> _Parts:
    if tokenizer is None and (model is None or data["dataset"] is None):
        tokenizer = build.load_tokenizer(cfg)
    dataset, eval_dataset, collate_fn = data["dataset"], data["eval_dataset"], data["collate_fn"]
    if dataset is None:
        dataset, eval_dataset, collate_fn = build.build_data(cfg, tokenizer)
    elif collate_fn is None:
        raise ConfigError("train(): a dataset passed in needs its collate_fn too")
    if model is None:
        model = build.load_model(cfg)
    notes = build.prepare_model(model, cfg, build.default_device())
    return _Parts(model, tokenizer, dataset, eval_dataset, collate_fn, [n for n in notes if n])


def _identity(cfg: RunConfig, parts: _Parts) -> RunIdentity:
    layout = {
        "data.num_samples": len(parts.dataset),
        "training.batch_size": cfg.training.batch_size,
        "training.seed": cfg.training.seed,
        "world_size": distributed.world_size(),
    }
    return RunIdentity(cfg.lora, layout)


def _make_evaluator(cfg: RunConfig, parts: _Parts, engine: nn.Module, settings: LoopSettings) -> Any:
    if parts.eval_dataset is None:
        return None
    t = cfg.training
    sampler = ShardedBatchSampler(
        len(parts.eval_dataset),
        t.eval_batch_size or t.batch_size,
        shuffle=False,
        rank=distributed.rank(),
        world_size=distributed.world_size(),
        drop_last=False,
    )
    loader = DataLoader(
        parts.eval_dataset, batch_sampler=sampler, collate_fn=parts.collate_fn, generator=torch.Generator()
    )
    # through the engine: under FSDP2 only its forward gathers the sharded weights
    return lambda: evaluate(
        parts.model, loader, lambda _model, *args: engine(*args), settings.device, settings.vocab_size
    )


def _vocab_size(model: nn.Module) -> int | None:
    """The rows of the input embedding: the token ids the model can take (None where it has no such table)."""
    return getattr(model.get_input_embeddings(), "num_embeddings", None)


def pin_memory(setting: bool | str, device: torch.device) -> bool:
    """``training.pin_memory``: ``auto`` pins the host batches when training on CUDA. From pageable memory a
    copy to the device is synchronous for the host (the driver stages it through a pinned buffer of its own);
    from pinned memory it is a transfer queued on the stream, and the host goes on issuing the step (or
    replaying its graph)."""
    return device.type == "cuda" if setting == "auto" else bool(setting)


def _make_stream(cfg: RunConfig, parts: _Parts, state: TrainState, device: torch.device) -> DataStream:
    t = cfg.training
    sampler = ShardedBatchSampler(
        len(parts.dataset),
        t.batch_size,
        seed=t.seed,
        rank=distributed.rank(),
        world_size=distributed.world_size(),
    )
    if len(sampler) == 0:
        raise ConfigError(
            f"training.batch_size: the dataset has {len(parts.dataset)} samples, fewer than one batch of "
            f"{t.batch_size} x {distributed.world_size()} process(es); lower batch_size or add data"
        )
    workers = {"num_workers": t.dataloader_num_workers, "pin_memory": pin_memory(t.pin_memory, device)}
    return DataStream(
        parts.dataset,
        parts.collate_fn,
        sampler,
        epoch=state.epoch,
        batch_in_epoch=state.batch_in_epoch,
        **workers,
    )


def _save_final(cfg: RunConfig, parts: _Parts) -> tuple[Path, Path, Path | None]:
    out = Path(cfg.output_dir)
    adapter = save_pretrained(parts.model, out / build.ADAPTER_DIR)
    peft = save_pretrained(parts.model, out / build.PEFT_DIR, format="peft")
    merged = None
    if cfg.training.save_merged:
        merged = out / build.MERGED_DIR
        merge_and_unload_lora(parts.model).save_pretrained(merged)
        if parts.tokenizer is not None:
            parts.tokenizer.save_pretrained(merged)
    return adapter, peft, merged


def train(
    cfg: RunConfig,
    *,
    model: nn.Module | None = None,
    tokenizer: Any = None,
    dataset: Any = None,
    collate_fn: Any = None,
    eval_dataset: Any = None,
    callbacks: Sequence[StepCallback] = (),
) -> RunResult | None:
    """Runs a fine-tuning job: build, (resume,) train, save adapters, summarise.

    Under torchrun (``training.distributed``, see :mod:`loralei.train.launch`) every process calls this; the
    process group is started here (and ended, when it was started here), the model trains under DDP or FSDP2,
    and the main process alone logs and writes files.

    Args:
        cfg: the validated config.
        model: a bare base model to use instead of loading ``model.name_or_path``.
        tokenizer: a tokenizer to use instead of loading one.
        dataset: tokenized samples (``input_ids``, ``labels``, optional ``position_ids``) to use instead of
            preparing ``data``; needs ``collate_fn``.
        collate_fn: turns a list of samples into a batch of tensors.
        eval_dataset: samples to evaluate on (with ``dataset``) instead of preparing ``data.eval_split``.
        callbacks: called with the loop state after every optimizer step.

    Returns:
        Where the adapters are and how the run went (``.summary()`` is printable); None on processes other
        than the main one, which write nothing.

    Raises:
        ConfigError: bad settings, a misconfigured launch, missing optional packages, or an output dir that
            holds another run.
        CheckpointError: the checkpoint to resume from is missing, corrupt, or does not fit.
        TrainingError: the loss stayed non-finite.
    """
    start = time.perf_counter()
    run_launch = launch.read_launch(cfg.training.distributed)
    cfg, choices = resolve_liger(cfg, launch.device_for(run_launch))
    build.check_optional_dependencies(cfg)
    owns_group = run_launch.distributed and not torch.distributed.is_initialized()
    device = launch.start(run_launch)
    if (threads := launch.use_cpu_threads(device)) is not None:
        choices.append(threads)
    data = {"dataset": dataset, "eval_dataset": eval_dataset, "collate_fn": collate_fn}
    # a rank that raises leaves the group alone (launch.stop would wait for the others); the engine is gone
    # when _train returns, before the group is ended
    result = _train(cfg, run_launch, device, _Inputs(model, tokenizer, data, choices), callbacks, start)
    if owns_group:
        launch.stop()
    return result


@dataclass
class _Inputs:
    model: nn.Module | None
    tokenizer: Any
    data: dict[str, Any]
    choices: list[str]  # what the auto settings chose (the run's first lines)


def _train(
    cfg: RunConfig,
    run_launch: launch.Launch,
    device: torch.device,
    inputs: _Inputs,
    callbacks: Sequence[StepCallback],
    start: float,
) -> RunResult | None:
    if run_launch.mode == "fsdp2":
        _check_fsdp2(cfg)
    if run_launch.distributed and cfg.training.gradient_checkpointing == "offload":
        raise ConfigError(
            f"training.gradient_checkpointing: offload does not run with {run_launch.world_size} processes "
            f"({run_launch.mode}) yet; use gradient_checkpointing: true"
        )
    # the main process claims the output dir (clearing it with overwrite_output_dir) before any rank reads it
    with distributed.main_process_first():
        resume_from = build.resolve_resume(cfg, claim=distributed.is_main_process())
    build.seed_everything(cfg.training.seed)
    with distributed.main_process_first():  # dataset caches and downloads are filled once
        parts = _build_parts(cfg, inputs.model, inputs.tokenizer, inputs.data)
    cfg, loss_choice = resolve_loss(cfg, parts.model, device)
    own_batches = inputs.data["collate_fn"] is not None
    cfg, graph_choice = resolve_cuda_graphs(
        cfg, parts.model, device, distributed=run_launch.distributed, own_batches=own_batches
    )
    objs, settings, loss_fn = _setup_training(cfg, parts, run_launch, device)
    identity, out = _identity(cfg, parts), Path(cfg.output_dir)
    state = TrainState()
    if resume_from:
        state = load_checkpoint(resume_from, objs, identity, rank=distributed.rank())
    logger = MetricsLogger(
        out,
        settings.total_steps,
        start_step=state.global_step,
        enabled=distributed.is_main_process(),
        wandb_settings=cfg.wandb_settings,
        run_config=cfg.model_dump(mode="json"),
        tensorboard="tensorboard" in cfg.training.report_to,
    )
    parts.notes[:0] = [*inputs.choices, *loss_choice, *graph_choice]
    if run_launch.distributed:
        name = {"ddp": "DDP", "fsdp2": "FSDP2"}[run_launch.mode]
        parts.notes.append(f"distributed: {name} over {run_launch.world_size} process(es) ({device.type})")
    if resume_from is not None:
        parts.notes.append(f"resumed from {resume_from} at step {state.global_step}")
    for note in parts.notes:
        logger.write(note)
    if cfg.training.cuda_graphs:
        # one micro batch per step: each writes the gradients, none adds to another's (loralei.train.graphs)
        writes = cfg.training.gradient_accumulation_steps == 1
        params = trainable_parameters(objs.model) if writes else None
        objs.graphs = GraphedSteps(micro_step(objs.engine), device, logger.write, params)

    def save(current: TrainState) -> None:
        rngs = distributed.gather_to_main(rng_state())
        save_checkpoint(out, objs, current, identity, keep=cfg.training.save_total_limit, rng_states=rngs)

    stream = _make_stream(cfg, parts, state, settings.device)
    run_eval = _make_evaluator(cfg, parts, objs.engine, settings)
    try:
        with long_lived_objects_frozen():
            state = train_loop(objs, stream, loss_fn, settings, state, logger, save, callbacks, run_eval)
    finally:
        plot_note = logger.close()
    # described before the export: save_merged unloads the adapter from the model
    trained = count_parameters(parts.model).trainable
    adapter = f"r={cfg.lora.r} on {build.adapter_coverage(parts.model)}; {trained:,} trainable parameters"
    if not distributed.is_main_process():
        return None
    saved = _save_final(cfg, parts)
    notes = [plot_note] if plot_note else []
    if objs.graphs is not None:
        notes.append(objs.graphs.summary())
    return write_result(out, state, saved, time.perf_counter() - start, notes, adapter)


def _check_fsdp2(cfg: RunConfig) -> None:
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


def _total_steps(cfg: RunConfig, num_samples: int) -> int:
    """Optimizer steps of the run, with an epoch of the sampler's full global batches (at least one)."""
    batches = num_samples // (cfg.training.batch_size * distributed.world_size())
    return build.total_steps(cfg, max(batches, 1))


def _setup_training(
    cfg: RunConfig, parts: _Parts, run_launch: launch.Launch, device: torch.device
) -> tuple[Trainables, LoopSettings, Any]:
    """The loss, the engine (the model and loss in DDP or FSDP2 for a distributed launch), and then the
    optimizer: FSDP2 replaces the parameters with sharded ones, which are what the optimizer must hold."""
    t = cfg.training
    loss_fn = build_loss(t.loss, liger=t.liger_kernel, cce_impl=t.cut_cross_entropy.impl)
    engine = launch.wrap(parts.model, loss_fn, run_launch, device)
    steps = _total_steps(cfg, len(parts.dataset))
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
    )
    return Trainables(parts.model, optimizer, scheduler, scaler, engine), settings, loss_fn


def validate(cfg: RunConfig) -> str:
    """Checks a config end to end without training: packages, model, LoRA targets, data, template, optimizer.

    Returns:
        A readable multi-line summary of what training would do.

    Raises:
        ConfigError / DataError / InjectionError: the first problem found, explained.
    """
    device = build.default_device()  # the auto settings say what a run on this machine would choose
    cfg, choices = resolve_liger(cfg, device)
    build.check_optional_dependencies(cfg)
    tokenizer = build.load_tokenizer(cfg)
    dataset, eval_dataset, _ = build.build_data(cfg, tokenizer)
    model = build.load_model(cfg)
    notes = build.prepare_model(model, cfg, torch.device("cpu"))
    cfg, loss_choice = resolve_loss(cfg, model, device)
    distributed_run = launch.read_launch(cfg.training.distributed).distributed
    cfg, graph_choice = resolve_cuda_graphs(
        cfg, model, device, distributed=distributed_run, own_batches=False
    )
    notes = [*choices, *loss_choice, *graph_choice, *notes]
    t = cfg.training
    steps = _total_steps(cfg, len(dataset))
    build.build_optimizer(cfg, model, steps)  # its options (betas, kwargs, warm-up vs steps) are checked here
    params = count_parameters(model)
    return "\n".join(
        [
            "config OK",
            f"model: {cfg.model.name_or_path} ({cfg.model.dtype}, {cfg.attn_implementation} attention)",
            f"LoRA: r={cfg.lora.r}, alpha={cfg.lora.lora_alpha} on {build.adapter_coverage(model)}; trainable "
            f"{params.trainable:,} of {params.total:,} parameters ({params.percent:.3f}%)",
            str(getattr(dataset, "summary", f"data: {len(dataset)} samples")),
            *([f"evaluation: {eval_dataset.summary}"] if eval_dataset is not None else []),
            f"training: {steps} steps of {t.batch_size} x {t.gradient_accumulation_steps} sequences "
            f"(max_seq_length {t.max_seq_length}, packing {'on' if t.packing else 'off'}), loss {t.loss}",
            f"optimizer: {cfg.optimizer.name}, lr {cfg.optimizer.lr}, {cfg.optimizer.schedule} schedule",
            f"output: {cfg.output_dir}",
            *notes,
        ]
    )
