"""benchmarks/bench_nvfp4_grouped.py on the CPU at the tiny shape (the kernel in Triton's interpreter): the four base
products of an MoE layer are timed as the dense banks' grouped GEMM, as dequantize + grouped GEMM, and as each kernel
variant."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_nvfp4_grouped as bench
import pytest


def test_every_product_is_timed_every_way(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    result = bench.main(["--tiny", "--out", str(tmp_path / "g.json")])
    assert json.loads((tmp_path / "g.json").read_text()) == result
    rows = result["products"]
    assert [r["product"] for r in rows] == [
        "gate_up forward",
        "down forward",
        "down input grad",
        "gate_up input grad",
    ]
    assert all(
        len(r) == 3 + len(bench.VARIANTS) and min(v for k, v in r.items() if k != "product") > 0 for r in rows
    )
