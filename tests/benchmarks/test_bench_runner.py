"""benchmarks/bench_runner.py on the CPU: the runner with its defaults trains the tiny shape through its own loop,
the timed steps give a rate, and the JSON names what the auto settings chose."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_runner


@pytest.mark.parametrize("checkpointing", ["off", "offload"])
def test_the_runner_with_its_defaults_is_timed(tmp_path: Path, checkpointing: str) -> None:
    out = tmp_path / "runner.json"
    argv = ["--shape", "tiny", "--dtype", "float32", "--steps", "2", "--warmup", "1", "--out", str(out)]
    result = bench_runner.main([*argv, "--checkpointing", checkpointing])
    assert json.loads(out.read_text()) == result
    assert result["row"] == "loralei-runner (defaults)" and result["tokens_per_s"] > 0
    assert result["checkpointing"] == checkpointing
    assert result["auto_choices"] == [
        "training.liger_kernel: auto -> off: no CUDA device",
        "training.loss: auto -> cross_entropy (cpu: the plain head and loss)",
    ]
