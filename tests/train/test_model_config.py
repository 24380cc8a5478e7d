"""``model.config_overrides``: RoPE scaling and other config fields set before the runner loads the model, each
RoPE type equal to Transformers' own definition and honoured by loralei's fused RoPE kernel; bad overrides named."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from loralei import LoRAConfig, apply_fused_kernels, inject_lora
from loralei.errors import ConfigError
from loralei.train import build
from loralei.train.model_config import overridden_config
from loralei.train.run import train
from loralei.train.schema import validate_config
from tiny_models import tiny_model

HALF = 4  # the tiny Llama's head_dim (8) / 2: the rotary frequencies
ORIGINAL = 128  # its max_position_embeddings
SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 4.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0},
    "longrope": {"rope_type": "longrope", "short_factor": [1.0] * HALF, "long_factor": [1.5, 2.0, 3.0, 4.0]},
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_model("llama").save_pretrained(path)
    return path


def _cfg(checkpoint: Path, overrides: dict, tmp_path: Path | str = "out"):
    raw = {
        "model": {"name_or_path": str(checkpoint), "dtype": "float32", "config_overrides": overrides},
        "data": {"path": "d"},
        "lora": {"r": 2},
        "output_dir": str(tmp_path),
    }
    return validate_config(raw)


def _overrides(kind: str, length: int) -> dict:
    """The scaling of ``kind``, with the context raised to ``length`` (not for dynamic NTK: it scales only
    past max_position_embeddings, so raising it would turn the scaling off)."""
    longer = {} if kind == "dynamic" else {"max_position_embeddings": length}
    return {"rope_scaling": SCALINGS[kind], **longer}


def _rotary(model: torch.nn.Module, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.zeros(1, length, 32)
    return model.model.rotary_emb(x, torch.arange(length).unsqueeze(0))


@pytest.mark.parametrize("kind", list(SCALINGS))
def test_each_rope_type_loads_as_transformers_defines_it(checkpoint: Path, kind: str) -> None:
    """The overridden model's rotary tables equal those of a model Transformers builds from a config that names
    the same scaling (4× the checkpoint's context), past the original length."""
    length = 4 * ORIGINAL
    model = build.load_model(_cfg(checkpoint, _overrides(kind, length)), torch.device("cpu"))[0]
    params = model.config.rope_parameters
    assert params["rope_type"] == kind
    assert model.config.max_position_embeddings == (ORIGINAL if kind == "dynamic" else length)
    assert params["rope_theta"] == tiny_model("llama").config.rope_parameters["rope_theta"]  # kept
    if kind in ("yarn", "llama3", "longrope"):  # scaled from the checkpoint's context, not the new one
        assert params["original_max_position_embeddings"] == ORIGINAL
    original = (
        {"original_max_position_embeddings": ORIGINAL} if kind in ("yarn", "llama3", "longrope") else {}
    )
    direct = {"rope_scaling": {**SCALINGS[kind], **original}}
    want = tiny_model("llama", max_position_embeddings=model.config.max_position_embeddings, **direct)
    assert want.config.rope_parameters == params
    for got, expected in zip(_rotary(model, length), _rotary(want, length), strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    default = _rotary(tiny_model("llama"), length)
    assert not torch.equal(_rotary(model, length)[0], default[0])  # the scaling changed the tables


@pytest.mark.parametrize("kind", ["yarn", "llama3", "dynamic"])
def test_the_fused_rope_kernel_honours_the_scaled_tables(
    checkpoint: Path, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """loralei's RoPE kernel (Triton interpreter, fp32) inside the fused model gives the unfused model's logits
    on a sequence twice the checkpoint's context."""
    pytest.importorskip("triton")
    from loralei.kernels import rope as rope_kernels

    model = build.load_model(_cfg(checkpoint, _overrides(kind, 4 * ORIGINAL)), torch.device("cpu"))[0]
    inject_lora(model, LoRAConfig(r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    fused = copy.deepcopy(model)
    ids = torch.randint(3, 127, (1, 2 * ORIGINAL), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(input_ids=ids).logits
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    launches = []
    launch = rope_kernels._launch
    monkeypatch.setattr(rope_kernels, "_launch", lambda *a, **k: launches.append(1) or launch(*a, **k))
    apply_fused_kernels(fused)
    with torch.no_grad():
        got = fused(input_ids=ids).logits
    assert launches  # the kernel ran, not the fallback to Transformers
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"max_position_embedings": 512}, r"config_overrides.max_position_embedings: the llama config has no "
         r"field 'max_position_embedings'; did you mean max_position_embeddings"),
        ({"max_position_embeddings": "long"}, r"config_overrides.max_position_embeddings: 'long' is of type str, "
         r"but the llama config's max_position_embeddings is of type int \(128\)"),
        ({"rope_scaling": {"rope_type": "ntk", "factor": 2.0}}, r"config_overrides.rope_scaling.rope_type: 'ntk' "
         r"is not a RoPE type; Transformers has default, linear, dynamic, yarn"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, r"config_overrides.rope_scaling: .*"
         r"(high_freq_factor|low_freq_factor)"),
        ({"rope_scaling": 4.0}, r"config_overrides.rope_scaling: 4.0 is not a mapping"),
    ],
)  # fmt: skip
def test_bad_overrides_are_named_before_any_weight_is_read(checkpoint: Path, overrides: dict, message: str):
    with pytest.raises(ConfigError, match=message):
        build.load_model(_cfg(checkpoint, overrides), torch.device("cpu"))


def test_rope_parameters_and_the_old_type_key_are_read_too() -> None:
    config = tiny_model("llama").config
    got = overridden_config(config, {"rope_parameters": {"type": "linear", "factor": 2.0}})
    assert got.rope_parameters["rope_type"] == "linear" and got.rope_parameters["factor"] == 2.0
    assert overridden_config(config, {}) is config


def test_a_model_passed_to_train_cannot_take_overrides(checkpoint: Path, tmp_path: Path) -> None:
    """Its rotary tables were built with it: the override would be silently ignored, so it is refused."""
    cfg = _cfg(checkpoint, {"rope_scaling": SCALINGS["linear"]}, tmp_path / "run")
    with pytest.raises(ConfigError, match=r"model.config_overrides: the model passed to train\(\) is built"):
        train(
            cfg, model=tiny_model("llama"), dataset=[{"input_ids": [3, 4], "labels": [3, 4]}], collate_fn=list
        )
    assert not (tmp_path / "run").exists()
