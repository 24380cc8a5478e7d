"""benchmarks/bench_dora_norms.py on the CPU (Triton's interpreter) at small shapes: the norms timed with the kernel
and with torch's passes, the two agreeing to FP32 rounding."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_dora_norms
import pytest


def test_both_ways_are_timed_and_agree(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    rows = bench_dora_norms.main(["--shapes", "tiny", "--device", "cpu", "--out", str(tmp_path / "n.json")])
    assert json.loads((tmp_path / "n.json").read_text())["rows"] == rows
    assert [(r["case"], r["launch"]) for r in rows] == [
        (case, launch) for case in ("q", "down") for launch in ("torch passes", "kernel")
    ]
    assert all(r["us"] > 0 and r["max_rel_diff"] < 1e-5 for r in rows)
