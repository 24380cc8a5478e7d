"""benchmarks/sequence_parallel_table.py: each shape's runs against its one-process run (the end-to-end table of
real runs is checked in test_bench_runner.py)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import sequence_parallel_table


def _run(shape: str, processes: int, tokens_per_s: float, loss: float) -> dict:
    return {
        "shape": shape,
        "processes": processes,
        "tokens_per_s": tokens_per_s,
        "peak_gib": 40.0 / processes,
        "first_loss": loss,
        "last_loss": loss - 0.5,
    }


def test_each_shape_is_set_against_its_own_one_gpu_run() -> None:
    runs = [
        _run("llama3-8b-128k", 2, 6_000.0, 12.0012),
        _run("llama3-8b-256k", 2, 3_000.0, 12.5),
        _run("llama3-8b-128k", 1, 3_200.0, 12.0),
    ]
    lines = sequence_parallel_table.table(runs).splitlines()
    assert lines[2] == "| llama3-8b-128k | 1 | 3,200 | 1.00× | 40.00 | 12.0000 | 11.5000 |  |"
    assert lines[3] == "| llama3-8b-128k | 2 | 6,000 | 1.88× | 20.00 | 12.0012 | 11.5012 | 1.0e-04 |"
    # no one-process run of this shape: nothing to set it against
    assert lines[4] == "| llama3-8b-256k | 2 | 3,000 | n/a | 20.00 | 12.5000 | 12.0000 |  |"
