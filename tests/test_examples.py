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


def test_the_dpo_quickstart_runs_rpo_as_a_weighted_list_of_loss_types(tmp_path, monkeypatch, capsys) -> None:
    """``loss_type: [sigmoid, sft]`` (RPO): the run line names the sum, and the first loss is ln 2 plus the chosen
    completions' mean token loss under the base model (their summed log-probabilities over their tokens)."""
    monkeypatch.chdir(ROOT)
    out = tmp_path / "rpo"
    overrides = ["preference.loss_type=[sigmoid, sft]", "preference.loss_weights=[1.0, 0.5]"]
    args = [str(EXAMPLES / "quickstart-dpo.yaml"), f"output_dir={out}", "training.max_steps=1", *overrides]
    args += ["optimizer.warmup_steps=0"]
    assert cli.main(["validate", *args]) == 0, capsys.readouterr().err
    assert (
        "objective dpo (beta 0.1, loss_type 1 sigmoid + 0.5 sft, reference adapter_off)"
        in capsys.readouterr().out
    )
    assert cli.main([*args, "training.logging_steps=1"]) == 0, capsys.readouterr().err
    first = json.loads((out / "log.jsonl").read_text().splitlines()[0])
    assert first["loss"] > math.log(2) + 0.5 and abs(first["rewards/margins"]) < 1e-6


def test_the_dpo_quickstart_trains_ld_dpo_with_a_precomputed_reference(tmp_path, monkeypatch, capsys) -> None:
    """LD-DPO (``preference.ld_alpha``) through the runner's setup, the reference precomputed with the same
    weighting: the run line names it, the first step is ln 2 (the policy is the reference), the margin rises."""
    monkeypatch.chdir(ROOT)
    out = tmp_path / "ld-dpo"
    overrides = ["preference.ld_alpha=0.5", "preference.precompute_reference=true", "training.max_steps=40"]
    args = [str(EXAMPLES / "quickstart-dpo.yaml"), f"output_dir={out}", *overrides]
    assert cli.main(["validate", *args]) == 0, capsys.readouterr().err
    line = "objective dpo (beta 0.1, loss_type sigmoid, ld_alpha 0.5, reference adapter_off)"
    assert line in capsys.readouterr().out
    assert cli.main([*args, "training.logging_steps=1"]) == 0, capsys.readouterr().err
    log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert log[0]["loss"] == pytest.approx(math.log(2), abs=1e-4)
    first, last = (sum(r["rewards/margins"] for r in part) / 5 for part in (log[:5], log[-5:]))
    assert last > first + 0.5


def test_the_dpo_quickstart_weighs_pairs_with_wpo(tmp_path, monkeypatch, capsys) -> None:
    """WPO (``preference.use_weighting``) through the runner: the run line names it, and the first step's loss is
    ln 2 times the pairs' weights, each below 1."""
    monkeypatch.chdir(ROOT)
    out = tmp_path / "wpo"
    overrides = ["preference.use_weighting=true", "training.max_steps=1", "optimizer.warmup_steps=0"]
    args = [str(EXAMPLES / "quickstart-dpo.yaml"), f"output_dir={out}", *overrides]
    assert cli.main(["validate", *args]) == 0, capsys.readouterr().err
    assert (
        "objective dpo (beta 0.1, loss_type sigmoid, WPO weighting, reference adapter_off)"
        in capsys.readouterr().out
    )
    assert cli.main([*args, "training.logging_steps=1"]) == 0, capsys.readouterr().err
    first = json.loads((out / "log.jsonl").read_text().splitlines()[0])
    assert 0 < first["loss"] < math.log(2) - 1e-3 and abs(first["rewards/margins"]) < 1e-6


def test_the_dpo_quickstart_trains_with_simpo_without_a_reference(tmp_path, monkeypatch, capsys) -> None:
    """``training.objective: simpo`` on the DPO quickstart's pairs (its DPO settings are defaults, so they pass):
    no reference pass, the margin between the length-normalised log-probabilities rises, the NLL term is logged."""
    monkeypatch.chdir(ROOT)
    out = tmp_path / "simpo"
    args = [str(EXAMPLES / "quickstart-dpo.yaml"), f"output_dir={out}", "training.objective=simpo"]
    args += ["preference.beta=2.0", "training.max_steps=30"]
    assert cli.main(["validate", *args]) == 0, capsys.readouterr().err
    line = "objective simpo (beta 2.0, loss_type simpo, simpo_gamma 0.5, cpo_alpha 1.0)"
    assert line in capsys.readouterr().out
    assert cli.main([*args, "training.logging_steps=1"]) == 0, capsys.readouterr().err
    log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    first, last = (sum(r["rewards/margins"] for r in part) / 5 for part in (log[:5], log[-5:]))
    assert last > first + 2 and log[-1]["rewards/accuracies"] >= 0.75
    assert log[-1]["nll_loss"] < log[0]["nll_loss"]


def test_the_dpo_quickstart_trains_with_alphapo(tmp_path, monkeypatch, capsys) -> None:
    """AlphaPO as its paper runs it (SimPO without the NLL term, ``preference.alpha: 0.25``): the run line names
    α, and the margin between the rewards (1 - p^-α)/α of the completions rises."""
    monkeypatch.chdir(ROOT)
    out = tmp_path / "alphapo"
    args = [str(EXAMPLES / "quickstart-dpo.yaml"), f"output_dir={out}", "training.objective=simpo"]
    args += [
        "preference.beta=2.0",
        "preference.cpo_alpha=0",
        "preference.alpha=0.25",
        "training.max_steps=30",
    ]
    assert cli.main(["validate", *args]) == 0, capsys.readouterr().err
    line = "objective simpo (beta 2.0, loss_type simpo, simpo_gamma 0.5, cpo_alpha 0.0, AlphaPO alpha 0.25)"
    assert line in capsys.readouterr().out
    assert cli.main([*args, "training.logging_steps=1"]) == 0, capsys.readouterr().err
    log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    first, last = (sum(r["rewards/margins"] for r in part) / 5 for part in (log[:5], log[-5:]))
    assert last > first + 2 and log[-1]["rewards/accuracies"] >= 0.75
