import logging

import pytest
import torch
from torch import nn

from loralei import (
    InjectionError,
    LoRAConfig,
    LoRALinear,
    count_parameters,
    inject_lora,
    lora_modules,
)
from loralei.modules.lora_linear import init_factors
from tiny_models import FAMILIES, tiny_batch, tiny_model


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_injection_keeps_outputs_and_names(family):
    model = tiny_model(family)
    batch = tiny_batch()
    before = model(**batch).logits
    base_keys = set(model.state_dict())
    targets = ["qkv_proj", "o_proj"] if family == "phi3" else ["q_proj", "v_proj"]
    inject_lora(model, LoRAConfig(r=4, target_modules=targets))
    # B starts at zero: the adapted model computes the base function.
    torch.testing.assert_close(model(**batch).logits, before, rtol=0, atol=0)
    names = [n for n, _ in lora_modules(model)]
    assert len(names) == 2 * model.config.num_hidden_layers
    keys = set(model.state_dict())
    assert base_keys <= keys  # base parameter names are unchanged
    assert keys - base_keys == {f"{n}.lora_{ab}.weight" for n in names for ab in "AB"}
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == keys - base_keys


def test_lora_forward_matches_formula():
    model = tiny_model("qwen2")  # q/k/v have a base bias
    inject_lora(model, LoRAConfig(r=4, lora_alpha=12, target_modules=["q_proj"], init_lora_weights=False))
    module = model.model.layers[0].self_attn.q_proj
    assert module.bias is not None
    x = torch.randn(3, 5, module.in_features)
    expected = x @ module.weight.T + module.bias + 3.0 * (x @ module.lora_A.weight.T) @ module.lora_B.weight.T
    torch.testing.assert_close(module(x), expected, rtol=1e-5, atol=1e-6)


def test_dropout_only_in_training():
    model = tiny_model()
    inject_lora(model, LoRAConfig(r=4, lora_dropout=0.5, target_modules=["q_proj"], init_lora_weights=False))
    module = model.model.layers[0].self_attn.q_proj
    x = torch.randn(4, module.in_features)
    module.eval()
    torch.testing.assert_close(module(x), module(x))
    module.train()
    assert not torch.allclose(module(x), module(x))


def test_all_linear_skips_output_head_and_counts():
    model = tiny_model()
    inject_lora(model, LoRAConfig(r=2))
    names = [n for n, _ in lora_modules(model)]
    assert "lm_head" not in names and len(names) == 7 * 2
    counts = count_parameters(model)
    lora_numel = sum(m.lora_A.weight.numel() + m.lora_B.weight.numel() for _, m in lora_modules(model))
    assert counts.trainable == lora_numel
    assert counts.total == sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    assert "trainable%" in str(counts)


def test_one_log_line(caplog):
    with caplog.at_level(logging.INFO, logger="loralei"):
        inject_lora(tiny_model(), LoRAConfig(r=2, target_modules=["q_proj"]))
    lines = [r.getMessage() for r in caplog.records if r.name == "loralei"]
    assert len(lines) == 1 and "trainable params" in lines[0] and "2 modules" in lines[0]


def test_regex_exclude_and_layers():
    model = tiny_model()
    inject_lora(model, LoRAConfig(r=2, target_modules=r".*\.(q|k)_proj", exclude_modules=["k_proj"]))
    assert [n for n, _ in lora_modules(model)] == [f"model.layers.{i}.self_attn.q_proj" for i in range(2)]
    model = tiny_model()
    inject_lora(model, LoRAConfig(r=2, target_modules=["down_proj"], layers_to_transform=[1]))
    assert [n for n, _ in lora_modules(model)] == ["model.layers.1.mlp.down_proj"]


def test_fp32_gradients_keep_base_dtype():
    model = tiny_model(dtype=torch.bfloat16)
    inject_lora(model, LoRAConfig(r=4, target_modules=["q_proj", "down_proj"], lora_fp32_gradients=True))
    model(**tiny_batch()).loss.backward()
    for _, module in lora_modules(model):
        assert module.weight.dtype == torch.bfloat16
        for p in (module.lora_A.weight, module.lora_B.weight):
            assert p.dtype == torch.float32 and p.grad is not None and p.grad.dtype == torch.float32


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing_gives_every_lora_parameter_a_gradient(reentrant):
    model = tiny_model()
    # A non-zero B (init False) so that lora_A's gradient is non-zero too.
    inject_lora(model, LoRAConfig(r=4, init_lora_weights=False))
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model(**tiny_batch()).loss.backward()
    for name, module in lora_modules(model):
        for p in (module.lora_A.weight, module.lora_B.weight):
            assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_no_match_lists_patterns_and_real_names():
    with pytest.raises(InjectionError) as err:
        inject_lora(tiny_model(), LoRAConfig(target_modules=["query", "value"]))
    message = str(err.value)
    assert "['query', 'value']" in message and "q_proj" in message


def test_typo_in_one_entry_is_caught():
    with pytest.raises(InjectionError, match=r"'v_porj' matches no module \(did you mean \"v_proj\"\?\)"):
        inject_lora(tiny_model(), LoRAConfig(target_modules=["q_proj", "v_porj"]))


def test_unsupported_module_type_is_named():
    model = tiny_model()
    with pytest.raises(InjectionError, match=r"'model.layers.0.mlp' .* LlamaMLP"):
        inject_lora(model, LoRAConfig(target_modules=["mlp"]))
    assert not list(lora_modules(model))  # nothing was changed
    assert all(p.requires_grad for p in model.parameters())


def test_embedding_target_is_rejected():
    with pytest.raises(InjectionError, match="Embedding"):
        inject_lora(tiny_model(), LoRAConfig(target_modules=["embed_tokens"]))


def test_injecting_twice_is_an_error():
    model = tiny_model()
    inject_lora(model, LoRAConfig(target_modules=["q_proj"]))
    with pytest.raises(InjectionError, match="already has LoRA"):
        inject_lora(model, LoRAConfig(target_modules=["v_proj"]))


def test_plain_torch_module_works():
    model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))
    inject_lora(model, LoRAConfig(r=2, target_modules=["0", "2"]))
    assert all(isinstance(model[i], LoRALinear) for i in (0, 2))
    assert model(torch.randn(4, 6)).shape == (4, 3)


def test_gaussian_init():
    model = tiny_model()
    inject_lora(model, LoRAConfig(r=16, target_modules=["gate_proj"], init_lora_weights="gaussian"))
    module = model.model.layers[0].mlp.gate_proj
    assert module.lora_A.weight.std().item() == pytest.approx(1 / 16, rel=0.2)
    assert not module.lora_B.weight.any()


@pytest.mark.parametrize("init", [True, "gaussian", False])
def test_factors_are_drawn_alike_in_any_dtype_from_the_cpu_generator(init) -> None:
    """One seed gives the same factors whatever the projection's dtype (and device: the values are drawn in FP32
    on the CPU, then rounded once), so a layer injected on the host and one injected on the GPU start alike."""
    factors = {}
    for dtype in (torch.float32, torch.bfloat16):
        a, b = torch.empty(4, 32, dtype=dtype), torch.empty(16, 4, dtype=dtype)
        torch.manual_seed(7)
        init_factors(a, b, init, 4)
        factors[dtype] = (a, b)
    for got, want in zip(factors[torch.bfloat16], factors[torch.float32], strict=True):
        torch.testing.assert_close(got, want.to(torch.bfloat16), rtol=0, atol=0)


@pytest.mark.gpu
def test_factors_on_the_gpu_equal_those_drawn_on_the_host() -> None:
    """A layer streamed in and injected on the host, and one injected on the GPU, start from the same factors."""
    cpu = [torch.empty(4, 64), torch.empty(32, 4)]
    gpu = [torch.empty(4, 64, device="cuda", dtype=torch.bfloat16), torch.empty(32, 4, device="cuda")]
    for a, b in (cpu, gpu):
        torch.manual_seed(3)
        init_factors(a, b, False, 4)
    for got, want in zip(gpu, cpu, strict=True):
        torch.testing.assert_close(got.cpu(), want.to(got.dtype), rtol=0, atol=0)
