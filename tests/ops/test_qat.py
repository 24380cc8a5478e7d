"""Quantization-aware LoRA's op: the forward is ``X Q(W + s·B·A)ᵀ + bias`` with the format's own quantizer, and
the straight-through backward gives A and B exactly LoRA's gradients on the dense merged weight."""

from __future__ import annotations

import pytest
import torch

from loralei.config import QATConfig
from loralei.modules.quantized.fake_quant import fake_quantizer
from loralei.ops import reference
from loralei.ops.qat import merged_weight, qat_linear
from loralei.ops.weights import LoRAWeights
from tolerances import FP32_REL, assert_fp32_close

FORMATS = {
    "int4": QATConfig(weight="int4", group_size=32),
    "nf4": QATConfig(weight="nf4", group_size=32, scaler_block_size=4),
    "fp8": QATConfig(weight="fp8"),
    "nvfp4": QATConfig(weight="nvfp4"),
}
# TorchAO's int4 recipe takes no float64 weight: its case runs in float32.
GRAD_DTYPE = {"int4": torch.float32, "nf4": torch.float64, "fp8": torch.float64, "nvfp4": torch.float64}
SHAPES = [(5, 64, 32, 4), (2, 3, 96, 48, 8)]  # (*leading, in, out, r)


def _case(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, LoRAWeights]:
    *lead, d_in, d_out, r = shape
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, d_in, generator=g, dtype=dtype, requires_grad=True)
    W = torch.randn(d_out, d_in, generator=g, dtype=dtype) * 0.1
    A = (torch.randn(r, d_in, generator=g, dtype=dtype) * 0.1).requires_grad_()
    B = (torch.randn(d_out, r, generator=g, dtype=dtype) * 0.1).requires_grad_()
    bias = torch.randn(d_out, generator=g, dtype=dtype)
    return x, LoRAWeights(W=W, quant=None, A=A, B=B, scale=2.0, dropout_p=0.0, bias=bias)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", SHAPES)
def test_forward_is_the_quantized_merged_weight_applied(fmt, shape):
    x, w = _case(shape, torch.float32)
    quantize = fake_quantizer(FORMATS[fmt])
    merged = (w.W.double() + w.scale * (w.B.double() @ w.A.double())).float()
    expected = torch.nn.functional.linear(x, quantize(merged), w.bias)
    y = qat_linear(x, w, quantize)
    assert_fp32_close(y, expected, f"{fmt} forward")
    assert not torch.equal(quantize(merged), merged)  # the format does round: the test would see a lost Q


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", SHAPES)
def test_straight_through_gradients_are_lora_gradients_on_the_merged_weight(fmt, shape):
    dtype = GRAD_DTYPE[fmt]
    x, w = _case(shape, dtype, seed=1)
    quantize = fake_quantizer(FORMATS[fmt])
    dy = torch.randn(*x.shape[:-1], w.W.shape[0], dtype=dtype, generator=torch.Generator().manual_seed(2))
    dx, dA, dB = torch.autograd.grad(qat_linear(x, w, quantize), (x, w.A, w.B), dy)
    # LoRA on the dense merged weight, unquantized: its factor gradients, and dX through the quantized weight
    dense = torch.nn.functional.linear(x, w.W, w.bias) + reference.lora_delta(x, w)
    ref_dA, ref_dB = torch.autograd.grad(dense, (w.A, w.B), dy)
    ref_dx = dy @ quantize(merged_weight(w))
    tol = 1e-12 if dtype == torch.float64 else FP32_REL
    for got, want, name in ((dA, ref_dA, "dA"), (dB, ref_dB, "dB"), (dx, ref_dx, "dX")):
        assert_fp32_close(got, want, f"{fmt} {name}", tolerance=tol)


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_op_matches_its_autograd_twin(fmt):
    x, w = _case(SHAPES[1], GRAD_DTYPE[fmt], seed=3)
    quantize = fake_quantizer(FORMATS[fmt])
    dy = torch.randn(*x.shape[:-1], w.W.shape[0], dtype=x.dtype, generator=torch.Generator().manual_seed(4))
    got = qat_linear(x, w, quantize)
    want = reference.qat_linear(x, w, quantize)
    assert_fp32_close(got, want, f"{fmt} output")
    for g, r, name in zip(
        torch.autograd.grad(got, (x, w.A, w.B), dy),
        torch.autograd.grad(want, (x, w.A, w.B), dy),
        "xAB",
        strict=True,
    ):
        assert_fp32_close(g, r, f"{fmt} d{name}")


def test_fp32_factors_of_a_bf16_base_get_fp32_gradients():
    x, w = _case(SHAPES[0], torch.float32, seed=5)
    w = w._replace(W=w.W.bfloat16(), bias=None)
    y = qat_linear(x, w, fake_quantizer(FORMATS["nvfp4"]))
    assert y.dtype == torch.bfloat16
    dx, dA, dB = torch.autograd.grad(y.float().sum(), (x, w.A, w.B))
    assert (dx.dtype, dA.dtype, dB.dtype) == (torch.float32, torch.float32, torch.float32)
