"""PiSSA / OLoRA initialisation: the factors against the definitions and against PEFT's own init, the residual
base (dense and NF4-packed), and the combinations that are refused."""

from __future__ import annotations

import warnings

import peft
import pytest
import torch

from loralei import ConfigError, InjectionError, LoRAConfig, inject_lora
from loralei.inject import lora_modules
from loralei.modules.principal_init import initial_factors, principal_factors, start_from_principal
from loralei.modules.quantized.fp8 import FP8Weight, quantize_fp8
from loralei.modules.quantized.nf4 import NF4Weight, quantize_nf4
from tiny_models import tiny_fp8_model, tiny_model
from tolerances import assert_fp32_close

INITS = ["pissa", "pissa_niter_4", "olora"]
SMALL_BLOCKS = {"nf4_block_size": 16, "nf4_scaler_block_size": 2}


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: m.weight.detach().clone() for n, m in model.named_modules() if type(m) is torch.nn.Linear}


@pytest.mark.parametrize("shape", [(24, 40), (40, 24)])
def test_pissa_factors_are_the_scaled_principal_components(shape) -> None:
    w = torch.randn(*shape, dtype=torch.float64).float()
    scale = 0.5
    a0, b0 = principal_factors(w, "pissa", 4, scale)
    u, s, vh = torch.linalg.svd(w.double(), full_matrices=False)
    best = (u[:, :4] * s[:4]) @ vh[:4]  # the best rank-4 approximation (Eckart–Young)
    assert_fp32_close(scale * (b0 @ a0).double(), best)
    # the two factors share sqrt(S_r / s) equally: A0 A0ᵀ = BᵀB = diag(S_r / s)
    assert_fp32_close((a0 @ a0.T).double(), torch.diag(s[:4] / scale))
    assert_fp32_close((b0.T @ b0).double(), torch.diag(s[:4] / scale))


def test_pissa_niter_spans_the_principal_subspace() -> None:
    u = torch.linalg.qr(torch.randn(40, 40))[0]
    v = torch.linalg.qr(torch.randn(24, 24))[0]
    s = torch.tensor([50.0, 40, 30, 20] + [0.1] * 20)
    w = (u[:, :24] * s) @ v.T  # a clear gap after the 4th singular value
    a0, b0 = principal_factors(w, "pissa_niter_4", 4, 2.0)
    best = (u[:, :4] * s[:4]) @ v[:, :4].T
    assert torch.linalg.matrix_norm(2.0 * b0 @ a0 - best) < 1e-3 * torch.linalg.matrix_norm(best)


def test_olora_factors_are_the_leading_qr_columns_and_rows() -> None:
    w = torch.randn(40, 24)
    a0, b0 = principal_factors(w, "olora", 6, 3.0)
    q, r = torch.linalg.qr(w)
    assert_fp32_close(b0, q[:, :6])
    assert_fp32_close(a0, r[:6])
    assert_fp32_close(b0.T @ b0, torch.eye(6))
    assert torch.equal(a0.tril(-1), torch.zeros_like(a0))  # rows of an upper-triangular R


@pytest.mark.parametrize("init", INITS)
@pytest.mark.parametrize("rslora", [False, True])
def test_residual_plus_initial_update_is_the_base_and_the_outputs_do_not_change(init, rslora) -> None:
    model = tiny_model()
    original, x = _weights(model), torch.randint(0, 128, (2, 8))
    before = model(x).logits
    inject_lora(model, LoRAConfig(r=4, lora_alpha=8, use_rslora=rslora, init_lora_weights=init))
    for name, module in lora_modules(model):
        a0, b0 = initial_factors(module)
        assert torch.equal(a0, module.lora_A.weight) and torch.equal(b0, module.lora_B.weight)
        assert_fp32_close(module.weight + module.scale * b0 @ a0, original[name])
        assert not torch.allclose(module.weight, original[name], atol=1e-3)  # the principal part moved out
    assert_fp32_close(model(x).logits, before)


@pytest.mark.parametrize("init", ["pissa", "olora"])  # pissa_niter_K is random (its own test above)
def test_factors_and_residual_match_peft(init) -> None:
    config = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "down_proj"], "init_lora_weights": init}
    ours = inject_lora(tiny_model(), LoRAConfig(**config))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = peft.get_peft_model(tiny_model(), peft.LoraConfig(**config))
    for name, module in lora_modules(ours):
        layer = theirs.base_model.model.get_submodule(name)
        assert_fp32_close(module.lora_A.weight, layer.lora_A["default"].weight)
        assert_fp32_close(module.lora_B.weight, layer.lora_B["default"].weight)
        assert_fp32_close(module.weight, layer.base_layer.weight)


def test_nf4_base_packs_the_residual() -> None:
    pytest.importorskip("torchao")
    model, dense = tiny_model(), tiny_model()
    original = _weights(dense)
    inject_lora(model, LoRAConfig(r=4, init_lora_weights="pissa", quantize_base=True, **SMALL_BLOCKS))
    inject_lora(dense, LoRAConfig(r=4, init_lora_weights="pissa"))
    residuals = dict(lora_modules(dense))
    for name, module in lora_modules(model):
        assert type(module.weight).__name__ == "NF4Tensor"
        a0, b0 = initial_factors(module)
        assert torch.equal(a0, initial_factors(residuals[name])[0])
        packed = module.quant.dequantize()
        again = NF4Weight(quantize_nf4(residuals[name].weight, 16, 2)).dequantize()
        assert torch.equal(packed, again)  # exactly the residual, packed
        # PiSSA's point: the residual packs with less error than the whole weight
        error = (packed + module.scale * b0 @ a0 - original[name]).norm()
        plain = (NF4Weight(quantize_nf4(original[name], 16, 2)).dequantize() - original[name]).norm()
        assert error < plain


def test_fp8_base_packs_the_residual() -> None:
    pytest.importorskip("torchao")
    model, dense = tiny_model(), tiny_model()
    fp8 = {"quantize_base": True, "quantization_type": "fp8", "fp8_kernel": "emulated"}
    inject_lora(model, LoRAConfig(r=4, init_lora_weights="olora", **fp8))
    inject_lora(dense, LoRAConfig(r=4, init_lora_weights="olora"))
    residuals = dict(lora_modules(dense))
    for name, module in lora_modules(model):
        assert type(module.weight).__name__ == "Float8Tensor"
        again = FP8Weight(quantize_fp8(residuals[name].weight)).dequantize()
        assert torch.equal(module.quant.dequantize(), again), name


def test_resetting_a_residual_base_is_refused() -> None:
    model = inject_lora(tiny_model(), LoRAConfig(r=4, init_lora_weights="olora"))
    _, module = next(lora_modules(model))
    with pytest.raises(InjectionError, match="already the PiSSA/OLoRA residual"):
        start_from_principal(module)


@pytest.mark.parametrize("value", ["pisa", "pissa_niter_0", "pissa_niter_", "OLoRA"])
def test_unknown_init_names_are_refused_with_the_choices(value) -> None:
    with pytest.raises(ConfigError, match=r'init_lora_weights.*"pissa_niter_<K>"'):
        LoRAConfig(init_lora_weights=value)


def test_expert_banks_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"init_lora_weights='pissa' cannot apply to target_parameters"):
        LoRAConfig(target_parameters=["experts.down_proj"], init_lora_weights="pissa")


def test_rank_above_the_smaller_dimension_is_refused_before_anything_changes() -> None:
    model = tiny_model()
    original = _weights(model)
    with pytest.raises(InjectionError, match=r"init_lora_weights='pissa'.*r=40 exceeds.*lower lora.r"):
        inject_lora(model, LoRAConfig(r=40, init_lora_weights="pissa"))
    assert not list(lora_modules(model))
    assert all(torch.equal(w, original[n]) for n, w in _weights(model).items())


def test_a_base_loaded_in_fp8_is_refused_with_the_fix() -> None:
    pytest.importorskip("torchao")
    model = tiny_fp8_model()
    with pytest.raises(InjectionError, match=r"init_lora_weights='olora'.*loaded quantized.*float8.*bf16"):
        inject_lora(model, LoRAConfig(r=4, init_lora_weights="olora"))
    assert not list(lora_modules(model))


@pytest.mark.parametrize("fp32_factors", [False, True])
def test_a_bf16_base_keeps_its_dtype_and_the_residual_uses_the_rounded_factors(fp32_factors) -> None:
    model = tiny_model(dtype=torch.bfloat16)
    original = _weights(model)
    inject_lora(model, LoRAConfig(r=4, init_lora_weights="pissa", lora_fp32_gradients=fp32_factors))
    factor_dtype = torch.float32 if fp32_factors else torch.bfloat16
    for name, module in lora_modules(model):
        a0, b0 = initial_factors(module)
        assert module.weight.dtype == torch.bfloat16
        assert a0.dtype == b0.dtype == module.lora_A.weight.dtype == factor_dtype
        # W − s·B0·A0 from the factors as the module holds them, in FP32, rounded once
        want = (original[name].float() - module.scale * b0.float() @ a0.float()).to(torch.bfloat16)
        assert torch.equal(module.weight, want), name
