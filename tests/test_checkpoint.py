import json
import warnings

import peft
import pytest
import torch
from safetensors.torch import load_file

import loralei.checkpoint as ckpt
from loralei import (
    CheckpointError,
    LoRAConfig,
    inject_lora,
    load_pretrained,
    lora_state_dict,
    save_pretrained,
)
from tiny_models import tiny_batch, tiny_model

CONFIGS = {
    "qv": {"target_modules": ["q_proj", "v_proj"]},
    "all-linear-rslora": {"target_modules": "all-linear", "use_rslora": True, "lora_alpha": 7},
    "layer-subset": {"target_modules": ["q_proj", "down_proj"], "layers_to_transform": [1]},
    "regex-exclude": {
        "target_modules": r".*\.(k|o)_proj",
        "exclude_modules": r".*layers\.0\.self_attn\.k_proj",
    },
}


def adapted(family="llama", **kwargs):
    model = tiny_model(family)
    inject_lora(model, LoRAConfig(**{"r": 4, "init_lora_weights": False, **kwargs}))
    return model


def peft_load(path, family="llama"):
    """Loads with the real PEFT package; returns the model and the adapter keys PEFT found missing/unexpected."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = peft.PeftModel.from_pretrained(tiny_model(family), path)
        result = model.load_adapter(path, adapter_name="check")
    model.set_adapter("default")
    missing = [k for k in result.missing_keys if ".check." in k]
    return model.eval(), missing, list(result.unexpected_keys)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_native_roundtrip(tmp_path, name):
    model = adapted(**CONFIGS[name])
    save_pretrained(model, tmp_path / "a")
    fresh = load_pretrained(tiny_model(), tmp_path / "a")
    batch = tiny_batch()
    torch.testing.assert_close(fresh(**batch).logits, model(**batch).logits, rtol=0, atol=0)
    meta = json.loads((tmp_path / "a" / ckpt.NATIVE_CONFIG).read_text())
    assert meta["format_version"] == ckpt.FORMAT_VERSION
    assert LoRAConfig(**meta["lora_config"]) == LoRAConfig(
        **{"r": 4, "init_lora_weights": False, **CONFIGS[name]}
    )


# Phi-3 has fused qkv_proj / gate_up_proj Linears, so only the all-linear config applies to it.
EXPORT_CASES = [(f, n) for n in sorted(CONFIGS) for f in ("llama", "qwen2")] + [("phi3", "all-linear-rslora")]


@pytest.mark.parametrize(("family", "name"), EXPORT_CASES)
def test_peft_export_loads_in_peft_with_no_missing_keys(tmp_path, name, family):
    model = adapted(family, **CONFIGS[name])
    save_pretrained(model, tmp_path / "p", format="peft")
    peft_model, missing, unexpected = peft_load(tmp_path / "p", family)
    assert missing == [] and unexpected == []
    batch = tiny_batch()
    torch.testing.assert_close(peft_model(**batch).logits, model(**batch).logits, rtol=1e-5, atol=1e-6)


def test_peft_export_follows_vllm_rules(tmp_path):
    save_pretrained(adapted(), tmp_path / "p", format="peft")
    tensors = load_file(tmp_path / "p" / ckpt.PEFT_WEIGHTS)
    assert tensors and all(k.startswith("base_model.model.") for k in tensors)
    assert all(k.endswith((".lora_A.weight", ".lora_B.weight")) for k in tensors)
    config = json.loads((tmp_path / "p" / ckpt.PEFT_CONFIG).read_text())
    assert config["peft_type"] == "LORA" and config["bias"] == "none" and not config["use_dora"]
    assert config["modules_to_save"] is None


@pytest.mark.parametrize("name", ["qv", "all-linear-rslora", "layer-subset"])
def test_adapter_saved_by_peft_loads_with_peft_logits(tmp_path, name):
    options = dict(CONFIGS[name])
    peft_config = peft.LoraConfig(
        r=4, lora_alpha=options.pop("lora_alpha", 8), init_lora_weights=False, **options
    )
    peft_model = peft.get_peft_model(tiny_model(), peft_config).eval()
    peft_model.save_pretrained(tmp_path / "from-peft")
    ours = load_pretrained(tiny_model(), tmp_path / "from-peft")
    batch = tiny_batch()
    torch.testing.assert_close(ours(**batch).logits, peft_model(**batch).logits, rtol=1e-5, atol=1e-6)


def test_save_is_atomic_when_writing_fails(tmp_path, monkeypatch):
    model = adapted()
    save_pretrained(model, tmp_path / "a")
    before = {p.name: p.read_bytes() for p in (tmp_path / "a").iterdir()}
    with torch.no_grad():
        for p in lora_state_dict(model).values():
            p.add_(1.0)

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(ckpt, "save_file", crash)
    with pytest.raises(OSError, match="disk full"):
        save_pretrained(model, tmp_path / "a")
    assert {p.name: p.read_bytes() for p in (tmp_path / "a").iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["a"]  # no temporary directory left behind
    load_pretrained(tiny_model(), tmp_path / "a")


def test_save_replaces_an_existing_adapter(tmp_path):
    model = adapted()
    save_pretrained(model, tmp_path / "a")
    save_pretrained(model, tmp_path / "a", format="peft")
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == [ckpt.PEFT_CONFIG, ckpt.PEFT_WEIGHTS]
    assert [p.name for p in tmp_path.iterdir()] == ["a"]


def test_save_refuses_to_replace_a_foreign_directory(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match=r"notes\.txt.*new or empty directory"):
        save_pretrained(adapted(), tmp_path)
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_unknown_format(tmp_path):
    with pytest.raises(CheckpointError, match=r"format='safetensor' is not known; use 'native' or 'peft'"):
        save_pretrained(adapted(), tmp_path / "a", format="safetensor")


def test_save_without_adapter(tmp_path):
    with pytest.raises(CheckpointError, match="no LoRA adapter"):
        save_pretrained(tiny_model(), tmp_path / "a")


def test_missing_directory(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_pretrained(tiny_model(), tmp_path / "nope")


def test_directory_without_adapter_files(tmp_path):
    (tmp_path / "x.bin").write_bytes(b"1")
    with pytest.raises(CheckpointError, match=r"not an adapter directory.*x\.bin"):
        load_pretrained(tiny_model(), tmp_path)


@pytest.mark.parametrize("fmt", ["native", "peft"])
def test_missing_weights_file(tmp_path, fmt):
    save_pretrained(adapted(), tmp_path / "a", format=fmt)
    weights = ckpt.NATIVE_WEIGHTS if fmt == "native" else ckpt.PEFT_WEIGHTS
    (tmp_path / "a" / weights).unlink()
    with pytest.raises(CheckpointError, match=f"{weights} is missing"):
        load_pretrained(tiny_model(), tmp_path / "a")


@pytest.mark.parametrize("fmt", ["native", "peft"])
def test_corrupt_files(tmp_path, fmt):
    save_pretrained(adapted(), tmp_path / "a", format=fmt)
    config, weights = (
        (ckpt.NATIVE_CONFIG, ckpt.NATIVE_WEIGHTS)
        if fmt == "native"
        else (ckpt.PEFT_CONFIG, ckpt.PEFT_WEIGHTS)
    )
    (tmp_path / "a" / weights).write_bytes(b"\x00" * 20)
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        load_pretrained(tiny_model(), tmp_path / "a")
    (tmp_path / "a" / config).write_text("{truncated")
    with pytest.raises(CheckpointError, match="not readable JSON"):
        load_pretrained(tiny_model(), tmp_path / "a")


def test_shape_mismatch_names_key_and_shapes(tmp_path):
    save_pretrained(adapted(), tmp_path / "a")
    bigger = tiny_model(hidden_size=48, head_dim=12)
    with pytest.raises(
        CheckpointError, match=r"lora_A\.weight' has shape \(4, 32\) in the file but \(4, 48\)"
    ):
        load_pretrained(bigger, tmp_path / "a")


def test_targets_not_in_model(tmp_path):
    save_pretrained(adapted("qwen3", target_modules=["q_proj"]), tmp_path / "a")
    with pytest.raises(CheckpointError, match="does not fit this model"):
        load_pretrained(tiny_model("phi3"), tmp_path / "a")


def test_rank_mismatch_with_existing_adapter(tmp_path):
    save_pretrained(adapted(), tmp_path / "a")
    model = tiny_model()
    inject_lora(model, LoRAConfig(r=8))
    with pytest.raises(CheckpointError, match=r"r=4 but the model's adapter has r=8"):
        load_pretrained(model, tmp_path / "a")


def test_module_set_mismatch_with_existing_adapter(tmp_path):
    save_pretrained(adapted(target_modules=["q_proj"]), tmp_path / "a")
    model = tiny_model()
    inject_lora(model, LoRAConfig(r=4, target_modules=["v_proj"]))
    with pytest.raises(CheckpointError, match="other modules"):
        load_pretrained(model, tmp_path / "a")


def test_unsupported_peft_feature(tmp_path):
    save_pretrained(adapted(), tmp_path / "p", format="peft")
    config_file = tmp_path / "p" / ckpt.PEFT_CONFIG
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "lora_bias": True}))
    with pytest.raises(CheckpointError, match="lora_bias=True is not supported"):
        load_pretrained(tiny_model(), tmp_path / "p")


def test_newer_format_version(tmp_path):
    save_pretrained(adapted(), tmp_path / "a")
    config_file = tmp_path / "a" / ckpt.NATIVE_CONFIG
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "format_version": 99}))
    with pytest.raises(CheckpointError, match="upgrade loralei"):
        load_pretrained(tiny_model(), tmp_path / "a")
