"""benchmarks/nvfp4_checkpoint.py on the CPU: a tiny MoE shape written in ModelOpt's NVFP4 layout (per-expert
linears) without its dense model trains through bench_runner's ``--nvfp4-checkpoint`` row, its banks 4-bit."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_rows
import bench_runner

# tiny-moe with expert widths in NVFP4's blocks of 16
SHAPE = "tiny-moe-nvfp4"


@pytest.fixture
def nvfp4_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    config_cls, cfg, batch, seq = bench_rows.SHAPES["tiny-moe"]
    monkeypatch.setitem(
        bench_rows.SHAPES, SHAPE, (config_cls, {**cfg, "moe_intermediate_size": 48}, batch, seq)
    )


def test_an_nvfp4_moe_checkpoint_row_trains(tmp_path: Path, nvfp4_shape) -> None:
    argv = ["--shape", SHAPE, "--dtype", "float32", "--steps", "1", "--warmup", "1", "--nvfp4-checkpoint"]
    model_dir = tmp_path / "model"
    result = bench_runner.main([*argv, "--model-dir", str(model_dir), "--out", str(tmp_path / "r.json")])
    assert result["row"] == "loralei-runner (defaults, NVFP4 checkpoint)" and result["tokens_per_s"] > 0
    assert any(note.startswith("model: a NVFP4 checkpoint") for note in result["runner_notes"])
    names = set(bench_runner.layered_load.SafetensorsDirectory(model_dir).names())
    assert "model.layers.1.mlp.experts.7.up_proj.weight_scale_2" in names
    assert "model.layers.0.self_attn.q_proj.weight_scale" in names
    with pytest.raises(SystemExit, match="quantization_config"):  # a dense run refuses the NVFP4 directory
        bench_runner.main([*argv[:-1], "--model-dir", str(model_dir), "--out", str(tmp_path / "d.json")])
