"""benchmarks/fp8_accuracy.py on the CPU (tiny shape, emulated FP8 GEMMs, a few quickstart steps): the logits of
the FP8 base sit within e4m3's rounding of the bf16 ones, and both quickstart runs (two processes at a time) train
and are reported, with their held-out loss."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import fp8_accuracy

from tolerances import E4M3_REL


def test_logits_and_quickstart_losses_are_reported(tmp_path: Path) -> None:
    out = tmp_path / "acc.json"
    result = fp8_accuracy.main(
        [
            "--shape",
            "tiny",
            "--tokens",
            "64",
            "--steps",
            "6",
            "--seeds",
            "2",
            "--shallow",
            "1",
            "--emulated",
            "--jobs",
            "2",
            "--out",
            str(out),
        ]
    )
    assert json.loads(out.read_text()) == result
    for logits in result["logits"].values():
        assert 0 < logits["bf16_vs_fp32"] < logits["fp8_vs_fp32"] < E4M3_REL
        assert 0 < logits["fp8_vs_bf16"] < E4M3_REL
        # emulated FP8 dequantizes for dense GEMMs: fast accumulation does not apply, the two runs agree
        assert (
            logits["fp8_fp32_accum_vs_bf16"] == logits["fp8_vs_bf16"] and logits["fp8_vs_fp8_fp32_accum"] == 0
        )
    assert result["logits"]["full"] != result["logits"]["shallow"]
    runs = result["quickstart"]
    assert all(len(rs) == 2 and all(r["last_loss"] < r["first_loss"] for r in rs) for rs in runs.values()), (
        runs
    )
    assert runs["bf16"][0] != runs["bf16"][1], "the seeds must differ"
    assert runs["fp8"][0]["last_loss"] != runs["bf16"][0]["last_loss"], (
        "the FP8 run must differ: its base was packed"
    )
    assert all(0 < r["eval_loss"] < r["first_loss"] for rs in runs.values() for r in rs), runs
    for metric in ("last_loss", "eval_loss"):
        assert result["rel_diff"][metric] < 0.05
        spread = result["seed_spread"][metric]
        assert spread.keys() == {"bf16_rel_sd", "fp8_rel_sd", "paired_mean", "paired_se"}
        values = {name: [r[metric] for r in rs] for name, rs in runs.items()}
        paired = [f / b - 1 for f, b in zip(values["fp8"], values["bf16"], strict=True)]
        assert spread["paired_mean"] == pytest.approx(sum(paired) / 2)
        assert spread["paired_se"] == pytest.approx(abs(paired[0] - paired[1]) / 2)


def test_seed_spread_needs_two_seeds() -> None:
    run = {"first_loss": 3.0, "last_loss": 1.0}
    assert fp8_accuracy.seed_spread({"bf16": [run], "fp8": [run]}) == {}
