"""The training loop: gradient-accumulation windows, token-normalised loss, clipping, skipping, logging, saving.

One optimizer step = one window of ``gradient_accumulation_steps`` micro batches. The loss of every micro
batch is its token-loss sum divided by the trainable tokens of the whole window (over all ranks), so the
step's gradient is the mean over the window's tokens, whatever the micro-batch split.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import inspect
import math
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch.utils.data import DataLoader, Dataset

from ..errors import TrainingError
from . import distributed
from .data.shared_prompt import SEQUENCE_TOKENS
from .launch import LossModule
from .losses import (
    Batch,
    Count,
    LossFn,
    check_token_ids,
    count_trainable_tokens,
    trainable_labels,
    with_trained_rows,
)
from .metrics import MetricsLogger, cuda_memory_gib
from .state import Trainables, TrainState

StepCallback = Callable[[TrainState], None]


@dataclass(frozen=True)
class LoopSettings:
    """What the loop needs from the config, resolved to plain values."""

    total_steps: int
    gradient_accumulation_steps: int
    max_grad_norm: float | None
    logging_steps: int
    save_steps: int | None
    eval_steps: int | None
    max_consecutive_skipped_steps: int
    device: torch.device
    vocab_size: int | None = None  # token ids are checked against it on the host (None: not checked)
    # what the loss averages over, counted on the host: trainable tokens (SFT), pairs (preference objectives)
    count_items: Callable[[Batch], int] = count_trainable_tokens
    # the objective's own metrics since the last log record (None: it has none)
    objective_metrics: Callable[[], dict[str, float]] | None = None


class DataStream:
    """An endless stream of collated micro batches that knows its position (epoch, batch within epoch).

    Args:
        dataset: indexable samples.
        collate_fn: turns a list of samples into a batch of tensors.
        sampler: a ``ShardedBatchSampler`` (its position is set from this stream's).
        epoch: epoch to start in.
        batch_in_epoch: batches of that epoch already consumed.
        loader_kwargs: extra ``DataLoader`` arguments (``num_workers``, ``pin_memory``).
    """

    def __init__(
        self,
        dataset: Dataset,
        collate_fn: Callable[[list[Any]], Batch],
        sampler: distributed.ShardedBatchSampler,
        *,
        epoch: int = 0,
        batch_in_epoch: int = 0,
        **loader_kwargs: Any,
    ) -> None:
        self.dataset, self.collate_fn, self.sampler = dataset, collate_fn, sampler
        self.epoch, self.batch_in_epoch = epoch, batch_in_epoch
        self.loader_kwargs = loader_kwargs
        self._iter = None

    def _restart(self) -> None:
        self.sampler.set_position(self.epoch, self.batch_in_epoch)
        # A private generator: DataLoader otherwise draws its base seed from the global torch RNG, which
        # would make the training RNG depend on when an epoch (or a resumed run) started.
        loader = DataLoader(
            self.dataset,
            batch_sampler=self.sampler,
            collate_fn=self.collate_fn,
            generator=torch.Generator(),
            **self.loader_kwargs,
        )
        self._iter = iter(loader)

    def next(self) -> Batch:
        """The next micro batch, moving on to the next epoch when this one is exhausted."""
        if self._iter is None:
            self._restart()
        try:
            batch = next(self._iter)
        except StopIteration:
            self.epoch, self.batch_in_epoch = self.epoch + 1, 0
            self._restart()
            batch = next(self._iter)
        self.batch_in_epoch += 1
        return batch


def _input_tokens(batch: Batch) -> int:
    if SEQUENCE_TOKENS in batch:  # pairs whose prompts are stored once: their sequences' tokens
        return int(batch[SEQUENCE_TOKENS])
    mask = batch.get("attention_mask")
    return int(mask.sum()) if mask is not None and mask.dim() == 2 else batch["input_ids"].numel()


class WindowCounts(NamedTuple):
    """A window's items the loss averages over (trainable tokens, or pairs for a preference objective), input
    tokens and trainable tokens over all ranks, and whether any rank was asked to stop."""

    items: int
    tokens: int
    trainable: int
    stop: bool = False


def window_counts(
    window: Sequence[Batch],
    device: torch.device,
    stop: bool = False,
    count_items: Callable[[Batch], int] = count_trainable_tokens,
) -> WindowCounts:
    """Counts the window on the host, where the batches are, and sums the counts and this rank's stop request
    over the process group in one reduction (only a process group pays that round trip): every rank then stops
    at the same step."""
    items = sum(count_items(mb) for mb in window)
    trainable = items if count_items is count_trainable_tokens else sum(map(count_trainable_tokens, window))
    counts = [items, sum(_input_tokens(mb) for mb in window), trainable, int(stop)]
    if distributed.world_size() > 1:
        counts = distributed.all_reduce_sum(torch.tensor(counts, device=device)).tolist()
    return WindowCounts(int(counts[0]), int(counts[1]), int(counts[2]), counts[3] > 0)


def trainable_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters the optimizer steps: those that require a gradient, in the model's order."""
    return [p for p in model.parameters() if p.requires_grad]


def micro_step(engine: torch.nn.Module) -> Callable[[Batch, Count], torch.Tensor]:
    """One micro batch's forward and backward through ``engine`` (what :class:`~loralei.train.graphs.GraphedSteps`
    captures): ``step(batch_on_device, num_items) -> loss``."""

    def step(batch: Batch, num_items: Count) -> torch.Tensor:
        loss = engine(batch, trainable_labels(batch), num_items)
        loss.backward()
        return loss

    return step


def _forward_backward(
    objs: Trainables,
    window: Sequence[Batch],
    loss_fn: LossFn,
    settings: LoopSettings,
    counts: WindowCounts | None = None,
) -> tuple[torch.Tensor, int, int]:
    """Accumulates the window's gradients; returns (window loss, input tokens, trainable tokens), all summed
    over ranks. ``counts`` are the window's (:func:`window_counts`), counted here when not given."""
    device = settings.device
    if settings.vocab_size is not None:
        for micro in window:
            check_token_ids(micro, settings.vocab_size)
    if counts is None:
        counts = window_counts(window, device, count_items=settings.count_items)
    # a device scalar in every path, eager or graphed: the same division, to the last bit (dividing by a Python
    # number multiplies by its reciprocal on CUDA)
    num_items = torch.full((), float(max(counts.items, 1)), dtype=torch.float32, device=device)
    engine = objs.engine if objs.engine is not None else LossModule(objs.model, loss_fn)
    total = torch.zeros((), device=device)
    for i, micro in enumerate(window):
        if objs.graphs is not None:
            total += objs.graphs(micro, num_items).detach().float()
            continue
        batch = {k: v.to(device, non_blocking=True) for k, v in with_trained_rows(micro).items()}
        no_sync = getattr(engine, "no_sync", None)  # DDP: reduce once, after the window's last micro batch
        sync_ctx = no_sync() if no_sync is not None and i < len(window) - 1 else contextlib.nullcontext()
        with sync_ctx:
            # normalised by every rank's tokens: the sum over ranks of the gradients is the window mean
            loss = engine(batch, trainable_labels(batch), num_items)
            (objs.scaler.scale(loss) if objs.scaler is not None else loss).backward()
        total += loss.detach().float()
    reduce = getattr(engine, "reduce_gradients", None)  # FSDP2's replicated LoRA factors (DDP has reduced)
    if reduce is not None:
        reduce()
    # Summed over ranks, every rank sees the same window loss and makes the same skip decision.
    return distributed.all_reduce_sum(total), counts.tokens, counts.trainable


class Verdict:
    """One optimizer step's loss, gradient norm and whether the update was applied, on their way to the host.

    On CUDA the three values are copied into pinned memory behind the step's kernels and an event marks the copy:
    :meth:`read` waits for that copy alone, so the host reads a step's verdict one step later without waiting for
    the device to drain its queue.
    """

    def __init__(self, loss: torch.Tensor, norm: torch.Tensor, applied: torch.Tensor | bool) -> None:
        device = loss.device
        applied_t = torch.as_tensor(applied, device=device)
        values = torch.stack(
            [t.detach().to(device, torch.float32).reshape(()) for t in (loss, norm, applied_t)]
        )
        self._event: torch.cuda.Event | None = None
        if values.is_cuda:
            self._host = torch.empty(3, pin_memory=True)
            self._host.copy_(values, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = values

    def read(self) -> tuple[float, float, bool]:
        """(loss, grad norm, applied)."""
        if self._event is not None:
            self._event.synchronize()
        loss, norm, applied = self._host.tolist()
        return loss, norm, applied == 1.0


def _device_skip(optimizer: torch.optim.Optimizer, takes_loss: bool) -> Callable[[torch.Tensor], Any] | None:
    """How ``optimizer`` skips a step on the device: a context manager factory taking the 0-dim bool "skip" tensor
    (None where only the host can decide). torch's fused AdamW reads ``found_inf`` (as GradScaler sets it);
    SkipStepAdamW (``takes_loss``) skips non-finite steps by itself."""
    if takes_loss:
        return lambda skip: contextlib.nullcontext()
    if isinstance(optimizer, torch.optim.AdamW) and optimizer.defaults.get("fused"):
        return functools.partial(_found_inf, optimizer)
    return None


@contextlib.contextmanager
def _found_inf(optimizer: torch.optim.Optimizer, skip: torch.Tensor) -> Iterator[None]:
    optimizer.found_inf = skip.float()
    try:
        yield
    finally:
        del optimizer.found_inf


def _optimizer_step(
    objs: Trainables, params: list[torch.Tensor], loss: torch.Tensor, max_norm: float | None
) -> Verdict:
    """Clips, then steps unless loss or gradient norm is non-finite, deciding on the device where the optimizer
    can skip there (the host then never waits for the backward). The schedule steps when the verdict is read
    (:func:`_settle`)."""
    if objs.scaler is not None:
        objs.scaler.unscale_(objs.optimizer)
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm is not None else math.inf)
    # SkipStepAdamW takes the loss to detect outliers on the device. Looked up statically: hasattr would
    # run its skipped_steps property, which reads the device counter (a host sync every step).
    takes_loss = inspect.getattr_static(objs.optimizer, "skipped_steps", None) is not None
    kwargs = {"loss": loss} if takes_loss else {}
    device_skip = _device_skip(objs.optimizer, takes_loss) if objs.scaler is None else None
    if device_skip is not None:
        finite = torch.isfinite(loss) & torch.isfinite(norm)
        with device_skip(~finite):
            objs.optimizer.step(**kwargs)
    else:
        finite = math.isfinite(float(loss)) and math.isfinite(float(norm))
        if finite and objs.scaler is not None:
            objs.scaler.step(objs.optimizer, **kwargs)
        elif finite:
            objs.optimizer.step(**kwargs)
        if objs.scaler is not None:
            objs.scaler.update()
    verdict = Verdict(loss, norm, finite)
    if objs.graphs is None:
        objs.optimizer.zero_grad(set_to_none=True)
    elif not objs.graphs.writes_grads:  # replays add into the same .grad tensors
        objs.optimizer.zero_grad(set_to_none=False)
    # else the next micro batch writes the gradients (loralei.train.graphs)
    return verdict


def _record_skip(state: TrainState, stepped: bool, limit: int, loss: float, norm: float) -> None:
    if stepped:
        state.consecutive_skips = 0
        return
    state.skipped_steps += 1
    state.consecutive_skips += 1
    if state.consecutive_skips >= limit:
        raise TrainingError(
            f"step {state.global_step}: loss={loss} / grad norm={norm} was non-finite for {limit} consecutive steps; "
            "stopped without saving this state. Lower optimizer.lr, set training.max_grad_norm, use bfloat16 or "
            "float32, or resume from the last checkpoint (training.max_consecutive_skipped_steps sets the limit)"
        )


@dataclass(frozen=True)
class EvenRuns:
    """What keeps the ranks' evaluation passes in step: FSDP2 gathers each unit's weights in every forward (a
    collective), so a rank that ran fewer forwards would leave the others waiting for ever. Every rank runs
    ``runs`` forwards, those it has no batch for (an incomplete last global batch leaves the last ranks none) on
    ``filler()``, whose loss is not counted."""

    runs: int
    filler: Callable[[], Batch]


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    batches: Iterable[Batch],
    loss_fn: LossFn,
    device: torch.device,
    vocab_size: int | None = None,
    count_items: Callable[[Batch], int] = count_trainable_tokens,
    even: EvenRuns | None = None,
) -> float:
    """Mean loss over ``batches`` (all ranks) per item (token, or pair for a preference objective), in eval mode
    (no dropout, no RNG use); with ``vocab_size`` each batch's token ids are checked on the host first; with
    ``even``, every rank runs as many forwards.

    Returns:
        The loss, or NaN when the batches hold no trainable token.
    """

    def loss_of(micro: Batch) -> torch.Tensor:
        if vocab_size is not None:
            check_token_ids(micro, vocab_size)
        batch = {k: v.to(device, non_blocking=True) for k, v in with_trained_rows(micro).items()}
        return loss_fn(model, batch, trainable_labels(batch), 1).double()  # num_items=1: the plain sum

    was_training = model.training
    model.eval()
    total = torch.zeros((), dtype=torch.float64, device=device)
    count = runs = 0
    for micro in batches:
        total += loss_of(micro)
        count += count_items(micro)
        runs += 1
    for _ in range(even.runs - runs if even is not None else 0):
        loss_of(even.filler())
    model.train(was_training)
    total = distributed.all_reduce_sum(total)
    count = int(distributed.all_reduce_sum(torch.tensor(count, device=device)))
    return float(total) / count if count else math.nan


class _Window:
    """Sums between two log records."""

    def __init__(self) -> None:
        self.loss, self.steps, self.tokens, self.start = 0.0, 0, 0, time.perf_counter()
        self.norm = 0.0

    def add(self, loss: float, norm: float, tokens: int) -> None:
        if math.isfinite(loss):
            self.loss, self.steps, self.norm = self.loss + loss, self.steps + 1, norm
        self.tokens += tokens

    def record(self, state: TrainState, objs: Trainables) -> dict[str, Any]:
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        record = {
            "step": state.global_step,
            "epoch": state.epoch,
            "loss": self.loss / self.steps if self.steps else float("nan"),
            "lr": objs.optimizer.param_groups[0]["lr"],
            "grad_norm": self.norm,
            "tokens_per_s": self.tokens / elapsed,
            "skipped_steps": state.skipped_steps,
        }
        outliers = getattr(objs.optimizer, "skipped_steps", None)
        if outliers is not None:
            record["optimizer_skipped_steps"] = int(outliers)
        return {**record, **cuda_memory_gib()}


@contextlib.contextmanager
def long_lived_objects_frozen() -> Iterator[None]:
    """Hides every object alive on entry (the model's modules, the libraries' own) from Python's garbage
    collector while the loop runs, and shows them again after (unless the caller had frozen objects before:
    ``gc.unfreeze`` cannot tell whose they are, so those stay frozen).

    A full collection walks every tracked object: with torch, Transformers and a model loaded, a few hundred
    thousand, 300-450 ms on the H200 machine's host. One fell into every few steps of an 8B run and the GPU
    idled through it (a 365 ms step took 700-800). Frozen, a full collection walks only what the loop made.
    """
    gc.collect()
    frozen_before = gc.get_freeze_count() > 0
    gc.freeze()
    try:
        yield
    finally:
        if not frozen_before:
            gc.unfreeze()


def train_loop(
    objs: Trainables,
    stream: DataStream,
    loss_fn: LossFn,
    settings: LoopSettings,
    state: TrainState,
    logger: MetricsLogger,
    save: Callable[[TrainState], None],
    callbacks: Sequence[StepCallback] = (),
    run_eval: Callable[[], float] | None = None,
    stop_requested: Callable[[], bool] = lambda: False,
) -> TrainState:
    """Runs optimizer steps from ``state.global_step`` to ``settings.total_steps``, or until ``stop_requested()``
    says so on any rank before a step (the state is then the last finished step's, ready to be checkpointed).

    Args:
        objs: model (in training mode after this call), optimizer, scheduler, optional grad scaler.
        stream: micro batches, positioned where ``state`` says.
        loss_fn: see ``loralei.train.losses``.
        settings: resolved loop settings.
        state: updated in place and returned.
        logger: metrics sink (no-op off the main process).
        save: writes a checkpoint of the current state; called every ``save_steps``.
        callbacks: called with the state after every step (after any save). A step's skip counters and the
            schedule take it when its verdict is read: at the next step, or at once on a log, eval or save step.
        run_eval: returns the evaluation loss; called every ``eval_steps`` and after the last step.
        stop_requested: whether this process was asked to stop (e.g. by a signal); polled before every step.

    Returns:
        The final state.

    Raises:
        TrainingError: too many consecutive non-finite steps.
    """
    params = trainable_parameters(objs.model)
    objs.model.train()
    window = _Window()
    pending: tuple[Verdict, int] | None = None  # the last step's verdict and tokens, not read yet

    def settle() -> None:
        nonlocal pending
        if pending is not None:
            _settle(objs, state, settings, logger, window, *pending)
            pending = None

    while state.global_step < settings.total_steps:
        micro = [stream.next() for _ in range(settings.gradient_accumulation_steps)]
        counts = window_counts(micro, settings.device, stop_requested(), settings.count_items)
        if counts.stop:  # every rank sees it at the same step; the state is the last step's
            break
        loss, tokens, trainable = _forward_backward(objs, micro, loss_fn, settings, counts)
        settle()  # the step before: its verdict is on the host by now; the schedule moves before this step
        pending = (_optimizer_step(objs, params, loss, settings.max_grad_norm), tokens)
        state.global_step += 1
        state.epoch, state.batch_in_epoch = stream.epoch, stream.batch_in_epoch
        state.tokens_seen += tokens
        state.trainable_tokens_seen += trainable
        last = state.global_step == settings.total_steps
        evaluate_now = run_eval is not None and (
            last or (settings.eval_steps and state.global_step % settings.eval_steps == 0)
        )
        save_now = bool(settings.save_steps) and state.global_step % settings.save_steps == 0 and not last
        if state.global_step % settings.logging_steps == 0 or last or evaluate_now or save_now:
            settle()
        if state.global_step % settings.logging_steps == 0 or last:
            logger.log({**window.record(state, objs), **_objective_metrics(settings)})
            window = _Window()
        if evaluate_now:
            logger.log({"step": state.global_step, "eval_loss": run_eval()})
        if save_now:
            save(state)
        for callback in callbacks:
            callback(state)
    settle()
    if (
        state.global_step < settings.total_steps and window.tokens
    ):  # stopped: log the steps since the last record
        logger.log({**window.record(state, objs), **_objective_metrics(settings)})
    return state


def _objective_metrics(settings: LoopSettings) -> dict[str, float]:
    return settings.objective_metrics() if settings.objective_metrics is not None else {}


def _settle(
    objs: Trainables,
    state: TrainState,
    settings: LoopSettings,
    logger: MetricsLogger,
    window: _Window,
    verdict: Verdict,
    tokens: int,
) -> None:
    """Reads a step's verdict: the schedule follows the updates actually made (a skipped step does not use up
    learning rate), and the skip counters, the log window and the progress bar take the step."""
    loss, norm, applied = verdict.read()
    if applied:
        objs.scheduler.step()
    window.add(loss, norm, tokens)
    _record_skip(state, applied, settings.max_consecutive_skipped_steps, loss, norm)
    logger.advance(loss if applied else None)
