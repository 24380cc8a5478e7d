"""benchmarks/bench_fp8.py on the CPU at small shapes: every product is timed, the FP8 products sit within
e4m3's rounding of the exact ones while the bf16 products sit closer, and fast accumulation's own difference is
reported (none on the CPU, which ignores the flag)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_fp8

from tolerances import E4M3_REL

ARGS = ["--shapes", "tiny", "--tokens", "40", "--device", "cpu", "--reps", "2"]


def test_fp8_products_are_timed_and_their_error_reported(tmp_path: Path) -> None:
    out = tmp_path / "fp8.json"
    rows = bench_fp8.main([*ARGS, "--out", str(out)])
    assert json.loads(out.read_text())["rows"] == rows
    assert [(r["proj"], r["direction"], r["out"], r["in"]) for r in rows] == [
        ("square", "X W^T", 64, 64), ("square", "dY W", 64, 64), ("wide", "X W^T", 128, 64),
        ("wide", "dY W", 128, 64), ("pair", "dY W", 96, 64),
    ]  # fmt: skip
    for r in rows:
        assert all(r[f"{k}_ms"] > 0 and r[f"{k}_tflops"] > 0 for k in ("bf16", "fp8", "bare", "bare_fast"))
        assert r["bf16_rel_err"] < r["fp8_rel_err"] <= E4M3_REL
        assert r["fast_vs_fp32_rel_err"] == 0.0
