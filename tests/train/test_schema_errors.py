"""Config errors that teach: every field's wrong-typed value names the field, the value and a good example; other
tools' key names get loralei's; a warm-up longer than the run is refused when the config is read."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import pytest
from pydantic import BaseModel

from loralei.config import LoRAConfig, QATConfig
from loralei.errors import ConfigError
from loralei.field_errors import _members, _unwrap, example
from loralei.renames import FOREIGN_KEYS, FOREIGN_VALUES, NOT_TAKEN
from loralei.train.loading import load_config
from loralei.train.schema import (
    CutCrossEntropySection,
    DataSection,
    FusedGroup,
    ModelSection,
    OptimizerSection,
    RunConfig,
    TrainingSection,
    WandbSection,
    validate_config,
)

QUICKSTART = Path(__file__).resolve().parents[2] / "examples" / "quickstart.yaml"
SECTIONS: dict[str, type[BaseModel]] = {
    "": RunConfig,
    "model": ModelSection,
    "lora": LoRAConfig,
    "lora.qat": QATConfig,
    "data": DataSection,
    "training": TrainingSection,
    "training.cut_cross_entropy": CutCrossEntropySection,
    "training.fused_shared_input_lora.0": FusedGroup,
    "optimizer": OptimizerSection,
    "wandb": WandbSection,
}
# A value of no field's type: a mapping where a mapping is not taken, else a number.
WRONG_VALUES = ({"nested": [1]}, 5)


def minimal(**extra: Any) -> dict[str, Any]:
    return {"model": {"name_or_path": "m"}, "data": {"path": "d.jsonl"}, "output_dir": "out", **extra}


def problems(raw: dict[str, Any]) -> list[str]:
    with pytest.raises(ConfigError) as info:
        validate_config(raw)
    return [line.strip() for line in str(info.value).splitlines()[1:]]


def _with_value(section: str, key: str, value: Any) -> dict[str, Any]:
    """A minimal config with ``value`` at ``section.key`` (a fused group gets its other key right)."""
    raw = minimal()
    node: Any = raw
    for part in [p for p in section.split(".") if p]:
        if part.isdigit():
            node.append({"parent_name": "model.layers.0.self_attn", "projection_names": ["q_proj", "k_proj"]})
            node = node[int(part)]
        else:
            node = node.setdefault(part, [] if part == "fused_shared_input_lora" else {})
    node[key] = value
    return raw


def _choices(annotation: Any) -> list[str]:
    """How a field's choices are written in its line: booleans as YAML, literals as repr."""
    out = []
    for member in _members(annotation):
        member, _ = _unwrap(member)
        if member is bool:
            out += ["true", "false"]
        elif get_origin(member) is Literal:
            out += [str(c).lower() if isinstance(c, bool) else repr(c) for c in get_args(member)]
    return out


EVERY_FIELD = [(section, name, model) for section, model in SECTIONS.items() for name in model.model_fields]


@pytest.mark.parametrize(
    ("section", "name", "model"), EVERY_FIELD, ids=[f"{s}.{n}".lstrip(".") for s, n, _ in EVERY_FIELD]
)
def test_every_field_names_itself_the_value_and_an_example(section, name, model):
    where = f"{section}.{name}" if section else name
    for value in WRONG_VALUES:  # the first one the field does not take (a section takes a mapping)
        try:
            validate_config(_with_value(section, name, value))
            continue
        except ConfigError as err:
            lines = [line.strip() for line in str(err).splitlines()[1:]]
        at_field = [line for line in lines if line.split(": ", 1)[0] == where]
        if not at_field:
            continue
        [line] = at_field
        assert line.startswith(f"{where}: must be "), line
        assert f"e.g. {where}: " in line and line.endswith(f"(got {value!r})"), line
        assert all(choice in line for choice in _choices(model.model_fields[name].annotation)), line
        return
    pytest.fail(f"{where} took every wrong value")


@pytest.mark.parametrize(
    ("section", "name", "model"), EVERY_FIELD, ids=[f"{s}.{n}".lstrip(".") for s, n, _ in EVERY_FIELD]
)
def test_every_example_is_a_value_the_field_takes(section, name, model):
    where = f"{section}.{name}" if section else name
    good = example(model.model_fields[name])
    try:
        validate_config(_with_value(section, name, good))
    except ConfigError as err:  # a check across fields may still object (eval_steps needs an eval split)
        assert f"  {where}: must be " not in str(err), str(err)


def test_a_wrong_type_reads_as_field_fix_and_value():
    assert problems(minimal(training={"batch_size": "abc"})) == [
        "training.batch_size: must be a whole number >= 1, e.g. training.batch_size: 8 (got 'abc')"
    ]


def test_a_misspelt_choice_gets_a_did_you_mean():
    assert problems(minimal(model={"name_or_path": "m", "dtype": "bfloat61"})) == [
        "model.dtype: must be 'auto', 'float32', 'bfloat16' or 'float16', e.g. model.dtype: bfloat16 "
        "(got 'bfloat61') (did you mean \"bfloat16\"?)"
    ]


def test_every_problem_of_a_file_is_still_reported_at_once():
    raw = minimal(training={"batch_size": "abc", "epochs": 3, "packing": "maybe"}, lora={"rank": 8, "r": "x"})
    assert sorted(line.split(":")[0] for line in problems(raw)) == [
        "lora.r",
        "lora.rank",
        "training.batch_size",
        "training.epochs",
        "training.packing",
    ]


def test_a_union_member_that_reaches_further_explains_the_value():
    lines = problems(minimal(training={"fused_shared_input_lora": [{"parent_name": "x"}]}))
    assert lines == [
        "training.fused_shared_input_lora.0.projection_names: is required but missing, e.g. "
        "training.fused_shared_input_lora.0.projection_names: [q_proj, k_proj, v_proj]"
    ]
    assert problems(minimal(wandb={"projet": "x"})) == [
        'wandb.projet: unknown key (did you mean "project"?); remove it or fix its spelling'
    ]


# Every entry of renames.FOREIGN_KEYS, written where users write it, and the line it gets.
FOREIGN = [
    ({"lora": {"rank": 8}}, 'lora.rank: unknown key (did you mean "r"?)'),
    ({"lora_r": 8}, 'lora_r: unknown key (did you mean "lora.r"?)'),
    ({"lora": {"alpha": 16}}, 'lora.alpha: unknown key (did you mean "lora_alpha"?)'),
    ({"lora": {"dropout": 0.1}}, 'lora.dropout: unknown key (did you mean "lora_dropout"?)'),
    (
        {"lora_target_modules": ["q_proj"]},
        'lora_target_modules: unknown key (did you mean "lora.target_modules"?)',
    ),
    ({"peft_use_dora": True}, 'peft_use_dora: unknown key (did you mean "lora.use_dora"?)'),
    ({"lora": {"dora": True}}, 'lora.dora: unknown key (did you mean "use_dora"?)'),
    ({"learning_rate": 1e-4}, 'learning_rate: unknown key (did you mean "optimizer.lr"?)'),
    (
        {"training": {"learning_rate": 1e-4}},
        'training.learning_rate: unknown key (did you mean "optimizer.lr"?)',
    ),
    ({"optimizer": {"learning_rate": 1e-4}}, 'optimizer.learning_rate: unknown key (did you mean "lr"?)'),
    ({"training": {"lr": 1e-4}}, 'training.lr: unknown key (did you mean "optimizer.lr"?)'),
    ({"training": {"epochs": 3}}, 'training.epochs: unknown key (did you mean "num_epochs"?)'),
    ({"num_train_epochs": 3}, 'num_train_epochs: unknown key (did you mean "training.num_epochs"?)'),
    ({"training": {"max_length": 512}}, 'training.max_length: unknown key (did you mean "max_seq_length"?)'),
    ({"max_seq_len": 512}, 'max_seq_len: unknown key (did you mean "training.max_seq_length"?)'),
    ({"training": {"seq_len": 512}}, 'training.seq_len: unknown key (did you mean "max_seq_length"?)'),
    ({"sequence_len": 512}, 'sequence_len: unknown key (did you mean "training.max_seq_length"?)'),
    (
        {"training": {"per_device_train_batch_size": 8}},
        'training.per_device_train_batch_size: unknown key (did you mean "batch_size"?)',
    ),
    ({"micro_batch_size": 2}, 'micro_batch_size: unknown key (did you mean "training.batch_size"?)'),
    (
        {"training": {"gradient_accumulation": 4}},
        'training.gradient_accumulation: unknown key (did you mean "gradient_accumulation_steps"?)',
    ),
    ({"optimizer": {"warmup": 10}}, 'optimizer.warmup: unknown key (did you mean "warmup_steps"?)'),
    (
        {"training": {"lr_scheduler_type": "cosine"}},
        'training.lr_scheduler_type: unknown key (did you mean "optimizer.schedule"?)',
    ),
    ({"lr_scheduler": "cosine"}, 'lr_scheduler: unknown key (did you mean "optimizer.schedule"?)'),
    ({"optimizer": {"scheduler": "cosine"}}, 'optimizer.scheduler: unknown key (did you mean "schedule"?)'),
    ({"training": {"optim": "adamw"}}, 'training.optim: unknown key (did you mean "optimizer.name"?)'),
    ({"base_model": "m"}, 'base_model: unknown key (did you mean "model.name_or_path"?)'),
    (
        {"model": {"name_or_path": "m", "model_name_or_path": "m"}},
        'model.model_name_or_path: unknown key (did you mean "name_or_path"?)',
    ),
    ({"output": "out"}, 'output: unknown key (did you mean "output_dir"?)'),
    ({"training": {"output": "out"}}, 'training.output: unknown key (did you mean top-level "output_dir"?)'),
    ({"datasets": [{"path": "d"}]}, 'datasets: unknown key (did you mean "data"?)'),
    ({"bf16": True}, 'bf16: unknown key (did you mean "model.dtype: bfloat16"?)'),
    ({"training": {"bf16": True}}, 'training.bf16: unknown key (did you mean "model.dtype: bfloat16"?)'),
    ({"fp16": True}, 'fp16: unknown key (did you mean "model.dtype: float16"?)'),
    (
        {"training": {"weight_decay": 0.01}},
        'training.weight_decay: unknown key (did you mean "optimizer.weight_decay"?)',
    ),
    (
        {"preference": {"rpo_alpha": 1.0}},
        'preference.rpo_alpha: unknown key (did you mean "loss_type: [sigmoid, sft]"?)',
    ),
    (
        {"preference": {"precompute_ref_log_probs": True}},
        'preference.precompute_ref_log_probs: unknown key (did you mean "precompute_reference"?)',
    ),
    ({"preference": {"ref_model": "m"}}, 'preference.ref_model: unknown key (did you mean "reference"?)'),
]


def _merged(extra: dict[str, Any]) -> dict[str, Any]:
    raw = minimal()
    for key, value in extra.items():
        raw[key] = {**raw[key], **value} if isinstance(raw.get(key), dict) else value
    return raw


@pytest.mark.parametrize(("extra", "line"), FOREIGN, ids=[line.split(":")[0] for _, line in FOREIGN])
def test_other_tools_names_point_to_loralei_fields(extra, line):
    assert problems(_merged(extra)) == [f"{line}; remove it or fix its spelling"]


def test_every_foreign_name_is_tested():
    written = set()
    for _, line in FOREIGN:
        where = line.split(":")[0]
        section, _, key = where.rpartition(".")
        written.add((section, key))
    for section, key in FOREIGN_KEYS:
        assert (section, key) in written if section != "*" else any(k == key for _, k in written), key


@pytest.mark.parametrize(("section", "key"), list(NOT_TAKEN))
def test_other_tools_names_for_what_loralei_does_not_do_say_so(section, key):
    line = f"{section}.{key}: unknown key ({NOT_TAKEN[(section, key)]}); remove it or fix its spelling"
    assert problems(_merged({section: {key: 1}})) == [line]


@pytest.mark.parametrize(
    ("extra", "line"),
    [
        ({"training": {"max_grad_norm": math.inf}}, "training.max_grad_norm: must be a finite number > 0"),
        ({"preference": {"beta": math.nan}}, "preference.beta: must be a finite number > 0"),
        ({"preference": {"alpha": -math.inf}}, "preference.alpha: must be a finite number, e.g."),
        ({"lora": {"lora_alpha": math.inf}}, "lora.lora_alpha: must be a finite number"),
    ],
)
def test_infinite_and_nan_numbers_are_refused(extra, line):
    """YAML's .inf and .nan are floats; no setting takes them (a β of inf would train on NaN losses)."""
    (problem,) = problems(_merged(extra))
    assert problem.startswith(line), problem


@pytest.mark.parametrize(("where", "value"), list(FOREIGN_VALUES))
def test_other_tools_values_say_what_loralei_writes(where, value):
    section, _, key = where.partition(".")
    raw = _merged({section: {key: value}, "training": {"objective": "cpo"}})
    (line,) = problems(raw)
    assert line.startswith(f"{where}: must be ") and line.endswith(
        f"(got {value!r}) ({FOREIGN_VALUES[(where, value)]})"
    )


@pytest.mark.parametrize(
    ("kwargs", "line"),
    [
        ({"rank": 8}, 'rank: unknown key (did you mean "r"?)'),
        ({"lora_r": 8}, 'lora_r: unknown key (did you mean "r"?)'),
        ({"alpha": 16}, 'alpha: unknown key (did you mean "lora_alpha"?)'),
        ({"dropout": 0.1}, 'dropout: unknown key (did you mean "lora_dropout"?)'),
        ({"learning_rate": 1e-4}, "learning_rate: unknown key; remove"),  # no optimizer in LoRAConfig's world
    ],
)
def test_lora_config_from_python_suggests_its_own_fields(kwargs, line):
    with pytest.raises(ConfigError) as err:
        LoRAConfig(**kwargs)
    assert str(err.value).splitlines()[1].startswith(line)


def test_warm_up_as_long_as_the_run_is_refused_when_the_config_is_read():
    for warmup in (5, 30):
        lines = problems(minimal(training={"max_steps": 5}, optimizer={"warmup_steps": warmup}))
        assert len(lines) == 1 and lines[0].startswith(
            f"optimizer.warmup_steps: {warmup} is not below training.max_steps 5"
        )
        assert "optimizer.warmup_ratio" in lines[0] and "raise training.max_steps" in lines[0]
    assert validate_config(minimal(training={"max_steps": 5}, optimizer={"warmup_steps": 4}))
    assert validate_config(minimal(training={"max_steps": 5}, optimizer={"warmup_ratio": 0.5}))
    assert validate_config(minimal(optimizer={"warmup_steps": 30}))  # epochs: the data decides the length


def test_the_quickstart_with_a_short_run_fails_at_once_naming_the_fix():
    with pytest.raises(ConfigError, match=r"optimizer\.warmup_steps: 30 is not below training\.max_steps 5"):
        load_config(QUICKSTART, ["training.max_steps=5"])
