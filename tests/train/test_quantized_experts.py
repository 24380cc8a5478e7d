"""The runner reads a tiny synthetic Qwen3-MoE NVFP4 checkpoint in ModelOpt's layout (every expert's projections
and attention linears stored as NVFP4 linears of their own): the experts become 4-bit packed banks, and the loss
and the expert-LoRA gradients equal those of the same model holding the dequantized weights (from the format's
definition, tests/checkpoint_quant.py), on the plain and the fused expert path. A checkpoint that misses an expert's
tensor or stores one of the wrong shape, or an adapter that leaves the banks untargeted, is refused before any
tensor is read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from checkpoint_quant import nvfp4_reference, nvfp4_tensors
from loralei import LoRAConfig, apply_fused_kernels, inject_lora, merge_lora
from loralei.errors import ConfigError, InjectionError
from loralei.inject import lora_expert_modules
from loralei.modules.quantized.checkpoint_bank import CheckpointBank
from loralei.modules.quantized.checkpoint_formats import QuantSpec
from loralei.modules.quantized.checkpoint_tensor import CheckpointTensor
from loralei.train import build, layered_load
from loralei.train.quantized_banks import bank_projections, plan_banks
from loralei.train.schema import validate_config
from tiny_models import MOE_EXPERTS, tiny_batch, tiny_model

CPU = torch.device("cpu")
MOE = {"moe_intermediate_size": 48}  # banks (6, 96, 32) and (6, 32, 48): inputs in blocks of 16
BANKS = ["experts.gate_up_proj", "experts.down_proj"]
TARGETS = ["q_proj", "o_proj"]
NVFP4 = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16}
PROJECTIONS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


def _quantize(state: dict, name: str, out: int, inp: int, seed: int) -> torch.Tensor:
    """Replaces ``<name>.weight`` in ``state`` by random ModelOpt NVFP4 tensors; returns their dense weight."""
    parts = nvfp4_tensors(out, inp, seed=seed)
    del state[f"{name}.weight"]
    state |= {f"{name}.{part}": t for part, t in parts.items()}
    return nvfp4_reference(parts, torch.float32)


def write_moe_checkpoint(directory: Path) -> torch.nn.Module:
    """A tiny Qwen3-MoE saved as ModelOpt writes NVFP4 (each expert's gate/up/down and the attention linears
    quantized, the router and embeddings dense), and the same model holding the dequantized weights."""
    model = tiny_model("qwen3_moe", **MOE)
    model.save_pretrained(directory)
    state = load_file(directory / layered_load.SINGLE)
    seed = 0
    with torch.no_grad():
        for layer_name, layer in model.model.layers.named_children():
            prefix = f"model.layers.{layer_name}"
            for name, linear in layer.self_attn.named_children():
                if isinstance(linear, torch.nn.Linear):
                    seed += 1
                    dense = _quantize(state, f"{prefix}.self_attn.{name}", *linear.weight.shape, seed)
                    linear.weight.copy_(dense)
            experts = layer.mlp.experts
            for bank, projections in PROJECTIONS.items():
                param = getattr(experts, bank)
                rows = param.shape[1] // len(projections)
                for e in range(MOE_EXPERTS):
                    for k, proj in enumerate(projections):
                        seed += 1
                        name = f"{prefix}.mlp.experts.{e}.{proj}"
                        param[e, k * rows : (k + 1) * rows] = _quantize(
                            state, name, rows, param.shape[2], seed
                        )
    save_file(state, directory / layered_load.SINGLE)
    config_file = directory / "config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "quantization_config": NVFP4}))
    return model


def run_config(checkpoint: Path, **lora):
    fields = {"r": 2, "lora_alpha": 4, "target_modules": TARGETS, "target_parameters": BANKS, **lora}
    return validate_config(
        {
            "model": {"name_or_path": str(checkpoint), "dtype": "float32"},
            "data": {"path": "d"},
            "lora": fields,
            "output_dir": "out",
        }
    )


def adapted(model, fused: bool):
    torch.manual_seed(0)
    config = LoRAConfig(
        r=2, lora_alpha=4, target_modules=TARGETS, target_parameters=BANKS, init_lora_weights=False
    )
    model = inject_lora(model, config)
    if fused:
        apply_fused_kernels(model)
    return model


def loss_and_grads(model) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad()
    loss = model(**tiny_batch()).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
def test_an_nvfp4_moe_checkpoint_trains_as_its_dequantized_weights(tmp_path, fused):
    dense = adapted(write_moe_checkpoint(tmp_path), fused)
    loaded, how = build.load_model(run_config(tmp_path), CPU)
    assert how.startswith("model: a NVFP4 checkpoint, read one decoder layer at a time")
    for layer in loaded.model.layers:
        for bank in PROJECTIONS:
            packed = getattr(layer.mlp.experts, bank)
            assert isinstance(packed, CheckpointTensor) and packed.dim() == 3
            assert packed.weight.dtype == torch.uint8  # 4-bit codes, two per byte, as stored
            assert packed.weight.shape[-1] * 2 == packed.shape[-1]
            assert packed.weight_scale_2.shape == (MOE_EXPERTS, len(PROJECTIONS[bank]))
    loaded = adapted(loaded, fused)
    experts = [m for _, m in lora_expert_modules(loaded)]
    assert len(experts) == 2 and all(
        isinstance(m.quant(b), CheckpointBank) for m in experts for b in PROJECTIONS
    )
    loss, grads = loss_and_grads(loaded)
    loss_ref, grads_ref = loss_and_grads(dense)
    assert sum("lora_A.gate_up_proj" in n for n in grads) == 2  # the banks' factors in both layers
    assert torch.equal(loss, loss_ref)
    assert grads.keys() == grads_ref.keys()
    for name, grad in grads.items():
        assert torch.equal(grad, grads_ref[name]), name


# --- refused before anything is read ---


def _no_reads(monkeypatch):
    def refuse(*_):
        raise AssertionError("a tensor was read")

    monkeypatch.setattr(layered_load.SafetensorsDirectory, "read", refuse)


def _edit(directory: Path, change) -> None:
    state = load_file(directory / layered_load.SINGLE)
    change(state)
    save_file(state, directory / layered_load.SINGLE)


EXPERT = "model.layers.1.mlp.experts.3"


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (
            lambda s: s.pop(f"{EXPERT}.up_proj.weight_scale"),
            rf"NVFP4 linear '{EXPERT}.up_proj' has no tensor 'weight_scale'; the checkpoint is incomplete",
        ),
        (
            lambda s: [s.pop(n) for n in list(s) if n.startswith(f"{EXPERT}.")],
            rf"NVFP4 linear '{EXPERT}.gate_proj' has no tensor 'weight_scale'",
        ),
        (
            lambda s: s.update({f"{EXPERT}.down_proj.weight": torch.zeros(32, 16, dtype=torch.uint8)}),
            rf"'{EXPERT}.down_proj': weight is \(32, 16\) torch.uint8, but .* makes it \(32, 24\)",
        ),
        (
            lambda s: s.update({f"{EXPERT}.gate_proj.weight_scale_2": torch.ones(2)}),
            r"weight_scale_2 is \(2,\) torch.float32, but .* makes it \(\)",
        ),
    ],
    ids=["missing-scale", "missing-expert", "wrong-shape", "two-global-scales"],
)
def test_a_bad_expert_tensor_is_refused_before_reading(tmp_path, monkeypatch, change, match):
    write_moe_checkpoint(tmp_path)
    _edit(tmp_path, change)
    _no_reads(monkeypatch)
    with pytest.raises(ConfigError, match=match) as err:
        build.load_model(run_config(tmp_path), CPU)
    assert f"model.name_or_path {str(tmp_path)!r}" in str(err.value)


def test_untargeted_nvfp4_banks_are_refused_before_reading(tmp_path, monkeypatch):
    write_moe_checkpoint(tmp_path)
    _no_reads(monkeypatch)
    with pytest.raises(
        ConfigError,
        match=r"lora.target_parameters: \['experts.gate_up_proj'\], but .* stores the expert bank "
        r"'model.layers.0.mlp.experts.down_proj' \(2 in all\) as NVFP4, .* add \['experts.down_proj'\]",
    ):
        build.load_model(run_config(tmp_path, target_parameters=["experts.gate_up_proj"]), CPU)


def test_merging_nvfp4_banks_is_refused(tmp_path):
    write_moe_checkpoint(tmp_path)
    loaded = adapted(build.load_model(run_config(tmp_path), CPU)[0], fused=False)
    with pytest.raises(InjectionError, match=r"NVFP4 checkpoint expert banks cannot be merged"):
        merge_lora(loaded)
    assert all(isinstance(m.gate_up_proj, CheckpointTensor) for _, m in lora_expert_modules(loaded))


def test_bank_projections_come_from_transformers_conversion_mapping():
    assert bank_projections(tiny_model("qwen3_moe")) == {
        "gate_up_proj": ("gate_proj", "up_proj"),
        "down_proj": ("down_proj",),
    }
    assert bank_projections(tiny_model("mixtral")) == {"gate_up_proj": ("w1", "w3"), "down_proj": ("w2",)}
    assert bank_projections(tiny_model("llama")) == {}


def test_quantized_experts_of_another_format_are_refused():
    model = tiny_model("qwen3_moe", **MOE)
    names = {"model.layers.0.mlp.experts.0.gate_proj.qweight"}
    with pytest.raises(
        ConfigError, match=r"experts of 'model.layers.0.mlp.experts' quantized, .* GPTQ checkpoints'"
    ):
        plan_banks(model, names, lambda _: {}, QuantSpec("gptq", 32), "ckpt")
