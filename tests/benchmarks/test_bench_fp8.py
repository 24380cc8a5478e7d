"""benchmarks/bench_fp8.py on the CPU at small shapes: every product is timed, and the FP8 products sit within
e4m3's rounding of the exact ones while the bf16 products sit closer; the Triton GEMM's column is absent without
the Triton interpreter, and with it the Triton product is the bare ``_scaled_mm`` one to bf16's rounding."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_fp8
import pytest
import torch

from tolerances import E4M3_REL, LOW_PRECISION_FLOOR

ARGS = ["--shapes", "tiny", "--tokens", "40", "--device", "cpu", "--reps", "2"]


def _run(out: Path, *flags: str) -> list[dict]:
    rows = bench_fp8.main([*ARGS, "--out", str(out), *flags])
    assert json.loads(out.read_text())["rows"] == rows
    assert [(r["proj"], r["direction"], r["out"], r["in"]) for r in rows] == [
        ("square", "X W^T", 64, 64), ("square", "dY W", 64, 64), ("wide", "X W^T", 128, 64),
        ("wide", "dY W", 128, 64), ("pair", "dY W", 96, 64),
    ]  # fmt: skip
    for r in rows:
        assert all(r[f"{k}_ms"] > 0 and r[f"{k}_tflops"] > 0 for k in ("bf16", "fp8", "bare"))
        assert r["bf16_rel_err"] < r["fp8_rel_err"] <= E4M3_REL
    return rows


def test_fp8_products_are_timed_and_their_error_reported(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    rows = _run(tmp_path / "fp8.json")
    for r in rows:
        assert r["triton_ms"] is None and r["triton_tflops"] is None and r["triton_vs_bare_rel_err"] is None
    assert json.loads((tmp_path / "fp8.json").read_text())["fast_accum"] is False


@pytest.mark.parametrize("fast", [False, True], ids=["precise", "fast"])
def test_the_triton_gemm_runs_in_the_interpreter(tmp_path: Path, monkeypatch, fast: bool) -> None:
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    if not bench_fp8.fp8_matmul.usable(torch.empty(0)):
        pytest.skip("this Triton's interpreter cannot run the GEMM's K loop")
    rows = _run(tmp_path / "fp8.json", *(["--fast-accum"] if fast else []))
    for r in rows:
        assert r["triton_ms"] > 0 and r["triton_tflops"] > 0
        assert r["triton_vs_bare_rel_err"] <= LOW_PRECISION_FLOOR[torch.bfloat16]
    assert json.loads((tmp_path / "fp8.json").read_text())["fast_accum"] is fast
