"""benchmarks/bench_fp8.py on the CPU at small shapes: every product is timed, and the FP8 products sit within
e4m3's rounding of the exact ones while the bf16 products sit closer."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_fp8

from tolerances import E4M3_REL


def test_fp8_products_are_timed_and_their_error_reported(tmp_path: Path) -> None:
    out = tmp_path / "fp8.json"
    rows = bench_fp8.main(
        ["--shapes", "tiny", "--tokens", "40", "--device", "cpu", "--reps", "2", "--out", str(out)]
    )
    assert json.loads(out.read_text())["rows"] == rows
    assert [(r["proj"], r["direction"]) for r in rows] == [
        ("square", "X W^T"), ("square", "dY W"), ("wide", "X W^T"), ("wide", "dY W"),
    ]  # fmt: skip
    for r in rows:
        assert all(r[f"{k}_ms"] > 0 and r[f"{k}_tflops"] > 0 for k in ("bf16", "fp8", "bare"))
        assert r["bf16_rel_err"] < r["fp8_rel_err"] <= E4M3_REL
