"""benchmarks/bench_distributed.py on the CPU: one process, then DDP and FSDP2 over 2 processes (gloo) on the
tiny shape; each run's JSON has the per-rank step times, the scaling efficiency against the one-process run,
and the summary puts the runs in one table."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from launching import child_env

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_distributed.py"
ARGS = ["--shape", "tiny", "--steps", "1", "--warmup", "1"]


def _bench(args: list[str], nproc: int | None) -> None:
    env = child_env()
    runner = [sys.executable]
    if nproc is not None:
        runner += ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
    proc = subprocess.run(
        [*runner, str(BENCH), *ARGS, *args], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]


@pytest.mark.parametrize(
    ("mode", "row"), [("ddp", "loralei-fused"), ("fsdp2", "loralei-fused"), ("fsdp2", "loralei-nf4")]
)
def test_two_processes_report_per_gpu_rates_and_scaling(tmp_path: Path, mode: str, row: str) -> None:
    one, many = tmp_path / "none.json", tmp_path / f"{mode}.json"
    _bench(["--distributed", "none", "--row", row, "--out", str(one)], nproc=None)
    _bench(["--distributed", mode, "--row", row, "--baseline", str(one), "--out", str(many)], nproc=2)
    result = json.loads(many.read_text())
    assert (result["distributed"], result["processes"], result["backend"], result["row"]) == (
        mode,
        2,
        "gloo",
        row,
    )
    assert len(result["ranks"]) == 2 and all(r["seconds"] > 0 for r in result["ranks"])
    assert result["tokens_per_s"] == pytest.approx(2 * result["tokens_per_s_per_gpu"])
    base = json.loads(one.read_text())
    assert result["scaling_efficiency"] == pytest.approx(
        result["tokens_per_s_per_gpu"] / base["tokens_per_s_per_gpu"]
    )
    if mode == "ddp":
        assert result["comm_hook"].endswith("fp32_sum_hook")
    table = tmp_path / "table.md"
    _bench(["--summary", str(one), str(many), "--out", str(table)], nproc=None)
    lines = table.read_text().splitlines()
    assert len(lines) == 4 and f"| {row} | off | {mode} | 2 |" in lines[3] and "| none | 1 |" in lines[2]
