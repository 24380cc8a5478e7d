"""``train`` and ``validate``: a whole fine-tuning job from a :class:`RunConfig`.

A run goes through its phases in an order that never loses a user's work:

1. plan the output directory (read-only: fresh, resume or replace; :mod:`loralei.train.output_dir`);
2. build everything that can fail on bad input: the data, the model with LoRA, the optimizer and its schedule,
   and the checks of a checkpoint to resume (:mod:`loralei.train.setup`);
3. claim the output directory (only now does anything there change) and train, stopping cleanly on SIGINT or
   SIGTERM (:mod:`loralei.train.interrupt`);
4. save the adapters and the summary. A run this one replaces is deleted once this run has written a scheduled
   checkpoint or finished; a run that fails before either leaves the directory as it found it.
"""

from __future__ import annotations

import dataclasses
import signal
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ..checkpoint import save_pretrained
from ..errors import ConfigError, TrainingError
from ..inject import count_parameters
from ..merge import merge_and_unload_lora
from . import build, build_data, determinism, distributed, launch, output_dir, shared_prompt
from .checkpointing import offload_summary
from .fast_path import pads_batches, resolve_attention, resolve_cuda_graphs, resolve_liger, resolve_loss
from .graphs import GraphedSteps
from .interrupt import RunInterrupted, StopSignals
from .layer_offload import layer_streamer
from .loop import (
    StepCallback,
    long_lived_objects_frozen,
    micro_step,
    train_loop,
    trainable_parameters,
)
from .metrics import MetricsLogger, cuda_memory_gib, host_peak_gib, setup_memory_gib
from .preference.checks import cpo_loss_type, kto_loss_type, loss_types
from .qat_start import QATStart
from .result import Phases, RunResult, write_result
from .schema import PreferenceSection, RunConfig
from .setup import (
    Inputs,
    Parts,
    build_parts,
    check_fsdp2,
    identity,
    make_evaluator,
    make_stream,
    setup_training,
    split_sequences,
    total_steps,
)
from .state import RunIdentity, Trainables, TrainState, check_compatible, load_checkpoint, rng_state
from .state import save_checkpoint as write_checkpoint


def train(
    cfg: RunConfig,
    *,
    model: torch.nn.Module | None = None,
    tokenizer: Any = None,
    dataset: Any = None,
    collate_fn: Any = None,
    eval_dataset: Any = None,
    callbacks: Sequence[StepCallback] = (),
) -> RunResult | None:
    """Runs a fine-tuning job: plan the output directory, build, (resume,) train, save adapters, summarise.

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
            holds a run this config may not replace.
        CheckpointError: the checkpoint to resume from is missing, corrupt, or does not fit.
        TrainingError: the loss stayed non-finite.
        RunInterrupted: SIGINT or SIGTERM stopped the run (after saving a checkpoint when training had begun).
    """
    phases = Phases()
    # the config as the user wrote it (before the auto settings are resolved): what resume_from_checkpoint: auto
    # compares with a checkpoint's
    run_config = cfg.model_dump(mode="json")
    plan = output_dir.plan_output_dir(cfg)  # read-only; every rank plans before the main process claims
    run_launch = launch.read_launch(cfg.training.distributed)
    run_device = launch.device_for(run_launch)
    cfg, choices = resolve_liger(cfg, run_device)
    cfg, attention = resolve_attention(cfg, run_device, own_model=model is not None)
    choices += attention
    build.check_optional_dependencies(cfg)
    choices += determinism.check(cfg.training.deterministic)
    owns_group = run_launch.distributed and not torch.distributed.is_initialized()
    device = launch.start(run_launch)
    if not distributed.is_main_process():
        launch.quiet_progress_bars()
    if (threads := launch.use_cpu_threads(device)) is not None:
        choices.append(threads)
    inputs = Inputs(model, tokenizer, dataset, eval_dataset, collate_fn)
    # under torchrun a Ctrl-C reaches the ranks twice (torchrun passes on what it receives)
    with (
        StopSignals(repeats_ignored=launch.under_launcher()) as signals,
        determinism.deterministic_run(cfg.training.deterministic),
    ):
        # a rank that raises leaves the group alone (launch.stop would wait for the others); the engine is gone
        # when _train returns, before the group is ended
        result = _train(
            cfg, plan, run_launch, device, inputs, _Run(callbacks, choices, signals, phases, run_config)
        )
    if owns_group:
        launch.stop()
    return result


class _Run:
    """What ``_train`` carries besides the config: callbacks, the notes of the auto settings, the signals, the
    phase timer, and the config as the user wrote it."""

    def __init__(
        self,
        callbacks: Sequence[StepCallback],
        choices: list[str],
        signals: StopSignals,
        phases: Phases,
        run_config: dict[str, Any],
    ) -> None:
        self.callbacks, self.choices, self.signals = callbacks, choices, signals
        self.phases, self.run_config = phases, run_config


def _check_launch(cfg: RunConfig, run_launch: launch.Launch) -> None:
    if run_launch.mode == "fsdp2":
        check_fsdp2(cfg)
    if run_launch.mode == "fsdp2" and cfg.training.gradient_checkpointing == "offload":
        raise ConfigError(
            f"training.gradient_checkpointing: offload does not run under FSDP2 ({run_launch.world_size} "
            "processes) yet: its recomputation runs outside the hooks that gather each layer's weights; use "
            "gradient_checkpointing: true, or distributed: ddp"
        )


def _train(
    cfg: RunConfig,
    plan: output_dir.OutputPlan,
    run_launch: launch.Launch,
    device: torch.device,
    inputs: Inputs,
    run: _Run,
) -> RunResult | None:
    _check_launch(cfg, run_launch)
    build.seed_everything(cfg.training.seed)
    with distributed.main_process_first():  # dataset caches and downloads are filled once
        parts = build_parts(cfg, inputs, run.phases, plan.checkpoint)
    parts = split_sequences(cfg, parts)
    cfg, loss_choice = resolve_loss(cfg, parts.model, device)
    cfg, parts, graph_choice = _graphs(
        cfg, parts, device, run_launch, own_batches=inputs.collate_fn is not None
    )
    parts, share_choice = _share_prompt(cfg, parts, own_batches=inputs.collate_fn is not None)
    with run.phases("setup"):
        objs, settings, loss_fn = setup_training(cfg, parts, run_launch, device)
    ident = identity(cfg, parts, run.run_config)
    if plan.checkpoint is not None:  # a checkpoint that does not fit is refused before anything changes
        check_compatible(
            plan.checkpoint, output_dir.read_checkpoint_meta(plan.checkpoint), parts.model, ident
        )
    # The run is sure to start: only now does the output directory change (the main process first).
    with distributed.main_process_first():
        claim, resume_from = output_dir.claim(cfg, plan, main=distributed.is_main_process())
    try:
        notes = [
            *run.choices, *loss_choice, *graph_choice, *share_choice, *([plan.note] if plan.note else []),
            *parts.notes,
        ]  # fmt: skip
        return _run(
            cfg, parts, (objs, settings, loss_fn), ident, (claim, resume_from), notes, run, run_launch
        )
    except BaseException as exc:
        claim.abandon()  # a run that saved nothing leaves the directory as it found it
        if isinstance(exc, OSError):  # a full disk, a lost mount, permissions: said plainly
            raise _write_failed(exc, claim) from exc
        raise


def _graphs(
    cfg: RunConfig, parts: Parts, device: torch.device, run_launch: launch.Launch, own_batches: bool
) -> tuple[RunConfig, Parts, list[str]]:
    """``training.cuda_graphs`` resolved, and the runner's collator padding to the data's widest row where the
    graphs replay batches it would otherwise make of several widths."""
    widest = None if own_batches else _widest_row(parts.dataset, device, run_launch.distributed)
    cfg, choice = resolve_cuda_graphs(
        cfg,
        parts.model,
        device,
        distributed=run_launch.distributed,
        own_batches=own_batches,
        padded_tokens=None if widest is None else build_data.padded_batch_tokens(cfg, parts.dataset, widest),
    )
    if widest is not None and pads_batches(cfg, own_batches):
        parts = dataclasses.replace(parts, collate_fn=build_data.pad_to_width(parts.collate_fn, widest))
    return cfg, parts, choice


def _share_prompt(cfg: RunConfig, parts: Parts, own_batches: bool) -> tuple[Parts, list[str]]:
    """``preference.share_prompt`` resolved: the collator storing each pair's prompt once, and the model's
    attention to match, where it asks for that."""
    collate, choice = shared_prompt.resolve(cfg, parts.model, parts.collate_fn, own_batches)
    return dataclasses.replace(parts, collate_fn=collate), choice


def _widest_row(dataset: Any, device: torch.device, distributed_run: bool) -> int | None:
    """The data's widest row, where graphs could replay the runner's batches (one CUDA process; elsewhere nothing
    reads it, and a KTO dataset's reads every example)."""
    if device.type != "cuda" or distributed_run:
        return None
    return dataset.widest_row()


def _write_failed(exc: OSError, claim: output_dir.Claim) -> TrainingError:
    kept = (
        "its last checkpoint is kept: free space (or fix the path) and rerun the same command to resume"
        if claim.saved
        else "the output directory is as it was before this run"
    )
    return TrainingError(f"{exc.filename or 'a file'}: {exc.strerror or exc}; {kept}")


def _run(
    cfg: RunConfig,
    parts: Parts,
    built: tuple[Trainables, Any, Any],
    ident: RunIdentity,
    claimed: tuple[output_dir.Claim, Path | None],
    notes: list[str],
    run: _Run,
    run_launch: launch.Launch,
) -> RunResult | None:
    (objs, settings, loss_fn), (claim, resume_from) = built, claimed
    out = Path(cfg.output_dir)
    state = TrainState()
    if resume_from is not None:
        state = load_checkpoint(resume_from, objs, ident, rank=distributed.rank())
    callbacks = list(run.callbacks)
    if cfg.lora.qat is not None and cfg.lora.qat.start_step > 0:
        callbacks.append(QATStart(objs.model, cfg.lora.qat.start_step))
        callbacks[-1](state)  # a resumed run continues in the phase it stopped in
    logger = MetricsLogger(
        out,
        settings.total_steps,
        start_step=state.global_step,
        enabled=distributed.is_main_process(),
        wandb_settings=cfg.wandb_settings,
        run_config=cfg.model_dump(mode="json"),
        tensorboard="tensorboard" in cfg.training.report_to,
    )
    if run_launch.distributed:
        name = {"ddp": "DDP", "fsdp2": "FSDP2"}[run_launch.mode]
        notes.append(f"distributed: {name} over {run_launch.world_size} process(es) ({settings.device.type})")
    for note in notes:
        logger.write(note)
    if cfg.training.cuda_graphs:
        # one micro batch per step: each writes the gradients, none adds to another's (loralei.train.graphs)
        writes = cfg.training.gradient_accumulation_steps == 1
        params = trainable_parameters(objs.model) if writes else None
        objs.graphs = GraphedSteps(micro_step(objs.engine), settings.device, logger.write, params)
    saver = _Saver(cfg, objs, ident, claim)
    stream = make_stream(cfg, parts, state, settings.device)
    run_eval = make_evaluator(cfg, parts, objs.engine, settings)
    setup_peak = setup_memory_gib(settings.device)  # the log's peaks are the training steps' from here on
    setup_host = host_peak_gib()
    logger.start_progress()
    run.signals.graceful()
    first_step = state.global_step
    try:
        with run.phases("training"), long_lived_objects_frozen():
            state = train_loop(
                objs,
                stream,
                loss_fn,
                settings,
                state,
                logger,
                saver.scheduled,
                callbacks=callbacks,
                run_eval=run_eval,
                stop_requested=run.signals.stop_requested,
            )
    finally:
        plot_note = logger.close()
    training_peak = cuda_memory_gib().get("peak_allocated_gib") if setup_peak is not None else None
    memory = {"setup": setup_peak, "setup_host": setup_host, "training": training_peak}
    if state.global_step < settings.total_steps:  # stopped by a signal (on this rank or another)
        signum = run.signals.requested or signal.SIGTERM  # SIGTERM: another rank was asked to stop
        if state.global_step == first_step:  # before a step ran: nothing to keep (the claim is abandoned)
            raise RunInterrupted(signum, started=False)
        raise RunInterrupted(signum, True, state.global_step, saver.on_interrupt(state))
    # described before the export: save_merged unloads the adapter from the model
    trained = count_parameters(parts.model).trainable
    adapter = f"r={cfg.lora.r} on {build.adapter_coverage(parts.model)}; {trained:,} trainable parameters"
    if not distributed.is_main_process():
        return None
    with run.phases("saving"):
        saved = _save_final(cfg, parts)
    result_notes = [plot_note] if plot_note else []
    if objs.graphs is not None:
        result_notes.append(objs.graphs.summary())
    if (offloaded := offload_summary(parts.model)) is not None:
        result_notes.append(offloaded)
    data = str(getattr(parts.dataset, "summary", "") or "")
    result = write_result(out, state, saved, run.phases, result_notes, adapter, data, memory, notes)
    claim.progressed()
    return result


class _Saver:
    """Writes the run's checkpoints (every rank calls it) and tells the claim on the output directory."""

    def __init__(self, cfg: RunConfig, objs: Trainables, ident: RunIdentity, claim: output_dir.Claim) -> None:
        self.cfg, self.objs, self.ident, self.claim = cfg, objs, ident, claim
        self.last: tuple[int, Path] | None = None  # (step, directory) of the last checkpoint written

    def _write(self, state: TrainState) -> Path:
        rngs = distributed.gather_to_main(rng_state())
        out, keep = Path(self.cfg.output_dir), self.cfg.training.save_total_limit
        path = write_checkpoint(out, self.objs, state, self.ident, keep=keep, rng_states=rngs)
        self.last = (state.global_step, path)
        return path

    def scheduled(self, state: TrainState) -> None:
        """A ``save_steps`` checkpoint: the run has progressed, and a run it replaces goes."""
        self._write(state)
        self.claim.progressed()

    def on_interrupt(self, state: TrainState) -> Path:
        """The checkpoint of a run stopped by a signal (the one just written when the stop came right after a
        scheduled save). A run this one replaces stays aside: the interrupted run may have been a mistake."""
        if self.last is not None and self.last[0] == state.global_step:
            return self.last[1]
        path = self._write(state)
        self.claim.checkpointed()
        return path


def _save_final(cfg: RunConfig, parts: Parts) -> tuple[Path, Path, Path | None]:
    out = Path(cfg.output_dir)
    adapter = save_pretrained(parts.model, out / output_dir.ADAPTER_DIR)
    peft = save_pretrained(parts.model, out / output_dir.PEFT_DIR, format="peft")
    merged = None
    if cfg.training.save_merged:
        merged = out / output_dir.MERGED_DIR
        merge_and_unload_lora(parts.model).save_pretrained(merged)
        if parts.tokenizer is not None:
            parts.tokenizer.save_pretrained(merged)
    return adapter, peft, merged


def _output_line(cfg: RunConfig) -> str:
    """What the run would do with its output directory, or why it could not use it."""
    try:
        plan = output_dir.plan_output_dir(cfg)
    except ConfigError as exc:
        return f"output: {cfg.output_dir}: cannot be used as configured:\n  " + str(exc).replace("\n", "\n  ")
    return f"output: {cfg.output_dir}" + (f" ({plan.note})" if plan.note else " (a new run)")


def _objective_line(cfg: RunConfig) -> str:
    """The loss of the run: SFT's, or the preference objective and its settings."""
    t = cfg.training
    if t.objective == "sft":
        return f"loss {t.loss}"
    p = cfg.preference or PreferenceSection()
    if t.objective == "orpo":
        return f"objective orpo (beta {p.beta})"
    if t.objective == "kto":
        weights = f"desirable_weight {p.desirable_weight}, undesirable_weight {p.undesirable_weight}"
        loss = kto_loss_type(cfg.preference)
        apo = ", loss_type apo_zero_unpaired" if loss == "apo_zero_unpaired" else ""
        return f"objective kto (beta {p.beta}{apo}, {weights}, reference {p.reference})"
    if t.objective in ("cpo", "simpo"):
        loss = cpo_loss_type(t.objective, p.loss_type)
        gamma = f", simpo_gamma {p.simpo_gamma}" if loss == "simpo" else ""
        alpha = f", AlphaPO alpha {p.alpha}" if p.alpha else ""
        return f"objective {t.objective} (beta {p.beta}, loss_type {loss}{gamma}, cpo_alpha {p.cpo_alpha}{alpha})"
    types = loss_types(p.loss_type)
    weights = [f"{w:g} " for w in p.loss_weights] if p.loss_weights else [""] * len(types)
    loss = " + ".join(f"{w}{name}" for w, name in zip(weights, types, strict=True))
    divergence = f", {p.f_divergence_type}" if p.f_divergence_type != "reverse_kl" else ""
    weighting = f", ld_alpha {p.ld_alpha}" if p.ld_alpha is not None else ""
    weighting += ", WPO weighting" if p.use_weighting else ""
    return f"objective dpo (beta {p.beta}, loss_type {loss}{divergence}{weighting}, reference {p.reference})"


def validate(cfg: RunConfig) -> str:
    """Checks a config end to end without training: packages, model, LoRA targets, data, template, optimizer,
    and what the run would do with its output directory.

    Returns:
        A readable multi-line summary of what training would do.

    Raises:
        ConfigError / DataError / InjectionError: the problems found, explained (independent stages together).
    """
    device = build.default_device()  # the auto settings say what a run on this machine would choose
    cfg, choices = resolve_liger(cfg, device)
    cfg, attention = resolve_attention(cfg, device, own_model=False)
    choices += attention
    build.check_optional_dependencies(cfg)
    choices += determinism.check(cfg.training.deterministic)
    parts = build_parts(cfg, Inputs(), Phases())
    model, dataset = parts.model, parts.dataset
    cfg, loss_choice = resolve_loss(cfg, model, device)
    distributed_run = launch.read_launch(cfg.training.distributed).distributed
    widest = _widest_row(dataset, device, distributed_run)
    cfg, graph_choice = resolve_cuda_graphs(
        cfg, model, device, distributed=distributed_run, own_batches=False,
        padded_tokens=None if widest is None else build_data.padded_batch_tokens(cfg, dataset, widest),
    )  # fmt: skip
    parts, share_choice = _share_prompt(cfg, parts, own_batches=False)
    t = cfg.training
    steps = total_steps(cfg, len(dataset))
    build.build_optimizer(cfg, model, steps)  # its options (betas, kwargs, warm-up vs steps) are checked here
    params = count_parameters(model)
    if (streamer := layer_streamer(model)) is not None:  # weights in host memory count too
        params = params._replace(total=params.total + streamer.away_numel())
    return "\n".join(
        [
            "config OK",
            f"model: {cfg.model.name_or_path} ({cfg.model.dtype}, {cfg.attn_implementation} attention)",
            f"LoRA: r={cfg.lora.r}, alpha={cfg.lora.lora_alpha} on {build.adapter_coverage(model)}; trainable "
            f"{params.trainable:,} of {params.total:,} parameters ({params.percent:.3f}%)",
            *([f"evaluation: {parts.eval_dataset.summary}"] if parts.eval_dataset is not None else []),
            f"training: {steps} steps of {t.batch_size} x {t.gradient_accumulation_steps} sequences "
            f"(max_seq_length {t.max_seq_length}, packing {'on' if t.packing else 'off'}), {_objective_line(cfg)}",
            *(
                [
                    f"sequence parallelism: each sequence split over {t.sequence_parallel_size} ranks under torchrun"
                ]
                if t.sequence_parallel_size > 1
                else []
            ),
            f"optimizer: {cfg.optimizer.name}, lr {cfg.optimizer.lr}, {cfg.optimizer.schedule} schedule",
            _output_line(cfg),
            *choices,
            *loss_choice,
            *graph_choice,
            *share_choice,
            *parts.notes,
        ]
    )
