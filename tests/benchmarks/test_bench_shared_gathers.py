"""benchmarks/bench_shared_gathers.py on the CPU (Triton's interpreter) at its tiny shape: both launches are timed
over the same collated pair maps and give the same gradients."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_shared_gathers
import pytest


def test_both_launches_are_timed_with_the_same_gradients(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    rows = bench_shared_gathers.main(
        ["--shapes", "tiny", "--device", "cpu", "--out", str(tmp_path / "g.json")]
    )
    assert json.loads((tmp_path / "g.json").read_text())["rows"] == rows
    assert [r["launch"].split()[0] for r in rows] == ["index_select", "gather_sum"]
    assert all(r["same_grads"] and r["backward_us"] > 0 for r in rows)
    stored = 16 + 16 - 5 + 1  # a pair's two 16-token sequences, 5 prompt tokens stored once, the bridge token
    assert rows[0]["virtual_rows"] == [4, 16] and rows[0]["tokens"] == 2 * stored
