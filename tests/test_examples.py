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


@pytest.fixture
def dpo_quickstart(tmp_path, monkeypatch, capsys):
    """Runs the DPO quickstart with overrides, logging every step, into ``tmp_path / "run"``: ``validate`` first
    where a run line is given (it must be in the output), then the run; returns the log's records."""
    monkeypatch.chdir(ROOT)

    def run(overrides: list[str], line: str | None = None) -> list[dict]:
        out = tmp_path / "run"
        args = [str(EXAMPLES / "quickstart-dpo.yaml"), f"output_dir={out}", *overrides]
        if line is not None:
            assert cli.main(["validate", *args]) == 0, capsys.readouterr().err
            assert line in capsys.readouterr().out
        assert cli.main([*args, "training.logging_steps=1"]) == 0, capsys.readouterr().err
        return [json.loads(record) for record in (out / "log.jsonl").read_text().splitlines()]

    return run


def margin_rise(log: list[dict]) -> float:
    """The mean preference margin of the last five steps minus that of the first five."""
    first, last = (sum(r["rewards/margins"] for r in part) / 5 for part in (log[:5], log[-5:]))
    return last - first


def test_the_dpo_quickstart_starts_at_ln2_and_raises_the_margin(dpo_quickstart, tmp_path) -> None:
    log = dpo_quickstart(["training.max_steps=30"])
    assert log[0]["loss"] == pytest.approx(math.log(2), abs=1e-6) and abs(log[0]["rewards/margins"]) < 1e-6
    assert margin_rise(log) > 0.5 and log[-1]["rewards/accuracies"] >= 0.75
    assert (tmp_path / "run" / "adapter_peft" / "adapter_model.safetensors").is_file()


def test_the_dpo_quickstart_runs_rpo_as_a_weighted_list_of_loss_types(dpo_quickstart) -> None:
    """``loss_type: [sigmoid, sft]`` (RPO): the run line names the sum, and the first loss is ln 2 plus the chosen
    completions' mean token loss under the base model (their summed log-probabilities over their tokens)."""
    overrides = ["preference.loss_type=[sigmoid, sft]", "preference.loss_weights=[1.0, 0.5]"]
    line = "objective dpo (beta 0.1, loss_type 1 sigmoid + 0.5 sft, reference adapter_off)"
    log = dpo_quickstart([*overrides, "training.max_steps=1", "optimizer.warmup_steps=0"], line)
    assert log[0]["loss"] > math.log(2) + 0.5 and abs(log[0]["rewards/margins"]) < 1e-6


def test_the_dpo_quickstart_trains_ld_dpo_with_a_precomputed_reference(dpo_quickstart) -> None:
    """LD-DPO (``preference.ld_alpha``) through the runner's setup, the reference precomputed with the same
    weighting: the run line names it, the first step is ln 2 (the policy is the reference), the margin rises."""
    overrides = ["preference.ld_alpha=0.5", "preference.precompute_reference=true", "training.max_steps=40"]
    log = dpo_quickstart(
        overrides, "objective dpo (beta 0.1, loss_type sigmoid, ld_alpha 0.5, reference adapter_off)"
    )
    assert log[0]["loss"] == pytest.approx(math.log(2), abs=1e-4) and margin_rise(log) > 0.5


def test_the_dpo_quickstart_weighs_pairs_with_wpo(dpo_quickstart) -> None:
    """WPO (``preference.use_weighting``) through the runner: the run line names it, and the first step's loss is
    ln 2 (each pair's, the policy being the reference) times the pairs' mean weight, which the log records."""
    overrides = ["preference.use_weighting=true", "training.max_steps=1", "optimizer.warmup_steps=0"]
    log = dpo_quickstart(
        overrides, "objective dpo (beta 0.1, loss_type sigmoid, WPO weighting, reference adapter_off)"
    )
    assert 0 < log[0]["wpo_weight"] < 1 and abs(log[0]["rewards/margins"]) < 1e-6
    assert log[0]["loss"] == pytest.approx(math.log(2) * log[0]["wpo_weight"], rel=1e-4)


def test_the_dpo_quickstart_trains_with_simpo_without_a_reference(dpo_quickstart) -> None:
    """``training.objective: simpo`` on the DPO quickstart's pairs (its DPO settings are defaults, so they pass):
    no reference pass, the margin between the length-normalised log-probabilities rises, the NLL term is logged."""
    overrides = ["training.objective=simpo", "preference.beta=2.0", "training.max_steps=30"]
    log = dpo_quickstart(
        overrides, "objective simpo (beta 2.0, loss_type simpo, simpo_gamma 0.5, cpo_alpha 1.0)"
    )
    assert margin_rise(log) > 2 and log[-1]["rewards/accuracies"] >= 0.75
    assert log[-1]["nll_loss"] < log[0]["nll_loss"]


def test_the_dpo_quickstart_trains_with_alphapo(dpo_quickstart) -> None:
    """AlphaPO as its paper runs it (SimPO without the NLL term, ``preference.alpha: 0.25``): the run line names
    α, and the margin between the rewards (1 - p^-α)/α of the completions rises."""
    overrides = ["training.objective=simpo", "preference.beta=2.0", "preference.cpo_alpha=0"]
    overrides += ["preference.alpha=0.25", "training.max_steps=30"]
    line = "objective simpo (beta 2.0, loss_type simpo, simpo_gamma 0.5, cpo_alpha 0.0, AlphaPO alpha 0.25)"
    log = dpo_quickstart(overrides, line)
    assert margin_rise(log) > 2 and log[-1]["rewards/accuracies"] >= 0.75


@pytest.fixture
def kto_quickstart(tmp_path, monkeypatch, capsys):
    """Runs the KTO quickstart with overrides, logging every step: ``validate`` first (its run line must be in the
    output), then the run; returns the log's records."""
    monkeypatch.chdir(ROOT)

    def run(overrides: list[str], loss_type: str = "") -> list[dict]:
        out = tmp_path / "kto"
        args = [str(EXAMPLES / "quickstart-kto.yaml"), f"output_dir={out}", *overrides]
        assert cli.main(["validate", *args]) == 0, capsys.readouterr().err
        line = f"objective kto (beta 0.1{loss_type}, desirable_weight 1.0, undesirable_weight 1.0, reference adapter_off)"
        assert line in capsys.readouterr().out
        assert cli.main([*args, "training.logging_steps=1"]) == 0, capsys.readouterr().err
        return [json.loads(record) for record in (out / "log.jsonl").read_text().splitlines()]

    return run


@pytest.mark.parametrize("data", ["kto.jsonl", "preferences.jsonl"], ids=["unpaired", "pairs"])
def test_the_kto_quickstart_starts_at_one_half_and_separates_the_rewards(kto_quickstart, data) -> None:
    """Unpaired rows, and preference pairs unpaired: the first step's loss is 0.5 (a zero adapter: every log-ratio
    and the KL estimate are 0), then the desirable completions' rewards rise above the undesirable ones'."""
    log = kto_quickstart([f"data.path=examples/quickstart/{data}", "training.max_steps=30"])
    assert log[0]["loss"] == pytest.approx(0.5, abs=1e-6) and abs(log[0]["rewards/margins"]) < 1e-6
    assert log[0]["kl"] == pytest.approx(
        0.0, abs=2e-5
    )  # sums of about -100 from two passes: FP32's last bits
    assert margin_rise(log) > 0.5 and log[-1]["rewards/chosen"] > 0
    assert sum(r["loss"] for r in log[-5:]) / 5 < 0.45


def test_the_kto_quickstart_trains_apo_zero_unpaired_without_kl_sequences(kto_quickstart) -> None:
    """TRL's unpaired APO-zero: no KL term (logged 0), micro batches of one example allowed; the first loss is 0.5
    (1 - σ(0) and σ(0)), then the desirable completions' rewards rise above the undesirable ones'."""
    apo = ["preference.loss_type=apo_zero_unpaired"]
    single = [str(EXAMPLES / "quickstart-kto.yaml"), *apo, "training.batch_size=1"]
    assert cli.main(["validate", *single]) == 0  # no KL sequence to make from another example
    log = kto_quickstart([*apo, "training.max_steps=30"], ", loss_type apo_zero_unpaired")
    assert log[0]["loss"] == pytest.approx(0.5, abs=1e-6) and all(r["kl"] == 0.0 for r in log)
    assert margin_rise(log) > 0.1
