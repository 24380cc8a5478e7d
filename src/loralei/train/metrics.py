"""Run logging: a JSONL log, a tqdm bar, optional W&B and TensorBoard, and a loss/throughput PNG, on the main
process only."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from ..errors import ConfigError
from .output_dir import LOG_FILE, PLOT_FILE, TENSORBOARD_DIR
from .schema import WandbSection


def cuda_memory_gib() -> dict[str, float]:
    """Peak CUDA memory allocated and reserved since the training steps began (:func:`setup_memory_gib`), in GiB
    (empty without CUDA)."""
    if not torch.cuda.is_available():
        return {}
    gib = 1024**3
    return {
        "peak_allocated_gib": round(torch.cuda.max_memory_allocated() / gib, 3),
        "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / gib, 3),
    }


def setup_memory_gib(device: torch.device) -> float | None:
    """The peak CUDA memory allocated so far on ``device`` (the setup: loading, quantizing and injecting the
    model, the optimizer), in GiB; the peak counters then start again, so that the log's peaks are the training
    steps' own. None off CUDA."""
    if device.type != "cuda":
        return None
    peak = torch.cuda.max_memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    return round(peak / 1024**3, 3)


def host_peak_gib() -> float | None:
    """The process's peak resident host memory so far (the setup's, when read before the first step), in GiB;
    None where the platform does not report it."""
    try:
        import resource
    except ImportError:  # not on Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return round(peak * (1 if sys.platform == "darwin" else 1024) / 1024**3, 3)


def require_wandb() -> Any:
    """Imports ``wandb`` or raises a ConfigError saying how to install it or turn it off."""
    try:
        import wandb
    except ImportError:
        raise ConfigError(
            "wandb: W&B logging is on (a wandb section or training.report_to: wandb) but the 'wandb' package is "
            "not installed; run `pip install 'loralei[wandb]'` or remove the wandb settings"
        ) from None
    return wandb


def read_log(output_dir: Path) -> list[dict[str, Any]]:
    """The records of a run's JSONL log (empty if there is none)."""
    path = output_dir / LOG_FILE
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class MetricsLogger:
    """Writes metrics on the main process; on other ranks every method is a no-op.

    Args:
        output_dir: where ``log.jsonl`` and ``loss.png`` go.
        total_steps: length of the progress bar.
        start_step: the step a resumed run starts from; log records after it (from a run that went on past
            its last checkpoint) are dropped so the log matches the restored state.
        enabled: True on the main process.
        wandb_settings: W&B run settings, or None.
        run_config: logged to W&B as the run's config.
        tensorboard: also write every numeric metric as a TensorBoard scalar, in ``output_dir/tensorboard``
            (a resumed run first drops the events after ``start_step``, as the JSONL log does).
    """

    def __init__(
        self,
        output_dir: Path,
        total_steps: int,
        *,
        start_step: int = 0,
        enabled: bool = True,
        wandb_settings: WandbSection | None = None,
        run_config: dict[str, Any] | None = None,
        tensorboard: bool = False,
    ) -> None:
        self.enabled = enabled
        self.output_dir = output_dir
        self._bar = None
        self._wandb_run = None
        self._tensorboard = None
        if not enabled:
            return
        kept = [r for r in read_log(output_dir) if r.get("step", 0) <= start_step]
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / LOG_FILE).write_text("".join(json.dumps(r) + "\n" for r in kept))
        self._steps = (start_step, total_steps)
        if wandb_settings is not None:
            wandb = require_wandb()
            self._wandb_run = wandb.init(
                project=wandb_settings.project,
                name=wandb_settings.name,
                entity=wandb_settings.entity,
                tags=wandb_settings.tags,
                config=run_config,
                dir=str(output_dir),
            )
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tensorboard = SummaryWriter(str(output_dir / TENSORBOARD_DIR), purge_step=start_step + 1)

    def start_progress(self) -> None:
        """Shows the progress bar, after the run's first lines (printed with :meth:`write`)."""
        if self.enabled:
            start, total = self._steps
            self._bar = tqdm(total=total, initial=start, desc="training", dynamic_ncols=True)

    def advance(self, loss: float | None = None) -> None:
        """Moves the progress bar one step, showing the latest loss."""
        if self._bar is not None:
            self._bar.update(1)
            if loss is not None:
                self._bar.set_postfix(loss=f"{loss:.4f}", refresh=False)

    def log(self, record: dict[str, Any]) -> None:
        """Appends ``record`` (must hold ``step``) to the JSONL log and to W&B."""
        if not self.enabled:
            return
        with (self.output_dir / LOG_FILE).open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self._wandb_run is not None:
            self._wandb_run.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])
        if self._tensorboard is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, int | float) and not isinstance(value, bool):
                    self._tensorboard.add_scalar(key, value, record["step"])

    def write(self, message: str) -> None:
        """Prints a line without breaking the progress bar."""
        if self.enabled:
            tqdm.write(message)

    def close(self) -> str | None:
        """Closes the bar and W&B, draws the plot; returns a note when the plot was skipped."""
        if not self.enabled:
            return None
        if self._bar is not None:
            self._bar.close()
        if self._wandb_run is not None:
            self._wandb_run.finish()
        if self._tensorboard is not None:
            self._tensorboard.close()
        return plot_log(self.output_dir)


def plot_log(output_dir: Path) -> str | None:
    """Draws training loss and tokens/s against step into ``loss.png``.

    Returns:
        None when drawn; a one-line note when skipped (matplotlib missing, or nothing logged).
    """
    records = [r for r in read_log(output_dir) if "loss" in r and math.isfinite(r["loss"])]
    if not records:
        return "no loss was logged, so no plot was drawn"
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed, so no loss plot was drawn (pip install matplotlib)"
    steps = [r["step"] for r in records]
    fig, (ax_loss, ax_tps) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    ax_loss.plot(steps, [r["loss"] for r in records])
    ax_loss.set_ylabel("training loss")
    ax_tps.plot(steps, [r.get("tokens_per_s", float("nan")) for r in records])
    ax_tps.set_ylabel("tokens / s")
    ax_tps.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(output_dir / PLOT_FILE, dpi=100)
    plt.close(fig)
    return None
