"""Preference settings checked before a run starts: each bad value is named with its fix, the reference adapter
is checked before the output directory changes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM

from loralei import LoRAConfig, cli, inject_lora, save_pretrained
from loralei.errors import ConfigError
from loralei.train.schema import validate_config

ROOT = Path(__file__).resolve().parents[3]
DPO_QUICKSTART = ROOT / "examples" / "quickstart-dpo.yaml"
BASE = {"model": {"name_or_path": "m"}, "data": {"path": "d"}, "output_dir": "out"}


def problems(training: dict, **sections) -> str:
    with pytest.raises(ConfigError) as info:
        validate_config({**BASE, "training": training, **sections})
    return str(info.value)


@pytest.mark.parametrize(
    ("training", "sections", "expected"),
    [
        (
            {"objective": "dpo"},
            {"preference": {"beta": 0}},
            r"preference\.beta: must be a number > 0, e\.g\. preference\.beta: 0\.1 \(got 0\)",
        ),
        (
            {"objective": "dpo"},
            {"preference": {"loss_type": "kto"}},
            r"preference\.loss_type: kto is KTO's \(unpaired examples\), not DPO's; set training\.objective: kto",
        ),
        (
            {"objective": "dpo"},
            {"preference": {"loss_type": "hinge", "label_smoothing": 0.1}},
            r"preference\.label_smoothing: 0\.1 is read by loss_type sigmoid, robust, exo_pair, aot and "
            r"aot_unpaired only, not hinge; set it to 0\.0",
        ),
        (
            {"objective": "dpo"},
            {"preference": {"loss_type": ["sigmoid", "sft", "apo_zero_unpaired"]}},
            r"preference\.loss_type: apo_zero_unpaired is KTO's \(unpaired examples\), not DPO's",
        ),
        (
            {"objective": "dpo"},
            {"preference": {"loss_type": []}},
            r"preference\.loss_type: must be 'sigmoid', .*'apo_zero_unpaired' or a list of at least 1 of them, "
            r"e\.g\. "
            r"preference\.loss_type: sigmoid \(got \[\]\)",
        ),
        (
            {"objective": "dpo"},
            {"preference": {"loss_type": ["sigmoid", "sft", "sigmoid"]}},
            r"preference\.loss_type: 'sigmoid' is listed 2 times; list it once",
        ),
        (
            {"objective": "dpo"},
            {"preference": {"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0]}},
            r"preference\.loss_weights: \[1\.0\] has 1 weights for the 2 loss types \['sigmoid', 'sft'\]",
        ),
        (
            {"objective": "dpo"},
            {"preference": {"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0, -1.0]}},
            r"preference\.loss_weights: must be .*>= 0",
        ),
        (
            {"objective": "dpo"},
            {"preference": {"loss_type": "exo_pair"}},
            r"preference\.label_smoothing: 0\.0 with loss_type exo_pair.* needs label_smoothing > 0",
        ),
        (
            {"objective": "dpo"},
            {"preference": {"loss_type": ["sigmoid", "bco_pair"], "f_divergence_type": "js_divergence"}},
            r"preference\.f_divergence_type: js_divergence has no valid form for loss_type bco_pair \(only",
        ),
        (
            {"objective": "dpo"},
            {"preference": {"f_alpha_divergence_coef": 0.3}},
            r"preference\.f_alpha_divergence_coef: 0\.3 is read by f_divergence_type alpha_divergence only",
        ),
        (
            {"objective": "dpo"},
            {"preference": {"loss_type": ["sigmoid", "sft"], "discopop_tau": 0.1}},
            r"preference\.discopop_tau: 0\.1 is read by loss_type discopop only, not sigmoid and sft",
        ),
        (
            {"objective": "orpo"},
            {"preference": {"loss_weights": [1.0]}},
            r"preference\.loss_weights: \[1\.0\] is read by training\.objective dpo only \(it is orpo\); remove it",
        ),
        (
            {"objective": "orpo"},
            {"preference": {"loss_type": "ipo"}},
            r"preference\.loss_type: 'ipo' is read by training\.objective dpo, cpo and kto only \(it is orpo\)",
        ),
        (
            {"objective": "simpo"},
            {"preference": {"reference": "outputs/sft/adapter"}},
            r"preference\.reference: 'outputs/sft/adapter' is read by training\.objective dpo and kto only \(it is simpo\)",
        ),
        (
            {"objective": "simpo"},
            {"preference": {"loss_type": "hinge"}},
            r"preference\.loss_type: 'hinge' is read by training\.objective dpo, cpo and kto only \(it is simpo\)",
        ),
        (
            {"objective": "cpo"},
            {"preference": {"loss_type": "bco_pair"}},
            r"preference\.loss_type: 'bco_pair' is not a loss type of training\.objective cpo; give one of "
            r"sigmoid, hinge, ipo or simpo",
        ),
        (
            {"objective": "cpo"},
            {"preference": {"loss_type": "hinge", "label_smoothing": 0.1}},
            r"preference\.label_smoothing: 0\.1 is read by CPO's loss_type sigmoid and simpo only, not hinge",
        ),
        (
            {"objective": "cpo"},
            {"preference": {"simpo_gamma": 1.0}},
            r"preference\.simpo_gamma: 1\.0 is read by SimPO only .*it is sigmoid\); remove it or set loss_type",
        ),
        (
            {"objective": "dpo"},
            {"preference": {"loss_type": "simpo"}},
            r"preference\.loss_type: 'simpo' is CPO's reference-free loss, not DPO's; set training\.objective: simpo",
        ),
        (
            {"objective": "dpo"},
            {"preference": {"cpo_alpha": 0.0}},
            r"preference\.cpo_alpha: 0\.0 is read by training\.objective cpo and simpo only \(it is dpo\)",
        ),
        (
            {"objective": "dpo"},
            {"preference": {"loss_type": ["aot", "sft"], "use_weighting": True}},
            r"preference\.use_weighting: true does not apply to loss_type aot, which compare the micro-batch's pairs",
        ),
        (
            {"objective": "orpo"},
            {"preference": {"use_weighting": True}},
            r"preference\.use_weighting: True is read by training\.objective dpo only \(it is orpo\)",
        ),
        (
            {"objective": "simpo"},
            {"preference": {"ld_alpha": 0.5}},
            r"preference\.ld_alpha: 0\.5 is read by training\.objective dpo only \(it is simpo\)",
        ),
        (
            {"objective": "orpo"},
            {"preference": {"alpha": 0.25}},
            r"preference\.alpha: 0\.25 is read by training\.objective cpo and simpo only \(it is orpo\)",
        ),
        (
            {"objective": "sft"},
            {"preference": {"beta": 0.2}},
            r"preference: only read with a preference training\.objective \(dpo, orpo, cpo, simpo, kto; it is sft\)",
        ),
        (
            {"objective": "dpo"},
            {"data": {"path": "d", "messages_field": "m"}},
            r"data\.messages_field: 'm' names an SFT",
        ),
        ({"objective": "dpo", "loss": "cce"}, {}, r"training\.loss: cut_cross_entropy is an SFT loss"),
        ({"objective": "ppo"}, {}, r"training\.objective: .*sft"),
        (
            {"objective": "kto", "packing": True},
            {},
            r"training\.packing: true does not run with training\.objective kto: each example's KL sequence .*; "
            r"set packing: false",
        ),
        (
            {"objective": "kto", "batch_size": 1},
            {},
            r"training\.batch_size: 1 is too small for training\.objective kto: .*set batch_size to 2 or more",
        ),
        (
            {"objective": "kto", "batch_size": 2},
            {"preference": {"precompute_reference": True}},
            r"preference\.precompute_reference: true does not run with training\.objective kto: .*remove it",
        ),
        (
            {"objective": "dpo"},
            {"preference": {"desirable_weight": 2.0}},
            r"preference\.desirable_weight: 2\.0 is read by training\.objective kto only \(it is dpo\)",
        ),
        (
            {"objective": "kto", "batch_size": 2},
            {"preference": {"undesirable_weight": 0}},
            r"preference\.undesirable_weight: must be a number > 0",
        ),
        (
            {"objective": "kto", "batch_size": 2},
            {"preference": {"loss_type": "hinge"}},
            r"preference\.loss_type: 'hinge' is not a loss type of training\.objective kto; give kto \(the "
            r"default\) or apo_zero_unpaired",
        ),
        (
            {"objective": "kto", "batch_size": 2},
            {"preference": {"loss_type": "sigmoid"}},
            r"preference\.loss_type: 'sigmoid' is not a loss type of training\.objective kto",
        ),
        (
            {"objective": "kto", "batch_size": 2},
            {"preference": {"loss_type": "apo_zero_unpaired", "precompute_reference": True}},
            r"preference\.precompute_reference: true does not run with training\.objective kto: not built for "
            r"apo_zero_unpaired; remove it",
        ),
        (
            {"objective": "dpo"},
            {"data": {"path": "d", "label_field": "y"}},
            r"data\.label_field: 'y' is read by training\.objective kto only \(it is dpo, which reads prompt / "
            r"chosen / rejected columns",
        ),
        (
            {"objective": "sft"},
            {"data": {"path": "d", "label_field": "y"}},
            r"data\.label_field: only read with a preference training\.objective",
        ),
        (
            {"objective": "kto", "batch_size": 2},
            {"data": {"path": "d", "messages_field": "m"}},
            r"data\.messages_field: 'm' names an SFT column; training\.objective kto reads prompt / completion / "
            r"label columns",
        ),
        (
            {"objective": "dpo", "sequence_parallel_size": 2},
            {"preference": {"ld_alpha": 0.5}},
            r"preference\.ld_alpha: 0\.5 does not run with training\.sequence_parallel_size 2 yet: LD-DPO weighs a "
            r"token by its place in its completion.*remove ld_alpha or set sequence_parallel_size: 1",
        ),
    ],
)
def test_bad_preference_settings_are_named_with_their_fix(training, sections, expected) -> None:
    message = problems(training, **sections)
    assert re.search(expected, message), message


def test_cuda_graphs_true_is_taken_by_every_preference_objective() -> None:
    """The schema leaves it to the run, which refuses it only where no graph can serve (no CUDA device, ...)."""
    for objective in ("dpo", "orpo", "cpo", "simpo", "kto"):
        training = {"objective": objective, "cuda_graphs": True, "pad_to_max_length": True, "batch_size": 2}
        assert validate_config({**BASE, "training": training}).training.cuda_graphs is True


def test_kto_reads_completion_and_label_columns() -> None:
    data = {"path": "d", "prompt_field": "q", "completion_field": "a", "label_field": "good"}
    cfg = validate_config({**BASE, "data": data, "training": {"objective": "kto", "batch_size": 2}})
    assert (cfg.data.completion_field, cfg.data.label_field) == ("a", "good")


def run(args: list[str], capsys) -> tuple[int, str]:
    code = cli.main([str(DPO_QUICKSTART), *args])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def test_a_missing_reference_adapter_is_refused_before_anything_loads(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(ROOT)
    out = tmp_path / "run"
    code, text = run([f"output_dir={out}", f"preference.reference={tmp_path / 'nowhere'}"], capsys)
    assert code == 2 and "preference.reference: " in text and "adapter_off" in text
    assert not out.exists()


def test_an_adapter_of_another_rank_is_refused_before_the_output_directory_changes(
    tmp_path, monkeypatch, capsys
) -> None:
    monkeypatch.chdir(ROOT)
    model = AutoModelForCausalLM.from_pretrained(ROOT / "examples" / "quickstart" / "model")
    adapter = save_pretrained(
        inject_lora(model, LoRAConfig(r=4, target_modules="all-linear")), tmp_path / "r4"
    )
    out = tmp_path / "run"
    code, text = run([f"output_dir={out}", f"preference.reference={adapter}"], capsys)
    assert code == 2 and "preference.reference: " in text and "r=4" in text
    assert not out.exists()
