"""DoRA on a tiny Llama against PEFT's DoRA: the same outputs and gradients on the same weights (plain and fused
paths, dense and quantized bases), PEFT <-> loralei save and load, native round trip, merge / unmerge, the fusion
report and the refusals."""

from __future__ import annotations

import json
import pickle

import peft
import pytest
import torch
from safetensors.torch import load_file

from loralei import (
    LoRAConfig,
    apply_fused_kernels,
    disable_lora,
    inject_lora,
    load_pretrained,
    lora_state_dict,
    merge_and_unload_lora,
    merge_lora,
    save_pretrained,
    unmerge_lora,
)
from loralei.errors import CheckpointError, ConfigError
from loralei.train.checkpointing import enable_checkpointing
from tiny_models import perturb_magnitudes, tiny_batch, tiny_model
from tolerances import FP32_MODEL_REL, assert_fp32_close

NF4 = {"quantize_base": True, "nf4_block_size": 16, "nf4_scaler_block_size": 4}


def _peft_dora(**options) -> peft.PeftModel:
    config = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules="all-linear", use_dora=True, init_lora_weights=False, **options
    )
    model = peft.get_peft_model(tiny_model(), config)
    perturb_magnitudes(model)
    return model


def _loralei_dora(**fields) -> torch.nn.Module:
    model = inject_lora(
        tiny_model(), LoRAConfig(r=4, lora_alpha=8, use_dora=True, init_lora_weights=False, **fields)
    )
    perturb_magnitudes(model)
    return model


def _ours(peft_name: str) -> str:
    """loralei's in-memory name of a PEFT parameter (prefix and adapter segment removed)."""
    name = peft_name.removeprefix("base_model.model.").replace(".default", "")
    return name.removesuffix(".weight") if "lora_magnitude_vector" in name else name


def _logits_and_grads(model: torch.nn.Module, names) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.train()
    model.zero_grad()
    out = model(**tiny_batch())
    out.loss.backward()
    params = dict(model.named_parameters())
    return out.logits.detach(), {name: params[name].grad for name in names(params)}


@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
def test_peft_adapter_loads_with_peft_outputs_and_gradients(tmp_path, fused):
    theirs = _peft_dora()
    theirs.save_pretrained(tmp_path / "p")
    ours = load_pretrained(tiny_model(), tmp_path / "p")
    if fused:
        apply_fused_kernels(ours)
    trained = [n for n, p in theirs.named_parameters() if p.requires_grad]
    assert any("lora_magnitude_vector" in n for n in trained)
    their_logits, their_grads = _logits_and_grads(theirs, lambda _: trained)
    our_logits, our_grads = _logits_and_grads(ours, lambda _: [_ours(n) for n in trained])
    assert_fp32_close(our_logits, their_logits, "logits", FP32_MODEL_REL)
    for name in trained:
        assert_fp32_close(our_grads[_ours(name)], their_grads[name], name, FP32_MODEL_REL)


def test_export_loads_in_peft_with_our_outputs(tmp_path):
    ours = _loralei_dora()
    save_pretrained(ours, tmp_path / "p", format="peft")
    config = json.loads((tmp_path / "p" / "adapter_config.json").read_text())
    tensors = load_file(tmp_path / "p" / "adapter_model.safetensors")
    assert config["use_dora"] is True
    assert "base_model.model.model.layers.0.mlp.down_proj.lora_magnitude_vector" in tensors
    theirs = peft.PeftModel.from_pretrained(tiny_model(), tmp_path / "p").eval()
    expected = {_ours(n): p for n, p in theirs.named_parameters() if "lora_" in n}
    assert expected.keys() == lora_state_dict(ours).keys()
    for name, p in lora_state_dict(ours).items():
        torch.testing.assert_close(expected[name], p, rtol=0, atol=0)
    batch = tiny_batch()
    assert_fp32_close(ours.eval()(**batch).logits, theirs(**batch).logits, "logits", FP32_MODEL_REL)


def test_native_roundtrip_keeps_the_magnitudes(tmp_path):
    ours = _loralei_dora(lora_dropout=0.1).eval()
    save_pretrained(ours, tmp_path / "a")
    fresh = load_pretrained(tiny_model(), tmp_path / "a").eval()
    assert sum("lora_magnitude_vector" in k for k in lora_state_dict(fresh)) == 14
    batch = tiny_batch()
    torch.testing.assert_close(fresh(**batch).logits, ours(**batch).logits, rtol=0, atol=0)


def test_first_forward_equals_the_base():
    base = tiny_model()
    batch = tiny_batch()
    expected = base(**batch).logits
    ours = inject_lora(base, LoRAConfig(r=4, use_dora=True))
    apply_fused_kernels(ours)
    assert_fp32_close(ours(**batch).logits, expected, "logits", FP32_MODEL_REL)


def test_merge_is_peft_merge_and_unmerge_is_exact(tmp_path):
    ours = _loralei_dora()
    save_pretrained(ours, tmp_path / "p", format="peft")
    weights = {n: p.detach().clone() for n, p in ours.named_parameters() if n.endswith("proj.weight")}
    batch = tiny_batch()
    before = ours(**batch).logits
    merge_lora(ours)
    assert_fp32_close(ours(**batch).logits, before, "merged logits", FP32_MODEL_REL)
    theirs = peft.PeftModel.from_pretrained(tiny_model(), tmp_path / "p").merge_and_unload()
    their_weights = dict(theirs.named_parameters())
    for name, p in ours.named_parameters():
        if name in weights:
            assert_fp32_close(p, their_weights[name], name)
    unmerge_lora(ours)
    for name, p in ours.named_parameters():
        if name in weights:
            torch.testing.assert_close(p, weights[name], rtol=0, atol=0)
    assert_fp32_close(merge_and_unload_lora(ours)(**batch).logits, before, "unloaded logits", FP32_MODEL_REL)


@pytest.mark.parametrize(
    "quant", [NF4, {"quantize_base": True, "quantization_type": "fp8", "fp8_kernel": "emulated"}]
)
def test_quantized_base_fused_matches_plain(quant):
    pytest.importorskip("torchao")
    plain = _loralei_dora(**quant)
    fused = _loralei_dora(**quant)
    apply_fused_kernels(fused)
    names = lambda params: [n for n, p in params.items() if p.requires_grad]  # noqa: E731
    plain_logits, plain_grads = _logits_and_grads(plain, names)
    fused_logits, fused_grads = _logits_and_grads(fused, names)
    assert_fp32_close(fused_logits, plain_logits, "logits", FP32_MODEL_REL)
    for name, grad in plain_grads.items():
        assert_fp32_close(fused_grads[name], grad, name, FP32_MODEL_REL)


def test_fusion_report_puts_dora_in_the_fused_mlp_and_groups():
    """Without dropout the DoRA MLPs run the fused gated MLP and q/k/v one group; with it each DoRA projection
    runs on its own."""
    report = apply_fused_kernels(_loralei_dora())
    kinds = [f.kind for f in report.fused]
    assert (kinds.count("gated MLP"), kinds.count("shared-input group"), kinds.count("projection")) == (
        2,
        2,
        2,
    )
    report = apply_fused_kernels(_loralei_dora(lora_dropout=0.1))
    assert not [f for f in report.fused if f.kind in ("gated MLP", "shared-input group")]
    assert any(n.kind == "gated MLP" and "DoRA with lora_dropout" in n.reason for n in report.not_fused)


def test_dropout_fused_equals_plain_under_one_seed():
    """Fused DoRA with dropout (PEFT's rule, composed from fused pieces) draws the plain path's masks."""
    plain, fused = _loralei_dora(lora_dropout=0.1), _loralei_dora(lora_dropout=0.1)
    report = apply_fused_kernels(fused)
    assert len([f for f in report.fused if f.kind == "projection"]) == 14
    names = lambda params: [n for n, p in params.items() if p.requires_grad]  # noqa: E731
    torch.manual_seed(7)
    plain_logits, plain_grads = _logits_and_grads(plain, names)
    torch.manual_seed(7)
    fused_logits, fused_grads = _logits_and_grads(fused, names)
    torch.manual_seed(8)
    other_logits, _ = _logits_and_grads(fused, names)
    assert_fp32_close(fused_logits, plain_logits, "logits", FP32_MODEL_REL)
    assert not torch.allclose(other_logits, plain_logits)  # the masks did act
    for name, grad in plain_grads.items():
        assert_fp32_close(fused_grads[name], grad, name, FP32_MODEL_REL)


def test_refuses_expert_banks_and_principal_inits():
    with pytest.raises(ConfigError, match="use_dora=True cannot apply to target_parameters"):
        LoRAConfig(use_dora=True, target_parameters=["experts.down_proj"])
    for init in ("pissa", "pissa_niter_4", "olora"):
        with pytest.raises(ConfigError, match=f"use_dora=True with init_lora_weights='{init}'"):
            LoRAConfig(use_dora=True, init_lora_weights=init)


def test_refuses_loading_into_another_adapter_kind(tmp_path):
    save_pretrained(_loralei_dora(), tmp_path / "a")
    plain = inject_lora(tiny_model(), LoRAConfig(r=4, lora_alpha=8))
    with pytest.raises(CheckpointError, match="use_dora=True but the model's adapter has use_dora=False"):
        load_pretrained(plain, tmp_path / "a")


def test_quantized_merge_keeps_the_outputs_and_unmerge_restores_the_packed_weights():
    pytest.importorskip("torchao")
    model = _loralei_dora(**NF4)
    apply_fused_kernels(model)
    packed = {n: p for n, p in model.named_parameters() if n.endswith("proj.weight")}
    batch = tiny_batch()
    before = model(**batch).logits
    merge_lora(model)
    assert_fp32_close(model(**batch).logits, before, "merged logits", FP32_MODEL_REL)
    unmerge_lora(model)
    assert all(p is packed[n] for n, p in model.named_parameters() if n in packed)
    torch.testing.assert_close(model(**batch).logits, before, rtol=0, atol=0)


def test_disabled_adapter_gives_the_base_outputs():
    batch = tiny_batch()
    expected = tiny_model()(**batch).logits
    with disable_lora(_loralei_dora()) as model:
        torch.testing.assert_close(model(**batch).logits, expected, rtol=0, atol=0)


def test_a_projection_that_ran_pickles_and_keeps_its_outputs():
    model = _loralei_dora()
    apply_fused_kernels(model)
    model(**tiny_batch())  # the norms are cached now
    module = model.model.layers[0].mlp.down_proj
    x = torch.randn(3, module.in_features)
    twin = pickle.loads(pickle.dumps(module))
    torch.testing.assert_close(twin(x), module(x), rtol=0, atol=0)


@pytest.mark.parametrize("checkpointing", [None, "runner", "torch"])
def test_fused_mlp_and_groups_equal_the_plain_path(checkpointing):
    """The fused gated MLP and q/k/v groups with DoRA members (and checkpointing, the runner's or torch's
    non-reentrant one, whose recomputation runs them again) give the plain DoRA path's loss and gradients."""
    plain, fused = _loralei_dora(), _loralei_dora()
    apply_fused_kernels(fused)
    if checkpointing == "runner":
        enable_checkpointing(fused, compiled=False, offload=False)
    elif checkpointing == "torch":
        fused.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    names = lambda params: [n for n, p in params.items() if p.requires_grad]  # noqa: E731
    plain_logits, plain_grads = _logits_and_grads(plain, names)
    fused_logits, fused_grads = _logits_and_grads(fused, names)
    assert_fp32_close(fused_logits, plain_logits, "logits", FP32_MODEL_REL)
    assert sum("lora_magnitude_vector" in n for n in plain_grads) == 14
    for name, grad in plain_grads.items():
        assert_fp32_close(fused_grads[name], grad, name, FP32_MODEL_REL)
