"""benchmarks/bench_checkpoint_dequant.py on the CPU (Triton's interpreter) at a small shape: every format is
timed and its kernel gives the torch unpacking's bits, the random tensors follow each format's config, and
run_gpu.sh's part calls it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_checkpoint_dequant as bench
import pytest
import torch
from test_bench_train_step import run_gpu_calls

from loralei.modules.quantized.checkpoint_checks import TensorMeta, check_linear
from loralei.modules.quantized.checkpoint_formats import Dims, groups_of


def test_every_format_is_timed_and_bit_identical(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    pytest.importorskip("triton")
    pytest.importorskip("torchao")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    rows = bench.main(["--shapes", "tiny", "--device", "cpu", "--out", str(tmp_path / "d.json")])
    assert json.loads((tmp_path / "d.json").read_text())["rows"] == rows
    assert [r["format"] for r in rows] == list(bench.SPECS)
    assert all(r["bit_identical"] and min(r["kernel_ms"], r["torch_ms"], r["nf4_ms"]) > 0 for r in rows)


@pytest.mark.parametrize("label", list(bench.SPECS))
def test_the_random_tensors_follow_the_format(label: str) -> None:
    spec = bench.SPECS[label]
    t = bench.stored_tensors(spec, 64, 256, torch.device("cpu"))
    metas = {name: TensorMeta(tuple(x.shape), x.dtype) for name, x in t.items()}
    check_linear("bench", "proj", spec, Dims(64, 256, groups_of(spec, 256)), metas)
    assert ("g_idx" in t) == spec.act_order


def test_run_gpu_part_writes_the_json(tmp_path: Path) -> None:
    """run_gpu.sh's checkpoint-dequant part: one bench call at the 8B shapes into the call's folder."""
    out = tmp_path / "out" / "checkpoint-dequant.json"
    assert run_gpu_calls(tmp_path, "checkpoint-dequant") == [
        ["python3", "benchmarks/bench_checkpoint_dequant.py", "--out", str(out)]
    ]
