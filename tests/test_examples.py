import json
import math
import runpy
from pathlib import Path

import pytest

from loralei import cli

ROOT = Path(__file__).parents[1]
EXAMPLES = ROOT / "examples"


def test_api_tour_runs(capsys):
    runpy.run_path(str(EXAMPLES / "api_tour.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert "unmerge restores weights bit for bit: True" in out
    assert out.count("max |Δlogits| = 0.00e+00") == 2


def test_the_dpo_quickstart_starts_at_ln2_and_raises_the_margin(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(ROOT)
    out = tmp_path / "dpo"
    args = [str(EXAMPLES / "quickstart-dpo.yaml"), f"output_dir={out}", "training.max_steps=30"]
    assert cli.main([*args, "training.logging_steps=1"]) == 0, capsys.readouterr().err
    log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert log[0]["loss"] == pytest.approx(math.log(2), abs=1e-6) and abs(log[0]["rewards/margins"]) < 1e-6
    first, last = (sum(r["rewards/margins"] for r in part) / 5 for part in (log[:5], log[-5:]))
    assert last > first + 0.5 and log[-1]["rewards/accuracies"] >= 0.75
    assert (out / "adapter_peft" / "adapter_model.safetensors").is_file()
