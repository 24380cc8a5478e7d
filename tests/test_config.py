import math

import pytest

from loralei import ConfigError, LoRAConfig


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
