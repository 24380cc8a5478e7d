"""The data-preparation benchmark at a tiny size (200 rows): it runs, and says where the tokens came from."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_data_prep


def test_rows_are_chats_the_same_for_the_same_seed() -> None:
    rows = bench_data_prep.chat_rows(50, seed=3)
    assert rows == bench_data_prep.chat_rows(50, seed=3) != bench_data_prep.chat_rows(50, seed=4)
    for row in rows:
        roles = [m["role"] for m in row["messages"]]
        assert roles[-1] == "assistant" and set(roles) <= {"system", "user", "assistant"}
    chars = [
        sum(len(m["content"]) for m in row["messages"]) for row in bench_data_prep.chat_rows(2000, seed=0)
    ]
    assert 1000 < sum(chars) / len(chars) < 1500 and max(chars) > 2048  # ~1,300 tokens a row, a few too long


def test_tiny_run_writes_the_three_runs(tmp_path: Path) -> None:
    argv = [
        "--rows",
        "200",
        "--row-chars",
        "150",
        "--max-seq-length",
        "512",
        "--changed-max-seq-length",
        "1024",
    ]
    results = bench_data_prep.main([*argv, "--out", str(tmp_path), "--tag", "tiny"])
    runs = {r["run"]: r for r in results["runs"]}
    assert list(runs) == ["cold", "warm", "max_seq_length"]
    assert [runs[name]["cache"] for name in runs] == ["filled", "reused", "reused"]
    for run in runs.values():
        assert run["returncode"] == 0, run["last_lines"]
        assert 0 < run["first_step_s"] <= run["process_s"]
        assert run["peak_rss_mib"] > 100 and run["cpu_s"] > 0
        assert run["data_line"].startswith("data: 200 rows read") and {"data", "model", "training"} <= set(
            run["phases"]
        )
    assert results["bars_met"]["max_seq_length_reuses_the_cache"]
    assert json.loads((tmp_path / "tiny.json").read_text())["dataset"]["rows"] == 200
    assert "| cold | 512 |" in (tmp_path / "tiny.md").read_text()
