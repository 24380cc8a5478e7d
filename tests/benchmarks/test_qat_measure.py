"""benchmarks/qat_measure.py: each run's config (seed, steps, qat) and the summary over seeds."""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import qat_measure

QUICKSTART = Path(__file__).resolve().parents[2] / "examples" / "quickstart.yaml"


def test_each_run_config_sets_its_seed_steps_and_qat_and_nothing_else(tmp_path):
    base = yaml.safe_load(QUICKSTART.read_text())
    path = qat_measure._run_config(base, tmp_path / "seed3-int4", 3, 40, qat_measure.FORMATS["int4"])
    cfg = yaml.safe_load(path.read_text())
    assert cfg["training"]["seed"] == 3 and cfg["training"]["max_steps"] == 40
    assert cfg["lora"]["qat"] == {"weight": "int4", "group_size": 64}
    assert cfg["output_dir"] == str(tmp_path / "seed3-int4")
    plain = yaml.safe_load(qat_measure._run_config(cfg, tmp_path / "plain", 3, None, None).read_text())
    assert "qat" not in plain["lora"] and plain["optimizer"] == base["optimizer"]


def test_the_qat_runs_get_the_start_step_and_the_plain_runs_none():
    assert qat_measure._qat("int4", 300) == {"weight": "int4", "group_size": 64, "start_step": 300}
    assert qat_measure._qat("int4", 0) == qat_measure.FORMATS["int4"] and qat_measure._qat(None, 300) is None


def test_the_summary_averages_each_model_over_seeds():
    def row(plain, quantized, qat):
        return {
            "plain": {"dense": {"loss": plain, "accuracy": 1.0}, "nf4": {"loss": quantized, "accuracy": 0.5}},
            "qat": {"nf4": {"dense": {"loss": qat, "accuracy": 1.0}, "nf4": {"loss": qat, "accuracy": 1.0}}},
        }

    table = qat_measure._summary([row(1.0, 2.0, 0.5), row(3.0, 4.0, 1.5)], ["nf4"])
    means = {r["model"]: (r["loss_mean"], r["loss_stdev"], r["accuracy_mean"]) for r in table}
    assert means["dense merged, no QAT"] == (2.0, 2**0.5, 1.0)
    assert means["nf4 merged, no QAT"] == (3.0, 2**0.5, 0.5)
    assert means["nf4 merged, QAT"] == (1.0, 2**0.5 / 2, 1.0)
