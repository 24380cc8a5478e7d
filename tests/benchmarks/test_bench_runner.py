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


def test_a_flag_that_changes_the_defaults_is_named_in_the_row(tmp_path: Path, monkeypatch) -> None:
    """--quantize runs QLoRA through the runner (NF4 base) and the row says so."""
    config = bench_runner.run_config

    def small_blocks(args, out_dir):  # the tiny shape's weights are smaller than NF4's default blocks
        cfg = config(args, out_dir)
        cfg["lora"]["nf4_scaler_block_size"] = 8
        return cfg

    monkeypatch.setattr(bench_runner, "run_config", small_blocks)
    out = tmp_path / "runner.json"
    argv = ["--shape", "tiny", "--dtype", "float32", "--steps", "1", "--warmup", "1", "--out", str(out)]
    result = bench_runner.main([*argv, "--quantize", "nf4", "--no-liger"])
    assert result["row"] == "loralei-runner (defaults, no Liger, nf4 base)"
    assert result["quantization_type"] == "nf4" and result["tokens_per_s"] > 0
