"""benchmarks/bench_fp8_quantize.py on the CPU (Triton's interpreter) at small shapes: every candidate launch
is timed and gives the default launch's codes, and exactly one candidate per case is the default."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_fp8_quantize
import pytest


def test_every_launch_is_timed_and_bit_identical(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    rows = bench_fp8_quantize.main(["--shapes", "tiny", "--device", "cpu", "--out", str(tmp_path / "q.json")])
    assert json.loads((tmp_path / "q.json").read_text())["rows"] == rows
    for case in ("input", "pair"):
        mine = [r for r in rows if r["case"] == case]
        assert (
            len(mine) >= 4
            and sum(r["default"] for r in mine) == 1
            and sum(r["given_amax"] for r in mine) == 1
        )
        assert all(r["bit_identical"] and r["us"] > 0 for r in mine)
