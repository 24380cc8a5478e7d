"""The train-step benchmark's --tiny CPU mode runs end to end and writes its JSON and markdown results."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_train_step.py"


def _load_bench():
    """The benchmark script as a module (it is a script, not part of the package)."""
    spec = importlib.util.spec_from_file_location("bench_train_step", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_tiny_mode_writes_results(tmp_path: Path) -> None:
    bench = _load_bench()
    argv = ["--tiny", "--rows", "peft-bf16-adapters", "loralei-fused", "--checkpointing", "on"]
    results = bench.main([*argv, "--out-dir", str(tmp_path), "--tag", "smoke"])
    assert [r["row"] for r in results["steps"]] == ["peft-bf16-adapters", "loralei-fused"]
    assert all(r["tokens_per_s"] > 0 for r in results["steps"]) and results["steps"][0]["ratio"] == 1.0
    assert {m["op"] for m in results["ops"]} == {
        "o_proj (lora_w)",
        "down_proj (lora_w)",
        "q/k/v (lora_group)",
        "gated MLP (lora_mlp)",
    }
    assert json.loads((tmp_path / "smoke.json").read_text()) == results
    assert "| tiny | loralei-fused | True |" in (tmp_path / "smoke.md").read_text()


def test_interleaved_mode_reports_every_row(tmp_path: Path) -> None:
    """--interleave keeps the rows' models resident and alternates their steps; rows come back in order."""
    bench = _load_bench()
    argv = ["--tiny", "--interleave", "--no-ops", "--rows", "peft-bf16-adapters", "loralei-fused"]
    results = bench.main([*argv, "--out-dir", str(tmp_path), "--tag", "il"])
    rows = [(r["row"], r["checkpointing"]) for r in results["steps"]]
    assert rows == [(row, ckpt) for ckpt in (False, True) for row in ("peft-bf16-adapters", "loralei-fused")]
    assert all(r["tokens_per_s"] > 0 for r in results["steps"])
