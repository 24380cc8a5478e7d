"""benchmarks/long_context_slope.py: the slope and fixed cost of the step's peak over lengths, fitted from one
call's files, and what they extrapolate to."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import long_context_slope as slope

GIB = 2**30


def test_a_line_through_exact_points_is_found() -> None:
    line = slope.fit(
        [(32768, 10 * GIB + 32768 * 100), (65536, 10 * GIB + 65536 * 100), (131072, 10 * GIB + 131072 * 100)]
    )
    assert line.per_token == pytest.approx(100) and line.fixed == pytest.approx(10 * GIB)
    assert line.tokens_within(10 * GIB + 1_000_000) == pytest.approx(10_000)


def _write(out: Path, tokens: int, name: str, runner_gib: float, unsloth_gib: float) -> None:
    runner = {
        "tokens_per_s": 1000.0,
        "peak_gib": runner_gib,
        "offload_host_gib": tokens * 2 / 1024,  # 2 MiB a token
        "notes": ["offloaded checkpointing: kept what it kept", "another note"],
    }
    (out / f"long-runner-{name}.json").write_text(json.dumps(runner))
    steps = [{"tokens_per_s": 800.0, "peak_gib": unsloth_gib}]
    (out / f"long-unsloth-{name}.json").write_text(json.dumps({"steps": steps}))


def test_the_report_gives_both_slopes_their_ratio_and_the_host_bytes_a_token(tmp_path: Path) -> None:
    for name, tokens in (("32k", 32768), ("64k", 65536), ("128k", 131072)):
        # runner: 16 GiB + 64 KiB a token; Unsloth: 16 GiB + 192 KiB a token
        _write(tmp_path, tokens, name, 16 + tokens * 64 / 2**20, 16 + tokens * 192 / 2**20)
    text = slope.report(tmp_path)
    assert "runner: 64.00 KiB of device memory per token, 16.00 GiB fixed" in text
    assert "unsloth: 192.00 KiB of device memory per token, 16.00 GiB fixed" in text
    assert "runner at 65,536 tokens: 2,048 KiB of pinned host memory a token (kept what it kept)" in text
    assert "runner / Unsloth: slope 0.333" in text
    assert "| 131,072 | 1,000 | 24.00 | 256.00 | 800 | 40.00 |" in text


def test_host_bytes_are_not_fitted_to_a_line_once_the_budget_caps_them() -> None:
    """Past the host budget the runner keeps less: each length's bytes a token are reported, none extrapolated."""
    capped = {
        "offload_host_gib": 64.0,
        "notes": ["offloaded checkpointing: 64.00 GiB; the host budget held no more"],
    }
    rows = [(65536, {"offload_host_gib": 62.0}), (131072, capped)]
    assert slope.host_lines(rows) == [
        "runner at 65,536 tokens: 992 KiB of pinned host memory a token",
        "runner at 131,072 tokens: 512 KiB of pinned host memory a token (64.00 GiB; the host budget held no more)",
    ]


def test_a_peer_measured_at_one_length_gets_no_slope(tmp_path: Path) -> None:
    _write(tmp_path, 32768, "32k", 20.0, 30.0)
    assert "runner: fewer than two lengths, no slope" in slope.report(tmp_path)


def test_the_long_step_is_reported_with_its_untiled_twin_and_their_losses_difference(tmp_path: Path) -> None:
    """The one long step (time, peak, loss) and the same sequence with its MLPs untiled: the tiles' loss is
    checked at that length by the difference of the two."""
    step = {"shape": "llama3-8b-256k", "tokens_per_step": 262144, "tokens_per_s": 1310.72, "peak_gib": 40.5}
    (tmp_path / "long-runner-step.json").write_text(json.dumps(step | {"last_loss": 12.000125}))
    lines = slope.long_step_lines(tmp_path)
    assert lines == [
        "one step of llama3-8b-256k (MLPs tiled): 1,311 tok/s (200.0 s), step peak 40.50 GiB, loss 12.000125"
    ]
    untiled = step | {"last_loss": 12.0, "peak_gib": 61.25}
    (tmp_path / "long-runner-step-untiled.json").write_text(json.dumps(untiled))
    lines = slope.long_step_lines(tmp_path)
    assert lines[1].startswith(
        "one step of llama3-8b-256k (MLPs untiled): 1,311 tok/s (200.0 s), step peak 61.25"
    )
    assert lines[2] == "tiled - untiled loss: +1.25e-04 (relative 1.0e-05)"
    assert lines[2] in slope.report(tmp_path)


def _memory_row(out: Path, name: str, tokens: int, sites: dict[str, float]) -> None:
    """A memory_step.py --snapshot row: ``sites`` in KiB a token, alive at the step's peak."""
    by_site = [{"where": where, "bytes": int(kib * 1024 * tokens)} for where, kib in sites.items()]
    total = sum(entry["bytes"] for entry in by_site)
    row = {"alive_at_peak": {"bytes_allocated_in_step": total, "by_site": by_site}}
    (out / f"long-memory-{name}.json").write_text(json.dumps(row))


def test_the_slope_is_split_by_what_is_alive_at_the_peak(tmp_path: Path) -> None:
    """Two memory rows: each site's bytes a token at both lengths and its share of the slope, the site that
    grows most first, one present at a single length counted as zero at the other; a single row gives nothing."""
    _memory_row(tmp_path, "32k", 32768, {"attention backward": 40.0, "workspace": 2.0})
    assert slope.site_lines(tmp_path) == []
    # the workspace is a fixed 64 MiB: 2 KiB a token at 32K, 0.5 at 128K, no slope
    _memory_row(tmp_path, "128k", 131072, {"attention backward": 40.0, "workspace": 0.5, "rope": 8.0})
    lines = slope.site_lines(tmp_path)
    assert (
        lines[1]
        == "alive at the runner's step peak, by allocation site, 32,768 and 131,072 tokens (KiB a token):"
    )
    assert lines[4:] == [
        "| attention backward | 40.0 | 40.0 | 40.0 |",
        "| rope | 0.0 | 8.0 | 10.7 |",
        "| workspace | 2.0 | 0.5 | 0.0 |",
        "| all allocated in the step | 42.0 | 48.5 | 50.7 |",
    ]
    assert lines[-1] in slope.report(tmp_path)
