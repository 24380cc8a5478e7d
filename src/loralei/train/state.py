"""Training checkpoints: write atomically, find the latest, and resume exactly.

Layout under ``<output_dir>/checkpoints/``::

    checkpoint-000010/   state/ (LoRA factors and optimizer state: torch.distributed.checkpoint, one file per
                         rank), optimizer_extra.pt (optimizer state of no parameter, e.g. SkipStepAdamW's skip
                         detector), adapter/ (the native adapter, for use), scheduler.pt, scaler.pt (fp16 only),
                         rng.pt (python, numpy, torch, cuda; one entry per rank), trainer_state.json (written last)
    latest               name of the last checkpoint written completely

Every rank takes part in saving and loading (``state/`` holds each rank's shards under FSDP2); the main process
writes the rest. A checkpoint is written into a temporary sibling directory and renamed into place; ``latest``
is replaced atomically afterwards. A crash at any point leaves the previous checkpoint and marker untouched.
Finding checkpoints and reading their ``trainer_state.json`` needs no torch: :mod:`loralei.train.output_dir`.
Checkpoints of format 1 (``optimizer.pt`` and the adapter instead of ``state/``) still load.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from ..checkpoint import load_pretrained, save_pretrained
from ..config import LoRAConfig
from ..errors import CheckpointError
from ..quiet import ignoring_warning
from . import distributed
from .output_dir import (
    CHECKPOINT_PREFIX,
    CHECKPOINTS_DIR,
    LATEST_MARKER,
    STATE_FILE,
    STATE_FORMAT_VERSION,
    complete_checkpoints,
    read_checkpoint_meta,
)

if TYPE_CHECKING:
    from .graphs import GraphedSteps

_STATE_DIR = "state"
_EXTRA_FILE = "optimizer_extra.pt"  # see _extra_state
# only the trainable (LoRA) parameters and their optimizer state; the frozen base is the model's own
_STATE_OPTIONS = StateDictOptions(ignore_frozen_params=True, strict=False)
# Without a process group, torch.distributed.checkpoint warns at every save and load that it assumes one process
# (the start of its text): that is what a one-process run is, and the line landed inside the progress bar.
_ONE_PROCESS_WARNING = "torch.distributed is disabled, unavailable or uninitialized"
# Model config entries that fix the adapter's shapes; a checkpoint only resumes on a model that agrees.
_FINGERPRINT_KEYS = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size")


@dataclass
class TrainState:
    """Where a run is: the step counter and the data position, plus counters for logging."""

    global_step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0
    skipped_steps: int = 0
    consecutive_skips: int = 0
    tokens_seen: int = 0
    trainable_tokens_seen: int = 0


@dataclass(frozen=True)
class RunIdentity:
    """What a checkpoint must agree with to be resumed: the adapter's shape and the data layout.

    Attributes:
        lora: the adapter config.
        data_layout: facts that fix what "batch k of epoch e" means (sample count, batch size, processes,
            seed); a resumed run with other values could not continue at the same data position.
        run_config: the whole run config (JSON form), recorded so that ``resume_from_checkpoint: auto`` resumes
            only a run of the same config (``loralei.train.output_dir``).
    """

    lora: LoRAConfig
    data_layout: dict[str, Any] = field(default_factory=dict)
    run_config: dict[str, Any] | None = None


@dataclass
class Trainables:
    """The objects a checkpoint captures besides the RNGs, and the module the loop calls for a loss
    (``engine``: the model and loss as one module, inside DDP for a distributed run; ``None``: built on the
    fly from the model), and the CUDA graphs that run it (``graphs``, with ``training.cuda_graphs``)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    scaler: torch.amp.GradScaler | None = None
    engine: nn.Module | None = None
    graphs: GraphedSteps | None = None  # runs each micro batch's forward and backward (training.cuda_graphs)


def model_fingerprint(model: nn.Module) -> dict[str, Any]:
    """The architecture facts of ``model`` that an adapter checkpoint depends on."""
    config = getattr(model, "config", None)
    return {key: getattr(config, key, None) for key in _FINGERPRINT_KEYS}


def rng_state() -> dict[str, Any]:
    """This process's RNG states (python, numpy, torch, CUDA): what a checkpoint keeps per rank."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _extra_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """An optimizer's state that belongs to no parameter (SkipStepAdamW's skip detector): saved beside the
    parameters' state, which torch.distributed.checkpoint keeps by parameter name."""
    extra = getattr(optimizer, "extra_state", None)
    return extra() if extra is not None else {}


def _trainable_state(objs: Trainables) -> dict[str, Any]:
    """The LoRA parameters and the optimizer state by parameter name."""
    model_state, optimizer_state = get_state_dict(objs.model, objs.optimizer, options=_STATE_OPTIONS)
    return {"model": model_state, "optimizer": optimizer_state}


def _write_checkpoint_files(
    directory: Path, objs: Trainables, state: TrainState, ident: RunIdentity, rng_states: list[dict[str, Any]]
) -> None:
    """The main process's part: everything but ``state/``."""
    save_pretrained(objs.model, directory / "adapter")
    torch.save(objs.scheduler.state_dict(), directory / "scheduler.pt")
    if objs.scaler is not None:
        torch.save(objs.scaler.state_dict(), directory / "scaler.pt")
    torch.save({"ranks": rng_states}, directory / "rng.pt")
    if extra := _extra_state(objs.optimizer):
        torch.save(extra, directory / _EXTRA_FILE)
    meta = {
        "format_version": STATE_FORMAT_VERSION,
        "state": asdict(state),
        "model_fingerprint": model_fingerprint(objs.model),
        "lora_config": ident.lora.model_dump(mode="json"),
        "data_layout": ident.data_layout,
        "run_config": ident.run_config,
    }
    # Written last: its presence is what makes a checkpoint directory complete.
    (directory / STATE_FILE).write_text(json.dumps(meta, indent=2) + "\n")


def save_checkpoint(
    output_dir: Path,
    objs: Trainables,
    state: TrainState,
    ident: RunIdentity,
    keep: int | None = None,
    rng_states: list[dict[str, Any]] | None = None,
) -> Path:
    """Writes a checkpoint of ``state.global_step`` atomically and points ``latest`` at it (every rank calls it).

    Args:
        output_dir: the run's output directory.
        objs: model (with LoRA), optimizer, scheduler, optional grad scaler.
        state: the loop state after the step.
        ident: the adapter config and data layout (recorded to reject resuming a different run).
        keep: keep only this many most recent checkpoints (``None`` keeps all).
        rng_states: every rank's :func:`rng_state`, in rank order (default: this process's alone).

    Returns:
        The checkpoint directory.
    """
    root = output_dir / CHECKPOINTS_DIR
    final = root / f"{CHECKPOINT_PREFIX}{state.global_step:06d}"
    main = distributed.is_main_process()
    tmp = None
    if main:
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=root))
    tmp = distributed.broadcast_from_main(tmp)
    try:
        with ignoring_warning(_ONE_PROCESS_WARNING):
            dcp.save(_trainable_state(objs), checkpoint_id=tmp / _STATE_DIR)
        if main:
            _write_checkpoint_files(tmp, objs, state, ident, rng_states or [rng_state()])
        distributed.barrier()
        if main:
            _move_into_place(tmp, final)
    finally:
        if main:
            shutil.rmtree(tmp, ignore_errors=True)
    if main:
        _write_marker(root, final.name)
        if keep is not None:
            _prune(root, keep, protect=final.name)
    distributed.barrier()
    return final


def _move_into_place(tmp: Path, final: Path) -> None:
    if final.exists():
        stale = final.parent / f".{final.name}.old-{uuid.uuid4().hex[:8]}"
        os.rename(final, stale)
        shutil.rmtree(stale, ignore_errors=True)
    os.rename(tmp, final)


def _write_marker(root: Path, name: str) -> None:
    tmp = root / f".{LATEST_MARKER}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.write_text(name + "\n")
    os.replace(tmp, root / LATEST_MARKER)


def _prune(root: Path, keep: int, protect: str) -> None:
    old = [p for p in complete_checkpoints(root.parent) if p.name != protect]
    for path in old[: max(len(old) - (keep - 1), 0)]:
        shutil.rmtree(path, ignore_errors=True)


def _first_difference(saved: dict[str, Any], current: dict[str, Any]) -> str | None:
    for key, value in current.items():
        if saved.get(key) != value:
            return key
    return None


def check_compatible(path: Path, meta: dict[str, Any], model: nn.Module, ident: RunIdentity) -> None:
    """Raises CheckpointError naming the first difference between the checkpoint's run and this one."""
    new_run = "start a new run (resume_from_checkpoint: false, and another output_dir)"
    saved, current = meta.get("model_fingerprint", {}), model_fingerprint(model)
    if key := _first_difference(saved, current):
        raise CheckpointError(
            f"checkpoint {path} was trained on a model with {key}={saved.get(key)!r}, but this run's model "
            f"has {key}={current[key]!r}; resume with the same base model, or {new_run}"
        )
    saved, current = meta.get("lora_config", {}), ident.lora.model_dump(mode="json")
    if key := _first_difference(saved, current):
        raise CheckpointError(
            f"checkpoint {path} has lora.{key}={saved.get(key)!r}, but this run has lora.{key}={current[key]!r}; "
            f"resume with the checkpoint's LoRA settings, or {new_run}"
        )
    saved = meta.get("data_layout", {})
    if key := _first_difference(saved, ident.data_layout):
        raise CheckpointError(
            f"checkpoint {path} was written with {key}={saved.get(key)!r}, but this run has "
            f"{key}={ident.data_layout[key]!r}, so its data position cannot be restored; resume with the same "
            f"data and batch settings, or {new_run}"
        )


def load_checkpoint(path: Path, objs: Trainables, ident: RunIdentity, rank: int = 0) -> TrainState:
    """Restores adapter, optimizer, scheduler, scaler and this rank's RNGs from ``path`` (every rank calls it);
    returns the loop state.

    Raises:
        CheckpointError: the checkpoint is incomplete, corrupt, or from another model, LoRA shape or data
            layout.
    """
    meta = read_checkpoint_meta(path)
    check_compatible(path, meta, objs.model, ident)
    try:
        if meta.get("format_version", 1) >= 2:
            saved = _trainable_state(objs)
            with ignoring_warning(_ONE_PROCESS_WARNING):
                dcp.load(saved, checkpoint_id=path / _STATE_DIR)
            set_state_dict(
                objs.model,
                objs.optimizer,
                model_state_dict=saved["model"],
                optim_state_dict=saved["optimizer"],
                options=_STATE_OPTIONS,
            )
            if (path / _EXTRA_FILE).is_file():
                objs.optimizer.load_extra_state(torch.load(path / _EXTRA_FILE, weights_only=False))
        else:
            load_pretrained(objs.model, path / "adapter")
            objs.optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=False))
        objs.scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=False))
        if objs.scaler is not None:
            objs.scaler.load_state_dict(torch.load(path / "scaler.pt", weights_only=False))
        rng = torch.load(path / "rng.pt", weights_only=False)
    except (OSError, RuntimeError, ValueError, KeyError) as exc:
        raise CheckpointError(f"checkpoint {path} cannot be restored: {exc}") from None
    ranks = rng.get("ranks", [rng])  # a checkpoint of an older loralei holds one process's states
    if rank >= len(ranks):
        raise CheckpointError(
            f"checkpoint {path} holds the RNG states of {len(ranks)} process(es), not of rank {rank}; resume with "
            f"the world size it was written with ({len(ranks)})"
        )
    _set_rng_state(ranks[rank])
    return TrainState(**meta["state"])
