"""``train`` and ``validate``: a whole fine-tuning job from a :class:`RunConfig`."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..checkpoint import save_pretrained
from ..errors import ConfigError
from ..inject import count_parameters
from ..merge import merge_and_unload_lora
from . import build, distributed
from .distributed import ShardedBatchSampler
from .loop import DataStream, LoopSettings, StepCallback, train_loop
from .losses import build_loss
from .metrics import MetricsLogger, read_log
from .schema import RunConfig
from .state import Trainables, TrainState, load_checkpoint, save_checkpoint


@dataclass
class RunResult:
    """What a finished run produced."""

    output_dir: Path
    adapter_dir: Path
    peft_dir: Path
    merged_dir: Path | None
    steps: int
    skipped_steps: int
    first_loss: float
    last_loss: float
    tokens_per_s: float
    seconds: float
    notes: list[str]

    def summary(self) -> str:
        """A few lines a person can read at the end of a run."""
        lines = [
            f"finished {self.steps} steps in {self.seconds:.1f}s ({self.skipped_steps} skipped)",
            f"loss {self.first_loss:.4f} -> {self.last_loss:.4f}, {self.tokens_per_s:,.0f} tokens/s",
            f"adapter: {self.adapter_dir} (loralei) and {self.peft_dir} (PEFT / vLLM)",
        ]
        if self.merged_dir is not None:
            lines.append(f"merged model: {self.merged_dir}")
        lines += [f"log: {self.output_dir / 'log.jsonl'}", *self.notes]
        return "\n".join(lines)


@dataclass
class _Parts:
    model: nn.Module
    tokenizer: Any
    dataset: Any
    collate_fn: Any
    notes: list[str]


def _build_parts(
    cfg: RunConfig, model: nn.Module | None, tokenizer: Any, dataset: Any, collate_fn: Any
) -> _Parts:
    if tokenizer is None and (model is None or dataset is None):
        tokenizer = build.load_tokenizer(cfg)
    if dataset is None:
        dataset, collate_fn = build.build_data(cfg, tokenizer)
    elif collate_fn is None:
        raise ConfigError("train(): a dataset passed in needs its collate_fn too")
    if model is None:
        model = build.load_model(cfg)
    notes = build.prepare_model(model, cfg, build.default_device())
    return _Parts(model, tokenizer, dataset, collate_fn, [n for n in notes if n])


def _make_stream(cfg: RunConfig, parts: _Parts, state: TrainState) -> DataStream:
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
    workers = {"num_workers": t.dataloader_num_workers, "pin_memory": t.pin_memory}
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


def _result(cfg: RunConfig, state: TrainState, paths: tuple, seconds: float, notes: list[str]) -> RunResult:
    out = Path(cfg.output_dir)
    losses = [r["loss"] for r in read_log(out) if math.isfinite(r.get("loss", math.nan))]
    speeds = [r["tokens_per_s"] for r in read_log(out) if "tokens_per_s" in r]
    result = RunResult(
        output_dir=out,
        adapter_dir=paths[0],
        peft_dir=paths[1],
        merged_dir=paths[2],
        steps=state.global_step,
        skipped_steps=state.skipped_steps,
        first_loss=losses[0] if losses else math.nan,
        last_loss=losses[-1] if losses else math.nan,
        tokens_per_s=sum(speeds) / len(speeds) if speeds else 0.0,
        seconds=seconds,
        notes=notes,
    )
    summary = {k: str(v) if isinstance(v, Path) else v for k, v in result.__dict__.items()}
    (out / build.SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
    return result


def train(
    cfg: RunConfig,
    *,
    model: nn.Module | None = None,
    tokenizer: Any = None,
    dataset: Any = None,
    collate_fn: Any = None,
    callbacks: Sequence[StepCallback] = (),
) -> RunResult:
    """Runs a fine-tuning job: build, (resume,) train, save adapters, summarise.

    Args:
        cfg: the validated config.
        model: a bare base model to use instead of loading ``model.name_or_path``.
        tokenizer: a tokenizer to use instead of loading one.
        dataset: tokenized samples (``input_ids``, ``labels``, optional ``position_ids``) to use instead of
            preparing ``data``; needs ``collate_fn``.
        collate_fn: turns a list of samples into a batch of tensors.
        callbacks: called with the loop state after every optimizer step.

    Returns:
        Where the adapters are and how the run went (``.summary()`` is printable).

    Raises:
        ConfigError: bad settings, missing optional packages, or an output dir that holds another run.
        CheckpointError: the checkpoint to resume from is missing, corrupt, or does not fit.
        TrainingError: the loss stayed non-finite.
    """
    start = time.perf_counter()
    build.check_optional_dependencies(cfg)
    resume_from = build.resolve_resume(cfg)
    build.seed_everything(cfg.training.seed)
    parts = _build_parts(cfg, model, tokenizer, dataset, collate_fn)
    objs, settings, loss_fn = _setup_training(cfg, parts)
    state = load_checkpoint(resume_from, objs, cfg.lora) if resume_from else TrainState()
    logger = MetricsLogger(
        Path(cfg.output_dir),
        settings.total_steps,
        start_step=state.global_step,
        enabled=distributed.is_main_process(),
        wandb_settings=cfg.wandb_settings,
        run_config=cfg.model_dump(mode="json"),
    )
    for note in parts.notes:
        logger.write(note)
    if resume_from is not None:
        logger.write(f"resumed from {resume_from} at step {state.global_step}")

    def save(current: TrainState) -> None:
        if distributed.is_main_process():
            save_checkpoint(Path(cfg.output_dir), objs, current, cfg.lora, keep=cfg.training.save_total_limit)
        distributed.barrier()

    stream = _make_stream(cfg, parts, state)
    try:
        state = train_loop(objs, stream, loss_fn, settings, state, logger, save, callbacks)
    finally:
        plot_note = logger.close()
    paths = _save_final(cfg, parts) if distributed.is_main_process() else (None, None, None)
    notes = [plot_note] if plot_note else []
    return _result(cfg, state, paths, time.perf_counter() - start, notes)


def _setup_training(cfg: RunConfig, parts: _Parts) -> tuple[Trainables, LoopSettings, Any]:
    t = cfg.training
    batches = len(parts.dataset) // (t.batch_size * distributed.world_size())
    steps = build.total_steps(cfg, max(batches, 1))
    optimizer, scheduler = build.build_optimizer(cfg, parts.model, steps)
    device = build.default_device()
    scaler = torch.amp.GradScaler(device.type) if cfg.model.dtype == "float16" else None
    settings = LoopSettings(
        total_steps=steps,
        gradient_accumulation_steps=t.gradient_accumulation_steps,
        max_grad_norm=t.max_grad_norm,
        logging_steps=t.logging_steps,
        save_steps=t.save_steps,
        max_consecutive_skipped_steps=t.max_consecutive_skipped_steps,
        device=device,
    )
    loss_fn = build_loss(t.loss, liger=t.liger_kernel, cce_impl=t.cut_cross_entropy.impl)
    return Trainables(parts.model, optimizer, scheduler, scaler), settings, loss_fn


def validate(cfg: RunConfig) -> str:
    """Checks a config end to end without training: packages, model, LoRA targets, data and template.

    Returns:
        A readable multi-line summary of what training would do.

    Raises:
        ConfigError / DataError / InjectionError: the first problem found, explained.
    """
    build.check_optional_dependencies(cfg)
    tokenizer = build.load_tokenizer(cfg)
    dataset, _ = build.build_data(cfg, tokenizer)
    model = build.load_model(cfg)
    notes = build.prepare_model(model, cfg, torch.device("cpu"))
    t = cfg.training
    batches = len(dataset) // (t.batch_size * distributed.world_size())
    steps = build.total_steps(cfg, max(batches, 1))
    params = count_parameters(model)
    return "\n".join(
        [
            "config OK",
            f"model: {cfg.model.name_or_path} ({cfg.model.dtype}, {cfg.attn_implementation} attention)",
            f"LoRA: r={cfg.lora.r}, alpha={cfg.lora.lora_alpha}; trainable {params.trainable:,} of "
            f"{params.total:,} parameters ({params.percent:.3f}%)",
            str(getattr(dataset, "summary", f"data: {len(dataset)} samples")),
            f"training: {steps} steps of {t.batch_size} x {t.gradient_accumulation_steps} sequences "
            f"(max_seq_length {t.max_seq_length}, packing {'on' if t.packing else 'off'}), loss {t.loss}",
            f"optimizer: {cfg.optimizer.name}, lr {cfg.optimizer.lr}, {cfg.optimizer.schedule} schedule",
            f"output: {cfg.output_dir}",
            *notes,
        ]
    )
