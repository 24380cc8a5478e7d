"""The run-config schema: unknown keys, wrong types, aliases, overrides, all errors at once, shipped examples."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from loralei.config import LoRAConfig
from loralei.errors import ConfigError
from loralei.train.loading import apply_overrides, load_config, parse_override
from loralei.train.schema import validate_config

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def minimal(**extra):
    return {"model": {"name_or_path": "m"}, "data": {"path": "d.jsonl"}, "output_dir": "out", **extra}


def problems(raw) -> list[str]:
    with pytest.raises(ConfigError) as info:
        validate_config(raw)
    return [line.strip() for line in str(info.value).splitlines()[1:]]


def test_minimal_config_gets_defaults():
    cfg = validate_config(minimal())
    assert cfg.lora == LoRAConfig()
    assert cfg.training.loss == "auto" and cfg.optimizer.name == "adamw"
    assert cfg.attn_implementation == "sdpa" and cfg.wandb_settings is None


@pytest.mark.parametrize(
    ("raw", "line"),
    [
        (minimal(trainig={}), 'trainig: unknown key (did you mean "training"?)'),
        (
            minimal(model={"name_or_path": "m", "dtyp": "bf16"}),
            'model.dtyp: unknown key (did you mean "dtype"?)',
        ),
        (minimal(lora={"lora_alph": 8}), 'lora.lora_alph: unknown key (did you mean "lora_alpha"?)'),
        (
            minimal(training={"max_seq_lenght": 8}),
            'training.max_seq_lenght: unknown key (did you mean "max_seq_length"?)',
        ),
        (
            minimal(training={"cut_cross_entropy": {"imp": "cce"}}),
            'training.cut_cross_entropy.imp: unknown key (did you mean "impl"?)',
        ),
        (
            minimal(optimizer={"schedul": "cosine"}),
            'optimizer.schedul: unknown key (did you mean "schedule"?)',
        ),
        (minimal(wandb={"projet": "x"}), 'wandb.projet: unknown key (did you mean "project"?)'),
        (minimal(training={"lr": 1e-3}), 'training.lr: unknown key (did you mean "optimizer.lr"?)'),
    ],
)
def test_unknown_keys_at_every_level_suggest_the_right_one(raw, line):
    assert any(p.startswith(line) for p in problems(raw)), problems(raw)


def test_all_errors_are_reported_at_once_one_line_each():
    raw = minimal(
        lora={"r": 0},
        training={"max_seq_length": 1, "batch_size": "two", "packing": "maybe", "fused_shared_input_lora": 3},
        optimizer={"name": "adam", "lr": -1},
    )
    del raw["output_dir"]
    lines = problems(raw)
    assert sorted(line.split(":")[0] for line in lines) == sorted(
        [
            "lora.r",
            "training.max_seq_length",
            "training.packing",
            "training.fused_shared_input_lora",
            "training.batch_size",
            "optimizer.name",
            "optimizer.lr",
            "output_dir",
        ]
    )
    by_key = dict(line.split(": ", 1) for line in lines)
    assert by_key["training.max_seq_length"] == (
        "must be a whole number >= 2, e.g. training.max_seq_length: 2048 (got 1)"
    )
    assert (
        by_key["training.batch_size"]
        == "must be a whole number >= 1, e.g. training.batch_size: 8 (got 'two')"
    )
    assert by_key["training.fused_shared_input_lora"].startswith(
        "must be true, false or a list of mappings with keys parent_name and projection_names, e.g. "
    )
    assert by_key["training.fused_shared_input_lora"].endswith("(got 3)")
    assert "'adamw'" in by_key["optimizer.name"]
    assert by_key["output_dir"] == "is required but missing, e.g. output_dir: outputs/run"


def test_aliases():
    raw = minimal(training={"loss": "cce", "report_to": "wandb"}, model={"path": "m", "dtype": "bf16"})
    cfg = validate_config(raw)
    assert cfg.training.loss == "cut_cross_entropy"
    assert cfg.model.name_or_path == "m" and cfg.model.dtype == "bfloat16"
    assert cfg.wandb_settings is not None and cfg.wandb_settings.project == "loralei"


def test_dataset_is_an_alias_of_data(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(
        yaml.safe_dump({"model": {"name_or_path": "m"}, "dataset": {"path": "x"}, "output_dir": "o"})
    )
    assert load_config(path).data.path == "x"
    assert load_config(path, ["data.split=train[:10]"]).data.split == "train[:10]"
    path.write_text(yaml.safe_dump({"data": {"path": "x"}, "dataset": {"path": "y"}}))
    with pytest.raises(ConfigError, match="both 'data' and its alias 'dataset'"):
        load_config(path)


def test_cross_field_problems():
    lines = problems(minimal(model={"name_or_path": "m", "dtype": "fp16"}))
    assert lines[0].startswith("lora.lora_fp32_gradients: must be true with model.dtype float16")
    lines = problems(
        minimal(
            model={"name_or_path": "m", "attn_implementation": "eager"},
            training={"attn_implementation": "sdpa"},
        )
    )
    assert lines[0].startswith("training.attn_implementation: 'sdpa' contradicts model.attn_implementation")
    assert problems(minimal(wandb=False, training={"report_to": ["wandb"]}))[0].startswith(
        "wandb: false contradicts"
    )


@pytest.mark.parametrize(
    ("settings", "line"),
    [
        (
            {"training": {"torch_compile": True}},
            "training.cuda_graphs: true and torch_compile: true cannot be",
        ),
        (
            {"training": {"distributed": "fsdp2"}},
            "training.cuda_graphs: true does not run with distributed: fsdp2",
        ),
        (
            {"model": {"name_or_path": "m", "dtype": "fp16"}, "lora": {"lora_fp32_gradients": True}},
            "training.cuda_graphs: true does not run with model.dtype float16",
        ),
    ],
)
def test_cuda_graphs_true_with_what_cannot_replay_a_graph(settings, line):
    raw = minimal(**settings)
    raw["training"] = {**raw.get("training", {}), "cuda_graphs": True}
    assert [p[: len(line)] for p in problems(raw)] == [line]


EXPERT_BANKS = ["experts.gate_up_proj", "experts.down_proj"]


def test_target_parameters_reach_the_lora_config():
    cfg = validate_config(minimal(lora={"target_modules": ["q_proj"], "target_parameters": EXPERT_BANKS}))
    assert cfg.lora.target_parameters == EXPERT_BANKS and cfg.lora.target_modules == ["q_proj"]
    alone = validate_config(minimal(lora={"target_parameters": EXPERT_BANKS})).lora
    assert alone.target_parameters == EXPERT_BANKS and alone.target_modules is None  # experts only
    override = "lora.target_parameters=[experts.gate_up_proj, experts.down_proj]"
    assert validate_config(apply_overrides(minimal(), [override])).lora.target_parameters == EXPERT_BANKS


def test_lora_dropout_with_target_parameters_names_both_fields():
    lines = problems(minimal(lora={"lora_dropout": 0.05, "target_parameters": EXPERT_BANKS}))
    assert len(lines) == 1
    assert lines[0].startswith("lora.lora_dropout: 0.05 cannot be combined with lora.target_parameters")
    assert "set lora.lora_dropout: 0.0" in lines[0]
    # the rest of the section is still checked, and reported with it
    lines = problems(minimal(lora={"r": 0, "lora_dropout": 0.05, "target_parameters": EXPERT_BANKS}))
    assert [line.split(":")[0] for line in lines] == ["lora.lora_dropout", "lora.r"]
    # dropout on linear modules alone is fine
    assert validate_config(minimal(lora={"lora_dropout": 0.05})).lora.lora_dropout == 0.05


def test_fp8_bases_are_accepted_and_their_setting_is_checked():
    raw = minimal(
        **yaml.safe_load("lora: {quantize_base: true, quantization_type: fp8, fp8_kernel: emulated}")
    )
    lora = validate_config(raw).lora
    assert lora.quantize_base and lora.quantization_type == "fp8" and lora.fp8_kernel == "emulated"
    assert (
        validate_config(minimal(lora={"quantize_base": True, "quantization_type": "fp8"})).lora.fp8_kernel
        == "auto"
    )
    assert problems(minimal(lora={"quantize_base": True, "fp8_kernel": "emulated"})) == [
        "lora: fp8_kernel applies to quantization_type='fp8', not 'nf4'; remove it"
    ]
    lines = problems(
        minimal(lora={"quantize_base": True, "quantization_type": "fp8", "fp8_kernel": "triton"})
    )
    assert lines == [
        "lora.fp8_kernel: must be 'auto' or 'emulated', e.g. lora.fp8_kernel: auto (got 'triton')"
    ]


@pytest.mark.parametrize(
    ("lora", "line"),
    [
        (
            {"target_parameters": []},
            "lora.target_parameters: must be a non-empty list of parameter-name suffixes",
        ),
        (
            {"target_parameters": "experts.down_proj"},
            "lora.target_parameters: must be a list of strings, e.g. lora.target_parameters: [experts.gate_up_proj, "
            "experts.down_proj] (got 'experts.down_proj')",
        ),
        ({"target_parameters": ["experts."]}, "lora.target_parameters: must be a non-empty list"),
        (
            {"target_modules": None},
            "lora: target_modules and target_parameters are both empty: nothing would be adapted",
        ),
    ],
)
def test_bad_target_parameters_are_reported_under_lora(lora, line):
    lines = problems(minimal(lora=lora))
    assert len(lines) == 1 and lines[0].startswith(line), lines


def test_overrides_are_dotted_and_yaml_typed():
    assert parse_override("optimizer.lr=1e-3") == (["optimizer", "lr"], 1e-3)
    assert parse_override("lora.target_modules=[q_proj, v_proj]") == (
        ["lora", "target_modules"],
        ["q_proj", "v_proj"],
    )
    assert parse_override("training.resume_from_checkpoint=true")[1] is True
    raw = apply_overrides(
        minimal(wandb=False), ["training.max_steps=5", "wandb.project=demo", "dataset.split=x"]
    )
    cfg = validate_config(raw)
    assert cfg.training.max_steps == 5 and cfg.wandb.project == "demo" and cfg.data.split == "x"


@pytest.mark.parametrize("bad", ["training.max_steps", "=3", "training..x=1", "a.b=[unclosed"])
def test_malformed_overrides(bad):
    with pytest.raises(ConfigError, match="override"):
        apply_overrides(minimal(), [bad])


def test_override_cannot_descend_into_a_value():
    with pytest.raises(ConfigError, match="output_dir is 'out', not a section"):
        apply_overrides(minimal(), ["output_dir.x=1"])


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config(tmp_path / "list.yaml")
    (tmp_path / "broken.yaml").write_text("model: {name: [\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(tmp_path / "broken.yaml")


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_example_is_a_valid_config(path):
    cfg = load_config(path)
    assert cfg.output_dir.startswith("outputs/")


def test_examples_exist():
    names = {p.name for p in EXAMPLES.glob("*.yaml")}
    assert {
        "quickstart.yaml",
        "quickstart-moe.yaml",
        "quickstart-dpo.yaml",
        "qwen3-0.6b.yaml",
        "packed-parquet.yaml",
    } <= names


@pytest.mark.parametrize("init", ["pissa", "pissa_niter_4", "olora"])
def test_pissa_and_olora_inits_are_accepted(init):
    assert validate_config(minimal(lora={"init_lora_weights": init})).lora.init_lora_weights == init


@pytest.mark.parametrize(
    ("lora", "line"),
    [
        (
            {"init_lora_weights": "pisa"},
            'lora.init_lora_weights: must be true, false, "gaussian", "pissa", "pissa_niter_<K>"',
        ),
        (
            {"init_lora_weights": "olora", "target_parameters": EXPERT_BANKS},
            "lora: init_lora_weights='olora' cannot apply to target_parameters (expert banks)",
        ),
    ],
)
def test_bad_principal_inits_are_reported_under_lora(lora, line):
    lines = problems(minimal(lora=lora))
    assert len(lines) == 1 and lines[0].startswith(line), lines
