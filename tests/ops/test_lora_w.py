"""lora_w (fused single projection) against its twin reference.lora_linear: outputs and every gradient."""

from __future__ import annotations

import pytest
import torch

from loralei.errors import LoraleiError
from loralei.ops import reference
from loralei.ops.lora_w import _lora_w_op, lora_w
from op_cases import as_dtype, gemm_shapes, keep_mask, outputs_and_grads, plain_path_mask, projection
from tolerances import FP32_REL, assert_low_precision_close, rel_err

FP32 = FP32_REL


def _compare(w, x, mask=None) -> list[float]:
    params = [w.A, w.B]
    fused = outputs_and_grads(lambda t: [lora_w(t, w, mask)], x, params)
    plain = outputs_and_grads(lambda t: [reference.lora_linear(t, w, mask)], x, params)
    return [rel_err(f, p) for f, p in zip(fused, plain, strict=True)]


@pytest.mark.parametrize("r", [1, 8, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_twin_fp32(r: int, bias: bool) -> None:
    w = projection(37, 29, r, bias)
    x = torch.randn(3, 5, 37)
    assert max(_compare(w, x)) <= FP32


@pytest.mark.parametrize("r", [1, 8])
def test_matches_twin_with_dropout_mask(r: int) -> None:
    w = projection(19, 23, r, bias=True)
    x = torch.randn(2, 7, 19)
    errs = _compare(w, x, keep_mask(x.shape, 0.3, torch.float32, seed=4))
    assert max(errs) <= FP32


def test_drawn_mask_equals_plain_path_with_the_same_seed() -> None:
    w = projection(16, 12, 4, bias=False)._replace(dropout_p=0.25)
    x = torch.randn(4, 16)

    def plain(t: torch.Tensor) -> list[torch.Tensor]:
        return [reference.lora_linear(t, w, plain_path_mask(t, w.dropout_p))]

    torch.manual_seed(7)
    fused = outputs_and_grads(lambda t: [lora_w(t, w)], x, [w.A, w.B])
    torch.manual_seed(7)
    expected = outputs_and_grads(plain, x, [w.A, w.B])
    assert max(rel_err(f, p) for f, p in zip(fused, expected, strict=True)) <= FP32
    torch.manual_seed(8)  # another seed draws another mask: the check above is not vacuous
    assert rel_err(lora_w(x, w), expected[0]) > 1e-3


def test_one_row_and_2d_input() -> None:
    w = projection(9, 5, 3, bias=True)
    assert max(_compare(w, torch.randn(1, 9))) <= FP32


def test_dtype_pinning_returns_dx_in_caller_dtype() -> None:
    w = projection(8, 6, 2, bias=True, dtype=torch.float32)
    x = torch.randn(3, 8, dtype=torch.float64, requires_grad=True)
    y = lora_w(x, w)
    y.sum().backward()
    assert y.dtype == torch.float32 and x.grad.dtype == torch.float64


@pytest.mark.parametrize("lora_dtype", [torch.bfloat16, torch.float32])
def test_low_precision_error_within_twice_plain(lora_dtype: torch.dtype) -> None:
    """bf16 weights (A/B bf16, or FP32 as with lora_fp32_gradients), fp32 input as from an fp32 RMSNorm."""
    w = projection(64, 48, 8, bias=True, dtype=torch.bfloat16, lora_dtype=lora_dtype)
    x = torch.randn(4, 16, 64)
    w64 = as_dtype(w, torch.float64)
    exact = outputs_and_grads(lambda t: [reference.lora_linear(t, w64)], x.double(), [w64.A, w64.B])
    fused = outputs_and_grads(lambda t: [lora_w(t, w)], x, [w.A, w.B])
    plain = outputs_and_grads(lambda t: [reference.lora_linear(t, w)], x, [w.A, w.B])
    assert fused[1].dtype == torch.float32 and fused[2].dtype == lora_dtype  # dX in caller dtype, dA in A's
    for f, p, e in zip(fused, plain, exact, strict=True):
        assert_low_precision_close(f, p, e, torch.bfloat16)


def test_base_gets_no_gradient_and_trainable_base_is_refused() -> None:
    w = projection(8, 6, 2, bias=True)
    x = torch.randn(3, 8, requires_grad=True)
    lora_w(x, w).sum().backward()
    assert w.W.grad is None and w.bias.grad is None and w.A.grad is not None
    with pytest.raises(LoraleiError, match="requires grad"):
        lora_w(x, w._replace(W=w.W.clone().requires_grad_()))
    with pytest.raises(LoraleiError, match="lora_w: quant is a object, not a quantized weight"):
        lora_w(x, w._replace(W=None, quant=object()))


def test_mask_of_another_shape_is_refused() -> None:
    """A mask with the input's element count but another shape must not be silently reshaped onto it."""
    w = projection(8, 6, 2, bias=False)
    x = torch.randn(3, 8)
    with pytest.raises(LoraleiError, match=r"dropout mask has shape \(4, 6\); expected \(3, 8\)"):
        lora_w(x, w, torch.ones(4, 6))


def test_backward_computes_dy_b_once() -> None:
    """Backward = G = dY B, dY W, G A (into dX), dA, dB: five GEMMs; computing G twice would make six."""
    w = projection(16, 12, 4, bias=False)
    x = torch.randn(5, 16, requires_grad=True)
    y = lora_w(x, w)
    assert len(gemm_shapes(lambda: y.backward(torch.ones_like(y)))) == 5


@pytest.mark.parametrize("compiled", [False, True])
def test_no_input_gradient_gemms_when_x_needs_none(compiled: bool) -> None:
    """x without grad: backward runs only G = dY B, dA and dB (the eager twin and the compiled custom op alike)."""
    w = projection(16, 12, 4, bias=False)
    x = torch.randn(5, 16)

    def fn(t: torch.Tensor) -> torch.Tensor:
        return lora_w(t, w)

    y = (torch.compile(fn, backend="aot_eager") if compiled else fn)(x)
    assert len(gemm_shapes(lambda: y.backward(torch.ones_like(y)))) == 3
    assert w.A.grad is not None and w.B.grad is not None


def test_saves_input_once_and_no_full_size_copies() -> None:
    """Saved for backward: X itself (no copy), frozen W, A, B, the (T, r) U and a bool mask with dropout."""
    w = projection(32, 24, 4, bias=True)._replace(dropout_p=0.5)
    x = torch.randn(6, 32, requires_grad=True)
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        lora_w(x, w)
    full_size = [t for t in saved if t.numel() == x.numel()]
    assert any(t.data_ptr() == x.data_ptr() for t in full_size)
    assert sorted(str(t.dtype) for t in full_size) == ["torch.bool", "torch.float32"]
    assert sum(t.numel() for t in saved) == x.numel() * 2 + w.W.numel() + w.A.numel() + w.B.numel() + 6 * 4


def test_compiles_without_graph_break() -> None:
    w = projection(16, 12, 4, bias=True)
    x = torch.randn(3, 16)
    compiled = torch.compile(lambda t: lora_w(t, w), backend="aot_eager", fullgraph=True)
    fused = outputs_and_grads(lambda t: [compiled(t)], x, [w.A, w.B])
    plain = outputs_and_grads(lambda t: [reference.lora_linear(t, w)], x, [w.A, w.B])
    assert max(rel_err(f, p) for f, p in zip(fused, plain, strict=True)) <= FP32


def test_eager_calls_skip_the_custom_op(monkeypatch) -> None:
    """Eager calls run the autograd.Function twin (less CPU time per call); the custom op serves torch.compile."""
    import loralei.ops.lora_w as module

    def refuse(*args):
        raise AssertionError("eager lora_w went through torch.library dispatch")

    monkeypatch.setattr(module, "_lora_w_op", refuse)
    w = projection(16, 12, 4, bias=True)
    x = torch.randn(2, 3, 16)
    fused = outputs_and_grads(lambda t: [lora_w(t, w)], x, [w.A, w.B])
    plain = outputs_and_grads(lambda t: [reference.lora_linear(t, w)], x, [w.A, w.B])
    assert max(rel_err(f, p) for f, p in zip(fused, plain, strict=True)) <= FP32


@pytest.mark.parametrize("masked", [False, True])
def test_op_passes_opcheck(masked: bool) -> None:
    """Schema, fake (Y (..., out) and U (T, r)), no aliasing, autograd registration."""
    w = projection(16, 12, 4, bias=True)
    x = torch.randn(2, 3, 16, requires_grad=True)
    keep = keep_mask(x.shape, 0.5, torch.float32, seed=1) if masked else None
    torch.library.opcheck(_lora_w_op, (x, w.W, -1, w.bias, w.A, w.B, keep, 1.0, w.scale))


@pytest.mark.parametrize("masked", [False, True])
def test_a_kept_output_gives_the_same_output_and_gradients_without_the_base_product(masked: bool) -> None:
    """A recomputation that has the output (ops.kept_outputs): only U is formed, and the output and every
    gradient are the computing node's, bit for bit."""
    w = projection(16, 24, 4, True)
    x = torch.randn(2, 5, 16)
    mask = keep_mask(x.shape, 0.25, torch.float32, seed=3) if masked else None
    with torch.no_grad():
        kept = lora_w(x, w, mask).clone()
    want = outputs_and_grads(lambda t: [lora_w(t, w, mask)], x, [w.A, w.B])
    got = outputs_and_grads(lambda t: [lora_w(t, w, mask, kept=kept)], x, [w.A, w.B])
    for g, ref in zip(got, want, strict=True):
        torch.testing.assert_close(g, ref, rtol=0, atol=0)
    assert gemm_shapes(lambda: lora_w(x, w, mask, kept=kept)) == [(10, 4)]
