"""The fused DoRA op against plain DoRA: outputs and the gradients of x, A, B and the magnitude, in fp64 and
fp32, dense and quantized bases; the twin against the DoRA definition written on the dense ``W + s B A``."""

from __future__ import annotations

import contextlib

import pytest
import torch

from loralei.errors import LoraleiError
from loralei.ops import reference
from loralei.ops.dora import dora_w, dora_w_dropout, row_norms, squared_row_norms
from loralei.ops.recompute import recomputation
from loralei.ops.weights import LoRAWeights
from op_cases import (
    as_dtype,
    dequantized,
    fp8_projection,
    keep_mask,
    nf4_projection,
    outputs_and_grads,
    projection,
)
from tolerances import assert_fp32_close, assert_low_precision_close

SHAPES = pytest.mark.parametrize(("inp", "out", "r"), [(16, 24, 4), (40, 8, 2), (24, 56, 8)])


def _magnitude(w: LoRAWeights, dtype: torch.dtype, seed: int = 5) -> torch.Tensor:
    """A trained-looking magnitude: the row norms of ``W + s B A`` times a random factor near 1 (a leaf)."""
    g = torch.Generator().manual_seed(seed)
    norms = row_norms(w, squared_row_norms(w)).to(dtype)
    return (norms * (1 + 0.3 * torch.randn(norms.shape, generator=g, dtype=dtype))).requires_grad_()


def _fused(w: LoRAWeights, m: torch.Tensor):
    return lambda t: [dora_w(t, w, m, squared_row_norms(w))]


def _plain(w: LoRAWeights, m: torch.Tensor, mask: torch.Tensor | None = None):
    return lambda t: [reference.dora_linear(t, w, m, mask)]


def _definition(w: LoRAWeights, m: torch.Tensor, mask: torch.Tensor | None = None):
    """DoRA as the paper and PEFT write it, on the dense merged direction ``V = W + s B A`` (norm detached)."""

    def run(x: torch.Tensor) -> list[torch.Tensor]:
        v = w.W + w.scale * w.B @ w.A
        g = m / v.detach().norm(dim=1)
        xd = x if mask is None else x * mask
        y = x @ w.W.t() + (g - 1) * (xd @ w.W.t()) + g * (w.scale * xd @ w.A.t() @ w.B.t())
        return [y if w.bias is None else y + w.bias]

    return run


def _assert_close(actual: list[torch.Tensor], expected: list[torch.Tensor], tol: float) -> None:
    names = ["Y", "dX", "dA", "dB", "dm"]
    for name, a, e in zip(names, actual, expected, strict=True):
        assert a.shape == e.shape and a.dtype == e.dtype, name
        assert_fp32_close(a, e, name, tolerance=tol)


@SHAPES
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("scale", [0.75, 16 / 8**0.5], ids=["alpha_over_r", "rslora"])
@pytest.mark.parametrize("keep", [False, True], ids=["z-again", "y-kept"])
def test_fused_matches_plain_fp64(inp: int, out: int, r: int, bias: bool, scale: float, keep: bool) -> None:
    """Outside a recomputation the backward forms Z again; inside one it reads dm from the kept Y."""
    w = as_dtype(projection(inp, out, r, bias, scale=scale), torch.float64)
    m = _magnitude(w, torch.float64)
    x = torch.randn(2, 5, inp, dtype=torch.float64)
    params = [w.A, w.B, m]
    with recomputation(early_stop=False) if keep else contextlib.nullcontext():
        fused = outputs_and_grads(_fused(w, m), x, params)
    _assert_close(fused, outputs_and_grads(_plain(w, m), x, params), 1e-12)
    _assert_close(fused, outputs_and_grads(_definition(w, m), x, params), 1e-12)


@SHAPES
@pytest.mark.parametrize("bias", [False, True])
def test_fused_fp32_against_fp64(inp: int, out: int, r: int, bias: bool) -> None:
    w = projection(inp, out, r, bias)
    m = _magnitude(w, torch.float32)
    w64 = as_dtype(w, torch.float64)
    m64 = m.detach().double().requires_grad_()
    x = torch.randn(3, inp)
    fused = outputs_and_grads(_fused(w, m), x, [w.A, w.B, m])
    expected = outputs_and_grads(_plain(w64, m64), x.double(), [w64.A, w64.B, m64])
    _assert_close(fused, [e.float() for e in expected], 1e-5)


@pytest.mark.parametrize("bias", [False, True])
def test_dropout_fused_and_twin_follow_peft_rule(bias: bool) -> None:
    """With dropout the base term sees the undropped input and the rescaled term the dropped one."""
    w = as_dtype(projection(16, 12, 4, bias), torch.float64)
    m = _magnitude(w, torch.float64)
    x = torch.randn(2, 6, 16, dtype=torch.float64)
    mask = keep_mask(x.shape, 0.3, torch.float64, seed=1)
    params = [w.A, w.B, m]
    plain = outputs_and_grads(_plain(w, m, mask), x, params)
    _assert_close(plain, outputs_and_grads(_definition(w, m, mask), x, params), 1e-12)
    fused = outputs_and_grads(lambda t: [dora_w_dropout(t, w, m, squared_row_norms(w), mask)], x, params)
    _assert_close(fused, plain, 1e-12)


def test_starts_at_the_base_output() -> None:
    """With B = 0 and m = ‖W‖ (PEFT's start), DoRA's output is the base projection's."""
    w = as_dtype(projection(16, 12, 4, True), torch.float64)
    w = w._replace(B=torch.zeros_like(w.B, requires_grad=True))
    m = row_norms(w, squared_row_norms(w))
    x = torch.randn(4, 16, dtype=torch.float64)
    expected = x @ w.W.t() + w.bias
    assert_fp32_close(dora_w(x, w, m, squared_row_norms(w)), expected, "Y", tolerance=1e-14)


@pytest.mark.parametrize("quantized", [nf4_projection, fp8_projection], ids=["nf4", "fp8"])
def test_quantized_base_matches_dequantized(quantized) -> None:
    pytest.importorskip("torchao")
    w = quantized(32, 48, 4, True)
    m = _magnitude(dequantized(w), torch.float32)
    x = torch.randn(2, 3, 32)
    params = [w.A, w.B, m]
    fused = outputs_and_grads(_fused(w, m), x, params)
    _assert_close(fused, outputs_and_grads(_plain(w, m), x, params), 1e-5)
    _assert_close(fused, outputs_and_grads(_fused(dequantized(w), m), x, params), 1e-5)


def test_norm_from_squared_terms_equals_dense_norm() -> None:
    w = as_dtype(projection(24, 16, 4, False), torch.float64)
    dense = torch.linalg.vector_norm(w.W + w.scale * w.B @ w.A, dim=1)
    assert_fp32_close(row_norms(w, squared_row_norms(w)), dense, "norm", tolerance=1e-14)


def test_refuses_dropout() -> None:
    w = projection(8, 8, 2, False)._replace(dropout_p=0.1)
    m = _magnitude(w._replace(dropout_p=0.0), torch.float32)
    with pytest.raises(LoraleiError, match=r"dropout_p=0\.1.*lora_dropout: 0\.0"):
        dora_w(torch.randn(2, 8), w, m, squared_row_norms(w))


def test_refuses_trainable_base() -> None:
    w = projection(8, 8, 2, False)
    w = w._replace(W=w.W.clone().requires_grad_())
    m = torch.ones(8, requires_grad=True)
    with pytest.raises(LoraleiError, match="requires grad"):
        dora_w(torch.randn(2, 8), w, m, squared_row_norms(w))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("lora_fp32", [False, True], ids=["lora_in_dtype", "lora_fp32"])
def test_low_precision_within_the_table_of_plain_error(dtype: torch.dtype, lora_fp32: bool) -> None:
    """Fused in bf16 / fp16 (factors and magnitude in FP32 with ``lora_fp32_gradients``) vs the fp64 twin: at
    most the table's factor times plain DoRA's error in the same dtype."""
    lora_dtype = torch.float32 if lora_fp32 else dtype
    w = projection(64, 48, 8, True, dtype=dtype, lora_dtype=lora_dtype)
    m = _magnitude(w, lora_dtype)
    w64 = as_dtype(w, torch.float64)
    m64 = m.detach().double().requires_grad_()
    x = torch.randn(32, 64, dtype=dtype)
    names = ["Y", "dX", "dA", "dB", "dm"]
    fused = outputs_and_grads(_fused(w, m), x, [w.A, w.B, m])
    plain = outputs_and_grads(_plain(w, m), x, [w.A, w.B, m])
    expected = outputs_and_grads(_plain(w64, m64), x.double(), [w64.A, w64.B, m64])
    for name, f, p, e in zip(names, fused, plain, expected, strict=True):
        assert f.dtype == p.dtype, name
        assert_low_precision_close(f, p, e, dtype, name)


@pytest.mark.parametrize("keep", [False, True], ids=["outside", "inside-recomputation"])
def test_keeps_the_output_only_inside_a_recomputation(keep: bool) -> None:
    """Outside a recomputation the op saves what LoRA's saves (no (T, out) tensor); inside, its output Y."""
    w = projection(10, 12, 4, True)
    m = _magnitude(w, torch.float32)
    x = torch.randn(7, 10, requires_grad=True)
    shapes = []
    with (
        recomputation(early_stop=False) if keep else contextlib.nullcontext(),
        torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.append(tuple(t.shape)) or t, lambda t: t),
    ):
        dora_w(x, w, m, squared_row_norms(w))
    assert shapes.count((7, 12)) == (1 if keep else 0)
