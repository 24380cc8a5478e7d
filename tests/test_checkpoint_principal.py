"""Adapters that started from PiSSA/OLoRA: the PEFT export is a plain rank-2r LoRA on the original base (PEFT
and loralei load it there and give the trained outputs), the native format rebuilds the same residual from the
saved initial factors, and merging into the residual gives the trained weights."""

from __future__ import annotations

import json
import warnings

import peft
import pytest
import torch
from safetensors.torch import load_file, save_file

from loralei import (
    CheckpointError,
    LoRAConfig,
    inject_lora,
    load_pretrained,
    merge_and_unload_lora,
    save_pretrained,
)
from loralei.checkpoint import NATIVE_WEIGHTS, PEFT_CONFIG, lora_state_dict
from loralei.inject import lora_modules
from tiny_models import tiny_batch, tiny_model
from tolerances import FP32_MODEL_REL, assert_fp32_close

INITS = ["pissa", "pissa_niter_4", "olora"]
SMALL_BLOCKS = {"nf4_block_size": 16, "nf4_scaler_block_size": 2}


def trained(init: str, steps: int = 3, **config) -> torch.nn.Module:
    """A tiny Llama with a PiSSA/OLoRA adapter after a few SGD steps (the factors moved off their start)."""
    model = tiny_model()
    inject_lora(model, LoRAConfig(**{"r": 4, "lora_alpha": 8, "init_lora_weights": init, **config}))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=0.05)
    model.train()
    for _ in range(steps):
        model(**tiny_batch()).loss.backward()
        opt.step()
        opt.zero_grad()
    return model.eval()


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(**tiny_batch(seed=7)).logits


@pytest.mark.parametrize("init", INITS)
@pytest.mark.parametrize("rslora", [False, True])
def test_peft_export_loads_in_peft_on_the_original_base(tmp_path, init, rslora) -> None:
    model = trained(init, use_rslora=rslora)
    save_pretrained(model, tmp_path / "peft", format="peft")
    meta = json.loads((tmp_path / "peft" / PEFT_CONFIG).read_text())
    assert meta["r"] == 8 and meta["init_lora_weights"] is True
    assert meta["lora_alpha"] == pytest.approx(8 * 2**0.5 if rslora else 16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = peft.PeftModel.from_pretrained(tiny_model(), tmp_path / "peft").eval()
    assert_fp32_close(_logits(theirs), _logits(model), tolerance=FP32_MODEL_REL)
    # and the export is not the untrained adapter's
    assert not torch.allclose(_logits(theirs), _logits(tiny_model()), atol=1e-3)


@pytest.mark.parametrize("init", INITS)
def test_loralei_loads_the_peft_export_on_the_original_base(tmp_path, init) -> None:
    model = trained(init)
    save_pretrained(model, tmp_path / "peft", format="peft")
    ours = load_pretrained(tiny_model(), tmp_path / "peft")
    assert_fp32_close(_logits(ours), _logits(model), tolerance=FP32_MODEL_REL)


@pytest.mark.parametrize("init", INITS)
@pytest.mark.parametrize("quantize", [False, True])
def test_native_roundtrip_rebuilds_the_residual_exactly(tmp_path, init, quantize, monkeypatch) -> None:
    if quantize:
        pytest.importorskip("torchao")
    config = {"quantize_base": True, **SMALL_BLOCKS} if quantize else {}
    model = trained(init, **config)
    save_pretrained(model, tmp_path / "a")
    saved = set(load_file(tmp_path / "a" / NATIVE_WEIGHTS))
    assert {k for k in saved if k.endswith("_init")} == {
        f"{n}.lora_{p}_init" for n, _ in lora_modules(model) for p in "AB"
    }

    def no_second_decomposition(*args, **kwargs):
        raise AssertionError("a load decomposed the base again")

    monkeypatch.setattr("loralei.modules.principal_init.principal_factors", no_second_decomposition)
    fresh = load_pretrained(tiny_model(), tmp_path / "a")
    for (name, ours), (_, theirs) in zip(lora_modules(fresh), lora_modules(model), strict=True):
        weights = (
            (ours.weight, theirs.weight)
            if not quantize
            else (ours.quant.dequantize(), theirs.quant.dequantize())
        )
        assert torch.equal(*weights), name
    assert torch.equal(_logits(fresh), _logits(model))
    # the reloaded adapter exports the same plain LoRA
    save_pretrained(fresh, tmp_path / "p2", format="peft")
    save_pretrained(model, tmp_path / "p1", format="peft")
    assert torch.equal(
        _logits(load_pretrained(tiny_model(), tmp_path / "p1")),
        _logits(load_pretrained(tiny_model(), tmp_path / "p2")),
    )


def test_merging_into_the_residual_gives_the_trained_model(tmp_path) -> None:
    model = trained("pissa")
    want = _logits(model)
    save_pretrained(model, tmp_path / "peft", format="peft")
    merged = merge_and_unload_lora(model)
    assert_fp32_close(_logits(merged), want, tolerance=FP32_MODEL_REL)
    # the same weights as the plain export merged into the original base
    plain = merge_and_unload_lora(load_pretrained(tiny_model(), tmp_path / "peft"))
    for (name, p), (_, q) in zip(merged.named_parameters(), plain.named_parameters(), strict=True):
        assert_fp32_close(p, q, name, tolerance=FP32_MODEL_REL)


def test_an_adapter_without_its_initial_factors_is_refused(tmp_path) -> None:
    save_pretrained(trained("olora", steps=1), tmp_path / "a")
    file = tmp_path / "a" / NATIVE_WEIGHTS
    save_file({k: v for k, v in load_file(file).items() if not k.endswith("_init")}, file)
    model = tiny_model()
    with pytest.raises(CheckpointError, match=r"init_lora_weights='olora' but holds no initial factors"):
        load_pretrained(model, tmp_path / "a")
    assert not list(lora_modules(model))


def test_loading_into_a_model_with_other_initial_factors_is_refused(tmp_path) -> None:
    save_pretrained(trained("pissa", steps=1), tmp_path / "a")
    other = inject_lora(tiny_model(seed=5), LoRAConfig(r=4, lora_alpha=8, init_lora_weights="pissa"))
    with pytest.raises(CheckpointError, match="other PiSSA/OLoRA factors"):
        load_pretrained(other, tmp_path / "a")
    same = inject_lora(tiny_model(), LoRAConfig(r=4, lora_alpha=8, init_lora_weights="pissa"))
    load_pretrained(same, tmp_path / "a")  # the same start: only the trained factors are copied
    assert lora_state_dict(same).keys() == lora_state_dict(other).keys()


def test_a_peft_pissa_adapter_saved_without_conversion_is_refused(tmp_path) -> None:
    """PEFT's own save of a PiSSA adapter is relative to its residual base, not to the model loralei loads it on."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = peft.get_peft_model(
            tiny_model(), peft.LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights="pissa_niter_2")
        )
        theirs.save_pretrained(tmp_path / "peft")
    model = tiny_model()
    with pytest.raises(CheckpointError, match=r"init_lora_weights='pissa_niter_2': PEFT saved this adapter"):
        load_pretrained(model, tmp_path / "peft")
    assert not list(lora_modules(model))
