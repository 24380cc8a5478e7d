"""A run's output directory: what it holds, what a new run may do with it, and replacing a run safely.

Layout::

    adapter/  adapter_peft/  merged/     the final adapters (and the merged model with save_merged)
    checkpoints/checkpoint-NNNNNN/       resumable checkpoints; checkpoints/latest names the last complete one
    log.jsonl  loss.png  tensorboard/    the run's log
    run_summary.json                     written last: the mark of a finished run

Nothing here imports torch: the command line plans the directory before loading anything, so a run that could not
use it fails in a second (:func:`plan_output_dir`, read-only). A run changes the directory only once it is sure to
start (:func:`claim`), and a run it replaces goes away only when the new run has written a scheduled checkpoint
or finished (:meth:`Claim.progressed`): until then its files wait in ``.loralei-replaced/``, and they are put back
when the new run fails first (:meth:`Claim.abandon`). A process killed in between (out of memory, SIGKILL) is
repaired by the next claim: the set-aside run comes back unless the new one had saved a checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import CheckpointError, ConfigError

ADAPTER_DIR, PEFT_DIR, MERGED_DIR = "adapter", "adapter_peft", "merged"
CHECKPOINTS_DIR, LATEST_MARKER, STATE_FILE = "checkpoints", "latest", "trainer_state.json"
SUMMARY_FILE, LOG_FILE, PLOT_FILE, TENSORBOARD_DIR = (
    "run_summary.json",
    "log.jsonl",
    "loss.png",
    "tensorboard",
)
# Everything a run writes into its output directory; other files there are never touched.
RUN_ARTIFACTS = (
    ADAPTER_DIR,
    PEFT_DIR,
    MERGED_DIR,
    CHECKPOINTS_DIR,
    SUMMARY_FILE,
    LOG_FILE,
    PLOT_FILE,
    TENSORBOARD_DIR,
)
REPLACED_DIR = ".loralei-replaced"
CHECKPOINT_PREFIX = "checkpoint-"
STATE_FORMAT_VERSION = 2
# Settings that do not change what a run computes: an unfinished run resumes by itself when only these differ.
RESUME_IGNORES = (
    "overwrite_output_dir",
    "wandb",
    "training.resume_from_checkpoint",
    "training.logging_steps",
    "training.save_steps",
    "training.save_total_limit",
    "training.save_merged",
    "training.eval_steps",
    "training.eval_batch_size",
    "training.report_to",
    "training.preprocessing_num_workers",
    "training.dataloader_num_workers",
    "training.pin_memory",
    "training.layer_offloading",  # the same losses and gradients, bit for bit: resume on a smaller GPU with it
)


def complete_checkpoints(output_dir: Path) -> list[Path]:
    """Complete checkpoint directories of a run, oldest first."""
    root = output_dir / CHECKPOINTS_DIR
    if not root.is_dir():
        return []
    found = [p for p in root.glob(f"{CHECKPOINT_PREFIX}*") if (p / STATE_FILE).is_file()]
    return sorted(found, key=lambda p: p.name)


def latest_checkpoint(output_dir: Path) -> Path | None:
    """The checkpoint named by ``latest`` if complete, else the newest complete one, else None."""
    marker = output_dir / CHECKPOINTS_DIR / LATEST_MARKER
    if marker.is_file():
        named = marker.parent / marker.read_text().strip()
        if (named / STATE_FILE).is_file():
            return named
    found = complete_checkpoints(output_dir)
    return found[-1] if found else None


def read_checkpoint_meta(path: Path) -> dict[str, Any]:
    """The ``trainer_state.json`` of a checkpoint directory.

    Raises:
        CheckpointError: it is missing, not JSON, has no ``state``, or comes from a newer loralei.
    """
    try:
        meta = json.loads((path / STATE_FILE).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(
            f"checkpoint {path} is incomplete or corrupt ({exc}); resume from an earlier checkpoint"
        ) from None
    if not isinstance(meta, dict) or not isinstance(meta.get("state"), dict):
        raise CheckpointError(
            f"checkpoint {path} is incomplete or corrupt ({STATE_FILE} has no 'state' object); "
            "resume from an earlier checkpoint"
        )
    if meta.get("format_version", 0) > STATE_FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {path} was written by a newer loralei; upgrade loralei")
    return meta


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(tree, dict):
        return {prefix: tree}
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        flat.update(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return flat


def config_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """``key: saved -> current`` for every setting that differs, except :data:`RESUME_IGNORES` and their
    sub-keys."""
    old, new = _flatten(saved), _flatten(current)
    ignored = tuple(f"{key}." for key in RESUME_IGNORES)
    lines = []
    for key in sorted(old.keys() | new.keys()):
        if key in RESUME_IGNORES or key.startswith(ignored) or old.get(key) == new.get(key):
            continue
        lines.append(f"{key}: {old.get(key, '(unset)')!r} -> {new.get(key, '(unset)')!r}")
    return lines


@dataclass(frozen=True)
class Contents:
    """What a directory holds of a run: its artifacts, whether it finished, its latest complete checkpoint."""

    artifacts: list[str]
    finished: bool
    checkpoint: Path | None

    @property
    def empty(self) -> bool:
        return not self.artifacts

    def describe(self) -> str:
        """``a finished run (adapter, log.jsonl, ...)`` or ``an unfinished run ...``."""
        kind = "a finished run" if self.finished else "an unfinished run"
        if not self.finished and self.checkpoint is not None:
            kind += f" (last checkpoint: step {_step_of(self.checkpoint)})"
        elif not self.finished:
            kind += " with no checkpoint"
        return f"{kind} ({', '.join(self.artifacts)})"


def _step_of(checkpoint: Path) -> int:
    return int(checkpoint.name.removeprefix(CHECKPOINT_PREFIX))


def _progressed(directory: Path) -> bool:
    return (directory / SUMMARY_FILE).is_file() or latest_checkpoint(directory) is not None


def _view(out: Path) -> Path:
    """Where the previous run is: ``out`` itself, or its set-aside copy when a replacement was cut short before
    the new run saved anything (the next claim puts it back)."""
    aside = out / REPLACED_DIR
    return aside if aside.is_dir() and not _progressed(out) else out


def contents(out: Path) -> Contents:
    """What ``out`` holds of a previous run (see :func:`_view`)."""
    where = _view(out)
    return Contents(
        artifacts=[name for name in RUN_ARTIFACTS if (where / name).exists()],
        finished=(where / SUMMARY_FILE).is_file(),
        checkpoint=latest_checkpoint(where),
    )


@dataclass(frozen=True)
class OutputPlan:
    """What a run will do with its output directory.

    Attributes:
        action: ``"fresh"`` (nothing there), ``"resume"`` (continue from ``checkpoint``) or ``"replace"`` (set the
            previous run aside, delete it once this run has progressed).
        checkpoint: the checkpoint to resume from, where it is now (:func:`claim` says where it is after repairing
            the directory), or None.
        note: a line for the run's first lines, or None.
    """

    action: str
    checkpoint: Path | None = None
    note: str | None = None


def plan_output_dir(cfg: Any) -> OutputPlan:
    """Decides, without changing anything, whether ``cfg`` starts fresh, resumes or replaces a previous run.

    ``training.resume_from_checkpoint``: ``auto`` (the default) resumes an unfinished run whose config matches
    (settings in :data:`RESUME_IGNORES` aside) and otherwise starts a new run; ``true`` resumes the latest
    checkpoint; a path resumes that checkpoint; ``false`` / null always start a new run. A new run replaces a
    previous one only with ``overwrite_output_dir: true``.

    Args:
        cfg: the validated :class:`~loralei.train.schema.RunConfig`.

    Returns:
        The plan.

    Raises:
        ConfigError: the directory holds a run this config may not replace, or an unfinished run whose config
            differs (the message lists the differences and the choices).
        CheckpointError: the checkpoint asked for does not exist or is incomplete.
    """
    out, resume = Path(cfg.output_dir), cfg.training.resume_from_checkpoint
    found = contents(out)
    if isinstance(resume, str) and resume != "auto":
        return _plan_explicit_path(out, Path(resume), found, cfg.overwrite_output_dir)
    if resume is True:
        if found.checkpoint is None:
            raise CheckpointError(
                f"training.resume_from_checkpoint: true, but {out / CHECKPOINTS_DIR} holds no complete checkpoint; "
                "set resume_from_checkpoint: auto (the default) to start a new run"
            )
        return OutputPlan("resume", found.checkpoint, _resume_note(out, found.checkpoint, "true"))
    if resume == "auto" and not found.finished and found.checkpoint is not None:
        return _plan_auto_resume(out, found, cfg.model_dump(mode="json"))
    return _plan_new_run(out, found, cfg.overwrite_output_dir)


def _resume_note(out: Path, checkpoint: Path, setting: str) -> str:
    return (
        f"resuming the run in {out} from step {_step_of(checkpoint)} "
        f"(training.resume_from_checkpoint: {setting})"
    )


def _plan_explicit_path(out: Path, path: Path, found: Contents, overwrite: bool) -> OutputPlan:
    if not (path / STATE_FILE).is_file():
        raise CheckpointError(
            f"training.resume_from_checkpoint: {str(path)!r} is not a complete loralei checkpoint (no {STATE_FILE}); "
            f"pass a {CHECKPOINTS_DIR}/checkpoint-NNNNNN directory, true, or auto"
        )
    if out.resolve() in path.resolve().parents:  # a checkpoint of this directory's run
        return OutputPlan("resume", path, f"resuming from {path}")
    plan = _plan_new_run(out, found, overwrite)  # continuing elsewhere: the directory must be free
    return OutputPlan(plan.action, path, f"continuing the run of {path} in {out}")


def _plan_auto_resume(out: Path, found: Contents, current: dict[str, Any]) -> OutputPlan:
    checkpoint = found.checkpoint
    saved = read_checkpoint_meta(checkpoint).get("run_config")
    if saved is not None and not (differences := config_differences(saved, current)):
        return OutputPlan("resume", checkpoint, _resume_note(out, checkpoint, "auto"))
    why = (
        "was written by a loralei that did not record its config"
        if saved is None
        else "was made with another config:\n    " + "\n    ".join(differences)
    )
    raise ConfigError(
        f"output_dir: {out} holds an unfinished run (last checkpoint: step {_step_of(checkpoint)}) that {why}\n"
        "  choose one:\n"
        "    continue it as it was: rerun with its config (training.resume_from_checkpoint: auto)\n"
        "    continue it with these settings: training.resume_from_checkpoint: true\n"
        "    replace it: training.resume_from_checkpoint: false and overwrite_output_dir: true\n"
        "    keep it and start elsewhere: another output_dir"
    )


def _plan_new_run(out: Path, found: Contents, overwrite: bool) -> OutputPlan:
    if found.empty:
        return OutputPlan("fresh")
    if not overwrite:
        continue_it = (
            "training.resume_from_checkpoint: true to continue it, "
            if not found.finished and found.checkpoint is not None
            else ""
        )
        raise ConfigError(
            f"output_dir: {out} already holds {found.describe()}; set overwrite_output_dir: true to replace it "
            f"(it is kept until the new run's first checkpoint), {continue_it}or choose another output_dir"
        )
    return OutputPlan(
        "replace",
        note=f"replacing {found.describe()} in {out}: it waits in {out / REPLACED_DIR} until this run's "
        "first checkpoint or its end",
    )


class Claim:
    """This run's hold on its output directory (see the module docstring); made by :func:`claim`."""

    def __init__(self, out: Path, action: str, main: bool) -> None:
        self.out, self.replacing, self.main = out, action == "replace", main
        # the directory holds a checkpoint of this run (a resumed run's own), so abandoning it keeps its files
        self.saved = action == "resume"

    def progressed(self) -> None:
        """After a scheduled checkpoint or the run's end: a run this one replaced is deleted now."""
        self.saved = True
        if self.replacing and self.main:
            shutil.rmtree(self.out / REPLACED_DIR, ignore_errors=True)
        self.replacing = False

    def checkpointed(self) -> None:
        """After a checkpoint written on an interruption: the run is resumable, but a run it replaces stays
        aside until a later run of this directory claims it."""
        self.saved = True

    def abandon(self) -> None:
        """After a failure: a run that saved nothing leaves the directory as it found it."""
        if self.saved or not self.main:
            return
        _remove_artifacts(self.out)
        if self.replacing:
            _restore(self.out)


def _remove_artifacts(directory: Path) -> None:
    for name in RUN_ARTIFACTS:
        path = directory / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


def _restore(out: Path) -> None:
    aside = out / REPLACED_DIR
    for path in aside.iterdir():
        os.replace(path, out / path.name)
    aside.rmdir()


def _repair(out: Path) -> None:
    """Finishes a replacement that a killed process left: the set-aside run comes back unless the run that replaced
    it had saved a checkpoint, in which case it goes."""
    aside = out / REPLACED_DIR
    if not aside.is_dir():
        return
    if _progressed(out):
        shutil.rmtree(aside)
        return
    _remove_artifacts(out)
    _restore(out)


def claim(cfg: Any, plan: OutputPlan, main: bool = True) -> tuple[Claim, Path | None]:
    """Takes the output directory for a run that is sure to start: repairs a replacement cut short, sets a
    replaced run aside, and resolves the checkpoint to resume from. Only ``main`` (the process that writes files)
    changes anything.

    Args:
        cfg: the run config.
        plan: :func:`plan_output_dir`'s answer for it, made before anything was loaded.
        main: whether this is the main process.

    Returns:
        The claim, and the checkpoint directory to resume from (None for a new run).
    """
    out = Path(cfg.output_dir)
    replacing = plan.action == "replace"
    if main:
        out.mkdir(parents=True, exist_ok=True)
        _repair(out)
        if replacing:
            aside = out / REPLACED_DIR
            aside.mkdir()
            for name in RUN_ARTIFACTS:
                if (out / name).exists():
                    os.replace(out / name, aside / name)
    checkpoint = plan.checkpoint
    if checkpoint is not None and (out / REPLACED_DIR) in checkpoint.parents:  # put back by the repair
        checkpoint = out / checkpoint.relative_to(out / REPLACED_DIR)
    return Claim(out, plan.action, main), checkpoint
