"""Merging adapters on MoE expert banks: exact unmerge, unloading to the Transformers experts module, disabling."""

from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

from loralei import (
    InjectionError,
    LoRAConfig,
    disable_lora,
    inject_lora,
    lora_modules,
    merge_and_unload_lora,
    merge_lora,
    unmerge_lora,
)
from loralei.inject import lora_expert_modules
from loralei.modules.lora_experts import LoRAExperts
from tiny_models import tiny_batch, tiny_moe_model
from tolerances import assert_fp32_close, rel_err

BANKS = ["experts.gate_up_proj", "experts.down_proj"]


def adapted(family="qwen3_moe", dtype=torch.float32, **kwargs):
    model = tiny_moe_model(family, dtype=dtype)
    options = {"target_parameters": BANKS, **kwargs}
    inject_lora(model, LoRAConfig(r=4, lora_alpha=8, init_lora_weights=False, **options))
    return model


def banks(model):
    return {
        f"{name}.{bank}": getattr(module, bank).detach().clone()
        for name, module in lora_expert_modules(model)
        for bank in module.adapted
    }


def logits(model):
    return model(**tiny_batch()).logits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unmerge_restores_banks_bit_for_bit(dtype):
    model = adapted(dtype=dtype)
    before = banks(model)
    merge_lora(model)
    merged = banks(model)
    assert all(not torch.equal(merged[n], w) for n, w in before.items())  # every adapted bank changed
    unmerge_lora(model)
    assert all(torch.equal(w, before[n]) for n, w in banks(model).items())
    assert all(not m.merged for _, m in lora_expert_modules(model))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merge_adds_in_fp32_and_rounds_once(dtype):
    model = adapted(dtype=dtype)
    experts = model.model.layers[1].mlp.experts
    expected = {b: (getattr(experts, b).float() + experts.delta_weight(b)).to(dtype) for b in experts.adapted}
    merge_lora(model)
    for bank, want in expected.items():
        assert torch.equal(getattr(experts, bank), want), bank


@pytest.mark.parametrize("options", [{}, {"target_modules": ["q_proj"]}], ids=["banks", "banks+q_proj"])
def test_merged_forward_matches_unmerged(options):
    model = adapted(**options)
    expected = logits(model)
    merge_lora(model)
    assert_fp32_close(logits(model), expected, "merged")
    merge_lora(model)  # merging twice is a no-op
    assert_fp32_close(logits(model), expected, "merged twice")
    unmerge_lora(model)
    torch.testing.assert_close(logits(model), expected, rtol=0, atol=0)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_merge_and_unload_gives_back_the_transformers_experts_module(tmp_path, family):
    model = tiny_moe_model(family)
    original = model.model.layers[0].mlp.experts
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    inject_lora(
        model, LoRAConfig(r=4, target_modules=["q_proj"], target_parameters=BANKS, init_lora_weights=False)
    )
    expected = logits(model)
    assert rel_err(expected, logits(tiny_moe_model(family))) > 1e-2  # the adapter changes the outputs

    plain = merge_and_unload_lora(model)
    experts = plain.model.layers[0].mlp.experts
    assert experts is original and type(experts).__name__ == type(original).__name__
    assert not list(lora_modules(plain)) and not list(lora_expert_modules(plain))
    assert all("lora" not in n for n, _ in plain.named_modules())
    assert {n: p.requires_grad for n, p in plain.named_parameters()} == flags
    assert_fp32_close(logits(plain), expected, "unloaded")

    plain.save_pretrained(tmp_path / "merged")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", attn_implementation="sdpa").eval()
    assert type(reloaded.model.layers[0].mlp.experts) is type(original)
    assert_fp32_close(logits(reloaded), expected, "reloaded")
    inject_lora(plain, LoRAConfig(r=2, target_parameters=["experts.down_proj"]))  # can be adapted again


def test_unloading_follows_parameter_swaps_and_mode_changes_after_injection():
    model = adapted()  # the base experts module was in eval mode
    previous = torch.__future__.get_overwrite_module_params_on_conversion()
    torch.__future__.set_overwrite_module_params_on_conversion(True)
    try:
        model.float()  # new Parameter objects; the module LoRAExperts replaced still holds the old ones
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(previous)
    lora_experts = model.model.layers[0].mlp.experts
    current = lora_experts.gate_up_proj
    assert current is not lora_experts.base_layer.gate_up_proj
    expected = logits(model)
    model.train()  # reaches the LoRAExperts, not the module it replaced
    plain = merge_and_unload_lora(model)
    experts = plain.model.layers[0].mlp.experts
    assert experts.training and experts.gate_up_proj is current
    assert_fp32_close(logits(plain.eval()), expected, "unloaded after the swap")


def test_disable_lora_switches_expert_banks_off():
    model = adapted(target_modules=["q_proj"])
    adapted_logits = logits(model)
    with disable_lora(model):
        assert_fp32_close(logits(model), logits(tiny_moe_model()), "disabled")
    torch.testing.assert_close(logits(model), adapted_logits, rtol=0, atol=0)


def test_disable_while_experts_merged_is_an_error():
    model = adapted()
    merge_lora(model)
    with pytest.raises(InjectionError, match="unmerge_lora"), disable_lora(model):
        pass


@pytest.mark.parametrize("fn", [merge_lora, merge_and_unload_lora])
def test_quantized_expert_banks_are_not_merged(monkeypatch, fn):
    model = adapted(target_modules=["q_proj"])
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    # stands in for a quantized bank (the error names its kind from its backend): merging must refuse before
    # touching it
    packed = SimpleNamespace(backend="NF4 expert bank, routed experts dequantized into a shared buffer")
    monkeypatch.setattr(LoRAExperts, "quant", lambda self, name: packed if name == "down_proj" else None)
    with pytest.raises(
        InjectionError,
        match=r"cannot merge into 'model\.layers\.0\.mlp\.experts\.down_proj': NF4 expert banks cannot be "
        r"merged .*merge on a dense copy: load the base in bf16, load_pretrained the adapter, merge_and_unload",
    ):
        fn(model)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())  # nothing changed
    assert not any(m.merged for _, m in lora_modules(model))
