import math

import pytest

from loralei import ConfigError, LoRAConfig
from loralei.config import QATConfig


def test_defaults_and_scale():
    config = LoRAConfig(r=8, lora_alpha=16)
    assert config.scale == 2.0
    assert config.target_modules == "all-linear"
    assert LoRAConfig(r=16, lora_alpha=32, use_rslora=True).scale == pytest.approx(32 / math.sqrt(16))


@pytest.mark.parametrize(
    ("kwargs", "field", "hint"),
    [
        ({"r": 0}, "r:", "positive integer"),
        ({"r": -3}, "r:", "positive integer"),
        ({"lora_alpha": 0}, "lora_alpha:", "> 0"),
        ({"lora_alpha": -1.5}, "lora_alpha:", "> 0"),
        ({"lora_dropout": 1.0}, "lora_dropout:", "[0, 1)"),
        ({"lora_dropout": -0.1}, "lora_dropout:", "[0, 1)"),
        ({"target_modules": []}, "target_modules:", "non-empty list"),
        ({"target_modules": "q_proj(["}, "target_modules:", "regular expression"),
        ({"layers_to_transform": [-1]}, "layers_to_transform:", ">= 0"),
        ({"init_lora_weights": "pissa2"}, "init_lora_weights", "gaussian"),
    ],
)
def test_bad_values_name_field_value_and_fix(kwargs, field, hint):
    with pytest.raises(ConfigError) as err:
        LoRAConfig(**kwargs)
    message = str(err.value)
    assert field in message and hint in message
    assert repr(next(iter(kwargs.values()))) in message


def test_unknown_key_suggests_the_right_one():
    with pytest.raises(ConfigError, match=r'lora_alhpa: unknown key \(did you mean "lora_alpha"\?\)'):
        LoRAConfig(lora_alhpa=16)


def test_all_errors_reported_together():
    with pytest.raises(ConfigError) as err:
        LoRAConfig(r=0, lora_alpha=-1, lora_dropout=2)
    assert len(str(err.value).splitlines()) == 4  # header + three problems


def test_single_layer_index_becomes_list():
    assert LoRAConfig(layers_to_transform=1).layers_to_transform == [1]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"nf4_kernel": "triton"}, "config: nf4_kernel='triton' has no effect without quantize_base=True"),
        ({"nf4_block_size": 32}, "config: nf4_block_size=32 has no effect without quantize_base=True"),
        ({"quantization_device": "cuda"}, "has no effect without quantize_base=True"),
        (
            {"quantize_base": True, "nf4_kernel": "tilelang"},
            "nf4_kernel: tilelang is not used: loralei's fused",
        ),
        (
            {"quantize_base": True, "nf4_kernel": "tritn"},
            "nf4_kernel: must be 'dequantize' or 'triton', e.g. nf4_kernel: dequantize (got 'tritn') (did you mean \"triton\"?)",
        ),
        (
            {"quantize_base": True, "quantization_type": "fp3"},
            "quantization_type: must be 'nf4', 'int4' or 'fp8', e.g. quantization_type: nf4 (got 'fp3')",
        ),
        (
            {"quantize_base": True, "quantization_type": "int4", "int4_group_size": 48},
            "int4_group_size: must be 32, 64, 128 or 256, e.g. int4_group_size: 128 (got 48)",
        ),
        ({"int4_group_size": 64}, "config: int4_group_size=64 has no effect without quantize_base=True"),
        (
            {"quantize_base": True, "quantization_type": "int4", "nf4_block_size": 32},
            "config: nf4_block_size applies to quantization_type='nf4', not 'int4'; remove it",
        ),
        (
            {"quantize_base": True, "int4_group_size": 64},
            "config: int4_group_size applies to quantization_type='int4', not 'nf4'; remove it",
        ),
        (
            {"quantize_base": True, "fp8_kernel": "emulated"},
            "config: fp8_kernel applies to quantization_type='fp8', not 'nf4'; remove it",
        ),
        (
            {"quantize_base": True, "quantization_type": "int4", "fp8_kernel": "emulated"},
            "config: fp8_kernel applies to quantization_type='fp8', not 'int4'; remove it",
        ),
        (
            {"quantize_base": True, "quantization_type": "fp8", "nf4_kernel": "triton"},
            "config: nf4_kernel applies to quantization_type='nf4', not 'fp8'; remove it",
        ),
        (
            {"fp8_kernel": "emulated"},
            "config: fp8_kernel='emulated' has no effect without quantize_base=True",
        ),
        (
            {"fp8_fast_accum": False},
            "config: fp8_fast_accum=False has no effect without quantize_base=True",
        ),
        (
            {"quantize_base": True, "fp8_fast_accum": False},
            "config: fp8_fast_accum applies to quantization_type='fp8', not 'nf4'; remove it",
        ),
        (
            {"quantize_base": True, "quantization_type": "fp8", "fp8_kernel": "scaled_mm"},
            "fp8_kernel: must be 'auto' or 'emulated', e.g. fp8_kernel: auto (got 'scaled_mm')",
        ),
        ({"quantize_base": True, "nf4_block_size": 7}, "nf4_block_size: must be an even integer >= 2"),
        (
            {"quantize_base": True, "nf4_scaler_block_size": 0},
            "nf4_scaler_block_size: must be an even integer",
        ),
        ({"quantize_base": True, "quantization_device": "gpu"}, "quantization_device: is not a torch device"),
    ],
)
def test_quantization_settings_are_checked(kwargs, message):
    with pytest.raises(ConfigError) as err:
        LoRAConfig(**kwargs)
    assert message in str(err.value)


def test_quantization_config_round_trips_through_its_dump():
    config = LoRAConfig(quantize_base=True, nf4_block_size=32, nf4_kernel="triton", quantization_device="cpu")
    assert LoRAConfig(**config.model_dump(mode="json")) == config
    assert LoRAConfig(**LoRAConfig().model_dump(mode="json")) == LoRAConfig()
    fp8 = LoRAConfig(quantize_base=True, quantization_type="fp8", fp8_kernel="emulated")
    assert LoRAConfig(**fp8.model_dump(mode="json")) == fp8


@pytest.mark.parametrize("name", list(LoRAConfig.model_fields))
def test_every_field_of_a_wrong_type_names_itself_the_value_and_an_example(name):
    wrong = 5 if name == "qat" else {"nested": [1]}  # qat alone takes a mapping
    with pytest.raises(ConfigError) as err:
        LoRAConfig(**{name: wrong})
    lines = str(err.value).splitlines()[1:]
    assert len(lines) == 1 and lines[0].startswith(f"{name}: must be "), lines
    assert f", e.g. {name}: " in lines[0] and lines[0].endswith(f"(got {wrong!r})"), lines


def test_a_wrong_type_names_the_fix_not_pydantics_wording():
    with pytest.raises(ConfigError) as err:
        LoRAConfig(r="eight", target_modules=3)
    assert str(err.value).splitlines()[1:] == [
        "r: must be a whole number, e.g. r: 16 (got 'eight')",
        "target_modules: must be a list of strings or a string, e.g. target_modules: [q_proj, v_proj] (got 3)",
    ]


def test_quantization_device_must_name_a_device():
    assert LoRAConfig(quantize_base=True, quantization_device="cuda:1").quantization_device == "cuda:1"
    for bad in ("gpu", "cuda:x", "cuda1"):
        with pytest.raises(ConfigError, match="quantization_device: is not a torch device"):
            LoRAConfig(quantize_base=True, quantization_device=bad)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"qat": {"weight": "int4", "group_size": 48}}, "qat: group_size=48: int4 takes 32, 64, 128 or 256"),
        ({"qat": {"weight": "nvfp4", "group_size": 32}}, "qat: group_size=32: nvfp4 takes 16;"),
        (
            {"qat": {"weight": "fp8", "group_size": 64}},
            "does not apply to weight='fp8' (one scale per output row)",
        ),
        ({"qat": {"weight": "nf4", "group_size": 7}}, "nf4 takes an even group size >= 2"),
        ({"qat": {"weight": "int4", "scaler_block_size": 8}}, "scaler_block_size applies to weight='nf4'"),
        ({"qat": {"weight": "int8"}}, "qat.weight: must be 'int4', 'nf4', 'fp8' or 'nvfp4'"),
        ({"qat": {"weight": "int4"}, "quantize_base": True}, "qat needs the dense base it will merge into"),
        ({"qat": {"weight": "int4"}, "lora_dropout": 0.1}, "qat cannot combine with lora_dropout=0.1"),
        (
            {"qat": {"weight": "int4"}, "target_parameters": ["experts.down_proj"]},
            "qat covers target_modules only",
        ),
        ({"qat": {"weight": "int4"}, "use_dora": True}, "use_dora=True and qat cannot combine"),
    ],
)
def test_qat_settings_are_checked(kwargs, message):
    with pytest.raises(ConfigError) as err:
        LoRAConfig(**kwargs)
    assert message in str(err.value)


def test_qat_defaults_and_round_trip():
    config = LoRAConfig(qat={"weight": "nf4", "scaler_block_size": 8})
    assert (config.qat.group, config.qat.scaler_block) == (64, 8)
    assert [QATConfig(weight=w).group for w in ("int4", "nf4", "fp8", "nvfp4")] == [128, 64, None, 16]
    assert LoRAConfig(**config.model_dump(mode="json")) == config
