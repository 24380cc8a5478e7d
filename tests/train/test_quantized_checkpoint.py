"""The runner reads tiny synthetic GPTQ, AWQ and NVFP4 checkpoints itself: the loss and LoRA gradients equal those
of the same model holding the dequantized weights (from each format's definition, tests/checkpoint_quant.py), the
PEFT export carries the factors, merging dequantizes; and a checkpoint whose config and tensors disagree is
refused, naming the field, before any tensor is read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from checkpoint_quant import (
    awq_reference,
    awq_tensors,
    gptq_reference,
    gptq_tensors,
    nvfp4_reference,
    nvfp4_tensors,
)
from loralei import LoRAConfig, inject_lora, merge_and_unload_lora, save_pretrained
from loralei.errors import ConfigError
from loralei.modules.lora_linear import LoRALinear
from loralei.modules.quantized.checkpoint_tensor import CheckpointTensor
from loralei.train import build, layered_load
from loralei.train.schema import validate_config
from tiny_models import tiny_batch, tiny_model

CPU = torch.device("cpu")
DIMS = {"hidden_size": 64, "intermediate_size": 96}  # inputs 64 and 96: groups of 32; outputs 32, 64, 96
TARGETS = ["q_proj", "v_proj", "down_proj"]  # k, o, gate, up stay quantized and untargeted
GROUP = 32

# method -> (quantization_config, tensors of an (out, in) linear, their dense weight by the format's definition)
FORMATS = {
    "gptq": (
        {
            "quant_method": "gptq",
            "bits": 4,
            "group_size": GROUP,
            "desc_act": True,
            "sym": False,
            "checkpoint_format": "gptq",
        },
        lambda out, inp, seed: gptq_tensors(out, inp, GROUP, act_order=True, seed=seed),
        lambda t: gptq_reference(t, 1, torch.float32),
    ),
    "awq": (
        {"quant_method": "awq", "bits": 4, "group_size": GROUP, "version": "gemm", "zero_point": True},
        lambda out, inp, seed: awq_tensors(out, inp, GROUP, seed=seed),
        lambda t: awq_reference(t, GROUP, torch.float32),
    ),
    "nvfp4": (
        {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16},
        lambda out, inp, seed: nvfp4_tensors(out, inp, seed=seed),
        lambda t: nvfp4_reference(t, torch.float32),
    ),
}


def write_checkpoint(directory: Path, method: str, qconfig: dict | None = None):
    """A tiny Llama saved with every decoder-layer linear stored quantized (random codes and scales), and the same
    model holding the dequantized weights."""
    config, make, dense_of = FORMATS[method]
    model = tiny_model("llama", **DIMS)
    model.save_pretrained(directory)
    state = load_file(directory / layered_load.SINGLE)
    for seed, (name, module) in enumerate(model.model.layers.named_modules()):
        if isinstance(module, torch.nn.Linear):
            full = f"model.layers.{name}"
            parts = make(module.out_features, module.in_features, seed)
            del state[f"{full}.weight"]
            state |= {f"{full}.{part}": t for part, t in parts.items()}
            with torch.no_grad():
                module.weight.copy_(dense_of(parts))
    save_file(state, directory / layered_load.SINGLE)
    config_file = directory / "config.json"
    config_json = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**config_json, "quantization_config": qconfig or config}))
    return model


def run_config(checkpoint: Path, **lora):
    return validate_config(
        {
            "model": {"name_or_path": str(checkpoint), "dtype": "float32"},
            "data": {"path": "d"},
            "lora": {"r": 2, "lora_alpha": 4, "target_modules": TARGETS, **lora},
            "output_dir": "out",
        }
    )


def adapted(model):
    torch.manual_seed(0)
    return inject_lora(model, LoRAConfig(r=2, lora_alpha=4, target_modules=TARGETS, init_lora_weights=False))


def loss_and_grads(model) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad()
    loss = model(**tiny_batch()).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("method", FORMATS)
def test_a_quantized_checkpoint_trains_as_its_dequantized_weights(tmp_path, method):
    dense = adapted(write_checkpoint(tmp_path, method))
    loaded, how = build.load_model(run_config(tmp_path), CPU)
    title = {"gptq": "GPTQ", "awq": "AWQ", "nvfp4": "NVFP4"}[method]
    assert (
        how
        == f"model: a {title} checkpoint, read one decoder layer at a time, its quantized linears kept as stored"
    )
    linears = [m for m in loaded.model.layers.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(isinstance(m.weight, CheckpointTensor) for m in linears)
    assert not isinstance(loaded.lm_head.weight, CheckpointTensor)  # the head was stored dense
    adapted(loaded)
    assert all(m.quant is not None for m in loaded.modules() if isinstance(m, LoRALinear))
    loss, grads = loss_and_grads(loaded)
    loss_ref, grads_ref = loss_and_grads(dense)
    assert len(grads) == 2 * len(TARGETS) * 2  # A and B of three targets in two layers
    assert torch.equal(loss, loss_ref)
    assert grads.keys() == grads_ref.keys()
    for name, grad in grads.items():
        assert torch.equal(grad, grads_ref[name]), name


@pytest.mark.parametrize("method", ["gptq", "nvfp4"])
def test_the_peft_export_carries_the_factors_and_merging_dequantizes(tmp_path, method):
    dense = adapted(write_checkpoint(tmp_path / "ckpt", method))
    loaded = adapted(build.load_model(run_config(tmp_path / "ckpt"), CPU)[0])
    save_pretrained(loaded, tmp_path / "peft", format="peft")
    exported = load_file(tmp_path / "peft" / "adapter_model.safetensors")
    factors = {n: p for n, p in loaded.named_parameters() if "lora_" in n}
    assert exported.keys() == {f"base_model.model.{n}" for n in factors}
    for name, p in factors.items():
        assert torch.equal(exported[f"base_model.model.{name}"], p.detach())
    merge_and_unload_lora(loaded)
    merge_and_unload_lora(dense)
    q_proj = loaded.model.layers[0].self_attn.q_proj
    assert (
        type(q_proj.weight) is torch.nn.Parameter
    )  # dense: the merged weight is the dequantized one plus the update
    assert torch.equal(q_proj.weight, dense.model.layers[0].self_attn.q_proj.weight)
    assert isinstance(
        loaded.model.layers[0].self_attn.k_proj.weight, CheckpointTensor
    )  # untargeted: as stored


# --- refused before anything is read ---


def _no_reads(monkeypatch):
    def refuse(*_):
        raise AssertionError("a tensor was read")

    monkeypatch.setattr(layered_load.SafetensorsDirectory, "read", refuse)


@pytest.mark.parametrize(
    ("method", "change", "match"),
    [
        ("gptq", {"bits": 8}, r"quantization_config.bits=8, but loralei reads 4-bit codes"),
        (
            "gptq",
            {"group_size": 16},
            r"qzeros is \(3, 8\) torch.int32, but quantization_config \(group_size=16\) makes it \(6, 8\)",
        ),
        ("awq", {"group_size": 40}, r"group_size=40 does not divide its 96 input features"),
        ("awq", {"version": "gemv"}, r"version='gemv'"),
        ("nvfp4", {"quant_algo": "FP8"}, r"quant_algo='FP8'"),
    ],
)
def test_a_config_that_does_not_fit_the_tensors_is_refused_before_reading(
    tmp_path, monkeypatch, method, change, match
):
    write_checkpoint(tmp_path, method, {**FORMATS[method][0], **change})
    _no_reads(monkeypatch)
    with pytest.raises(ConfigError, match=match) as err:
        build.load_model(run_config(tmp_path), CPU)
    assert f"model.name_or_path {str(tmp_path)!r}" in str(err.value)


def test_act_order_without_g_idx_is_refused_before_reading(tmp_path, monkeypatch):
    write_checkpoint(tmp_path, "gptq")
    state = load_file(tmp_path / layered_load.SINGLE)
    save_file({n: t for n, t in state.items() if not n.endswith("g_idx")}, tmp_path / layered_load.SINGLE)
    _no_reads(monkeypatch)
    with pytest.raises(ConfigError, match=r"has no tensor 'g_idx' \(desc_act=true: act-order needs"):
        build.load_model(run_config(tmp_path), CPU)


def test_quantize_base_is_refused_for_a_quantized_checkpoint(tmp_path, monkeypatch):
    write_checkpoint(tmp_path, "awq")
    _no_reads(monkeypatch)
    with pytest.raises(ConfigError, match=r"lora.quantize_base: True, but .* is a AWQ checkpoint"):
        build.load_model(run_config(tmp_path, quantize_base=True), CPU)


def test_pissa_is_refused_for_a_quantized_checkpoint_before_reading(tmp_path, monkeypatch):
    write_checkpoint(tmp_path, "gptq")
    _no_reads(monkeypatch)
    with pytest.raises(
        ConfigError, match=r"lora.init_lora_weights: 'pissa', but .* GPTQ checkpoint.*residual"
    ):
        build.load_model(run_config(tmp_path, init_lora_weights="pissa"), CPU)
