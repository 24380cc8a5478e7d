"""benchmarks/bench_experts.py on the CPU at its tiny shape: the fused op and its parts are timed, and with
``--nvfp4`` the layer on NVFP4 banks through both of the op's paths (the grouped kernel in Triton's interpreter,
then the shared buffer), the switch between them undone afterwards."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_experts as bench
import pytest

from loralei.kernels import nvfp4_grouped


def test_the_tiny_layer_is_timed_on_nvfp4_banks_both_ways(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    calls = []
    monkeypatch.setattr(nvfp4_grouped, "grouped_mm", lambda *a: calls.append(a) or _grouped_mm(*a))
    result = bench.main(["--tiny", "--nvfp4", "--no-plain", "--out", str(tmp_path / "e.json")])
    assert json.loads((tmp_path / "e.json").read_text()) == result
    assert result["fused_ms"] > 0 and set(result["split_ms"]) >= {"base grouped GEMMs", "LoRA terms"}
    assert min(result["nvfp4"].values()) > 0 and set(result["nvfp4"]) == {"grouped_ms", "buffer_ms"}
    assert calls and nvfp4_grouped.usable is _usable  # the kernel ran, and the switch was put back


_grouped_mm, _usable = nvfp4_grouped.grouped_mm, nvfp4_grouped.usable
