"""The formats quantization-aware LoRA simulates: the NVFP4 quantizer against the checkpoint decoder, each fake
quantizer against the packed base of the same format, and the refusals (shapes, bases loaded quantized)."""

from __future__ import annotations

import pytest
import torch

from loralei import LoRAConfig, inject_lora
from loralei.config import QATConfig
from loralei.errors import InjectionError, LoraleiError
from loralei.modules.quantized.fake_quant import fake_int4, fake_quantize_linears_, fake_quantizer
from loralei.modules.quantized.fp8 import FP8Weight, quantize_fp8
from loralei.modules.quantized.nf4 import NF4Weight, quantize_nf4
from loralei.modules.quantized.nvfp4 import E2M1_MAX, E4M3_MAX, e2m1_codes, quantize_nvfp4
from loralei.modules.quantized.unpack import e2m1_values, nvfp4
from tiny_models import tiny_fp8_model, tiny_model


def _representable(out: int, inp: int, seed: int) -> torch.Tensor:
    """An NVFP4-representable weight whose recomputed scales are its own: global scale 2^-10, e4m3 block scales,
    every block holding a ±6 (its amax) and one block of scale 448 (the weight's amax)."""
    g = torch.Generator().manual_seed(seed)
    values = e2m1_values(torch.randint(0, 16, (out, inp // 16, 16), generator=g, dtype=torch.uint8))
    values[..., 0] = E2M1_MAX * torch.where(torch.rand(out, inp // 16, generator=g) < 0.5, -1.0, 1.0)
    scales = (torch.rand(out, inp // 16, 1, generator=g) * 400 + 0.02).to(torch.float8_e4m3fn).float()
    scales[0, 0] = E4M3_MAX
    return (values * scales * 2.0**-10).reshape(out, inp)


@pytest.mark.parametrize(("out", "inp"), [(4, 16), (24, 96)])
def test_nvfp4_round_trip_is_exact_on_representable_weights(out, inp):
    w = _representable(out, inp, seed=out)
    t = quantize_nvfp4(w)
    assert t.weight.shape == (out, inp // 2) and t.weight.dtype == torch.uint8
    assert t.weight_scale.shape == (out, inp // 16) and t.weight_scale.dtype == torch.float8_e4m3fn
    assert float(t.weight_scale_2) == 2.0**-10
    assert torch.equal(nvfp4(t.weight, t.weight_scale, t.weight_scale_2, torch.float32), w)


def test_e2m1_rounds_to_nearest_with_ties_to_the_even_code():
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.3, -2.9, 7.0, -100.0, -0.0])
    want = torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 0.5, -3.0, 6.0, -6.0, -0.0])
    got = e2m1_values(e2m1_codes(x))
    assert torch.equal(got, want) and torch.equal(torch.signbit(got), torch.signbit(want))


def test_nvfp4_of_any_weight_is_within_half_a_step_of_each_block():
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(0))
    w[3] = 0.0  # an all-zero row: zero block scales, codes 0
    t = quantize_nvfp4(w)
    back = nvfp4(t.weight, t.weight_scale, t.weight_scale_2, torch.float32)
    step = (t.weight_scale.float() * t.weight_scale_2).repeat_interleave(16, dim=1)  # one e2m1 unit per block
    assert torch.all((back - w).abs() <= step + 1e-6)  # e2m1's widest gap is 2 units (4 to 6)
    assert torch.equal(back[3], torch.zeros(64))


def test_fake_quantizers_match_the_packed_bases_of_the_same_format():
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(1))
    nf4 = fake_quantizer(QATConfig(weight="nf4", group_size=64, scaler_block_size=8))(w)
    assert torch.equal(nf4, NF4Weight(quantize_nf4(w, 64, 8)).dequantize())
    fp8 = fake_quantizer(QATConfig(weight="fp8"))(w)
    assert torch.equal(fp8, FP8Weight(quantize_fp8(w), "emulated").dequantize())


@pytest.mark.parametrize("group", [32, 64])
def test_int4_keeps_sixteen_levels_per_group_within_half_a_step(group):
    w = torch.randn(16, 128, generator=torch.Generator().manual_seed(group)).bfloat16()
    q = fake_int4(w, group)
    assert q.dtype == torch.bfloat16
    for row_q, row_w in zip(q.float().reshape(-1, group), w.float().reshape(-1, group), strict=True):
        assert row_q.unique().numel() <= 16
        step = (row_w.max() - row_w.min()) / 15
        assert (row_q - row_w).abs().max() <= step / 2 + 0.02 * row_w.abs().max()  # bf16 scale and zero


def test_fake_quantize_linears_rounds_in_place_and_checks_all_first():
    lin = [torch.nn.Linear(32, 16), torch.nn.Linear(48, 16)]
    before = [m.weight.detach().clone() for m in lin]
    with pytest.raises(InjectionError, match=r"module 'b': weight \(16, 48\): in=48 is not a multiple of"):
        fake_quantize_linears_([("a", lin[0]), ("b", lin[1])], QATConfig(weight="int4", group_size=32))
    assert all(torch.equal(m.weight, b) for m, b in zip(lin, before, strict=True))
    fake_quantize_linears_([("a", lin[0]), ("b", lin[1])], QATConfig(weight="nvfp4"))
    assert all(
        torch.equal(m.weight, fake_quantizer(QATConfig(weight="nvfp4"))(b))
        for m, b in zip(lin, before, strict=True)
    )


def test_injection_refuses_what_the_format_cannot_hold_before_changing_anything():
    model = tiny_model("llama")  # hidden 32, intermediate 48
    with pytest.raises(
        InjectionError, match=r"down_proj': weight \(32, 48\): in=48 is not a multiple of qat"
    ):
        inject_lora(model, LoRAConfig(r=4, qat={"weight": "int4", "group_size": 32}))
    assert not any("lora_" in n for n, _ in model.named_parameters())
    with pytest.raises(InjectionError, match=r"scaler_block_size = 32 \* 256"):
        inject_lora(model, LoRAConfig(r=4, qat={"weight": "nf4", "group_size": 32}))


def test_injection_refuses_a_base_loaded_quantized():
    model = tiny_fp8_model("llama")
    with pytest.raises(InjectionError, match="qat needs a dense bf16/fp16/fp32 base weight"):
        inject_lora(model, LoRAConfig(r=4, qat={"weight": "nvfp4"}))


def test_an_injected_qat_projection_computes_with_its_quantized_merged_weight():
    model = tiny_model("llama")
    inject_lora(model, LoRAConfig(r=4, init_lora_weights=False, qat={"weight": "nvfp4"}))
    proj = model.model.layers[0].mlp.down_proj
    x = torch.randn(3, proj.in_features)
    merged = (
        proj.weight.double() + proj.scale * proj.lora_B.weight.double() @ proj.lora_A.weight.double()
    ).float()
    want = torch.nn.functional.linear(x, fake_quantizer(QATConfig(weight="nvfp4"))(merged))
    assert torch.allclose(proj(x), want, rtol=1e-5, atol=1e-6)
    proj.weight.requires_grad_(True)
    with pytest.raises(LoraleiError, match=r"lora\.qat trains the LoRA factors only"):
        proj(x)
