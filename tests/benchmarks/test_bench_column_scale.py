"""benchmarks/bench_column_scale.py on the CPU (Triton's interpreter) at small shapes: torch's pass and every
tiling are timed, every tiling gives torch's values bit for bit, and one per case is the default."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_column_scale
import pytest


def test_every_tiling_is_timed_and_bit_identical(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    rows = bench_column_scale.main(["--shapes", "tiny", "--device", "cpu", "--out", str(tmp_path / "s.json")])
    assert json.loads((tmp_path / "s.json").read_text())["rows"] == rows
    for case in ("q", "k"):
        mine = [r for r in rows if r["case"] == case]
        assert [r["launch"] for r in mine] == ["torch mul_", "kernel", "kernel"]
        assert sum(r["default"] for r in mine) == 1
        assert all(r["bit_identical"] and r["us"] > 0 for r in mine)
