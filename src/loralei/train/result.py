"""The outcome of a run: where its adapters are and how it went, as an object and as ``run_summary.json``."""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from .metrics import read_log
from .output_dir import LOG_FILE, PLOT_FILE, SUMMARY_FILE
from .state import TrainState


class Phases:
    """Wall-clock seconds of a run's phases (``data``, ``model``, ``setup``, ``training``, ``saving``), in the
    order they first ran; ``with phases("data"): ...`` adds to one."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        begin = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - begin

    def total(self) -> float:
        """Seconds since the run began."""
        return time.perf_counter() - self.start


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
    adapter: str = ""  # what the LoRA covers: "r=16 on 8 linear modules; 58,368 trainable parameters"
    phases: dict[str, float] = field(default_factory=dict)  # seconds of each phase (see Phases)
    data: str = ""  # the data summary line
    # peak CUDA memory allocated (GiB) during the setup and during the training steps (None off CUDA), and the
    # setup's peak resident host memory ("setup_host")
    memory_gib: dict[str, float | None] = field(default_factory=dict)
    # the run's first lines: what the auto settings chose and why, the fusion report, tiling, offloading, ...
    setup_notes: list[str] = field(default_factory=list)

    def summary(self) -> str:
        """A few lines a person can read at the end of a run."""
        split = ", ".join(f"{name} {seconds:.1f}s" for name, seconds in self.phases.items())
        lines = [
            f"finished {self.steps} steps in {self.seconds:.1f}s ({self.skipped_steps} skipped)"
            + (f": {split}" if split else ""),
            *([self.data] if self.data else []),
            f"loss {self.first_loss:.4f} -> {self.last_loss:.4f}, {self.tokens_per_s:,.0f} tokens/s",
            *_peaks_line(self.memory_gib),
            *([f"LoRA: {self.adapter}"] if self.adapter else []),
            f"adapter: {self.adapter_dir} (loralei) and {self.peft_dir} (PEFT / vLLM)",
        ]
        if self.merged_dir is not None:
            lines.append(f"merged model: {self.merged_dir}")
        plot = self.output_dir / PLOT_FILE
        log = f"log: {self.output_dir / LOG_FILE}" + (f", plot: {plot}" if plot.is_file() else "")
        lines += [log, *self.notes]
        return "\n".join(lines)


def _peaks_line(memory: dict[str, float | None]) -> list[str]:
    lines = []
    if memory.get("training") is not None:
        lines.append(
            f"GPU memory, peak allocated: {memory['training']:.2f} GiB in training, {memory['setup']:.2f} GiB "
            "while setting up (loading, quantizing, injecting)"
        )
    if memory.get("setup_host") is not None:
        lines.append(f"host memory, peak resident while setting up: {memory['setup_host']:.2f} GiB")
    return lines


def write_result(
    output_dir: Path,
    state: TrainState,
    paths: tuple[Path, Path, Path | None],
    phases: Phases,
    notes: list[str],
    adapter: str = "",
    data: str = "",
    memory_gib: dict[str, float | None] | None = None,
    setup_notes: list[str] | None = None,
) -> RunResult:
    """Builds the result from the run's log and writes ``run_summary.json`` (the mark of a finished run)."""
    records = read_log(output_dir)
    losses = [r["loss"] for r in records if math.isfinite(r.get("loss", math.nan))]
    speeds = [r["tokens_per_s"] for r in records if "tokens_per_s" in r]
    result = RunResult(
        output_dir=output_dir,
        adapter_dir=paths[0],
        peft_dir=paths[1],
        merged_dir=paths[2],
        steps=state.global_step,
        skipped_steps=state.skipped_steps,
        first_loss=losses[0] if losses else math.nan,
        last_loss=losses[-1] if losses else math.nan,
        tokens_per_s=sum(speeds) / len(speeds) if speeds else 0.0,
        seconds=phases.total(),
        notes=notes,
        adapter=adapter,
        phases={name: round(seconds, 3) for name, seconds in phases.seconds.items()},
        data=data,
        memory_gib=memory_gib or {},
        setup_notes=setup_notes or [],
    )
    summary = {k: str(v) if isinstance(v, Path) else v for k, v in result.__dict__.items()}
    (output_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
    return result
