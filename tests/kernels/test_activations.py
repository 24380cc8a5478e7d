"""Gated-activation kernels vs torch.nn.functional: Triton interpreter (fp32, fp16) and the torch fallback."""

from __future__ import annotations

import pytest
import torch

from loralei.kernels.activations import (
    ACTIVATIONS,
    gated_act_backward,
    gated_act_backward_with_h,
    gated_act_forward,
    triton_usable,
)
from loralei.ops.reference import gated_activation
from tolerances import assert_fp32_close, assert_low_precision_close

SHAPES = [(3, 37), (5, 130), (1, 1)]


def _inputs(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(sum(shape))
    # A wide gate range reaches the tails of every activation.
    gate = (torch.randn(shape, generator=gen) * 3).to(dtype)
    up, dh = (torch.randn(shape, generator=gen).to(dtype) for _ in range(2))
    return gate, up, dh


def _torch_results(gate, up, dh, activation, dtype):
    """``(h, d_gate, d_up)`` from torch.nn.functional and autograd, computed in ``dtype``."""
    g, u = gate.to(dtype).requires_grad_(), up.to(dtype).requires_grad_()
    h = gated_activation(g, u, activation)
    d_gate, d_up = torch.autograd.grad(h, (g, u), dh.to(dtype))
    return h.detach(), d_gate, d_up


def _check(results, gate, up, dh, activation):
    reference = _torch_results(gate, up, dh, activation, torch.float64)
    if gate.dtype == torch.float32:
        for name, got, ref in zip(("h", "d_gate", "d_up"), results, reference, strict=True):
            assert got.dtype == torch.float32
            assert_fp32_close(got, ref, name)
        return
    plain = _torch_results(gate, up, dh, activation, gate.dtype)
    for name, got, pln, ref in zip(("h", "d_gate", "d_up"), results, plain, reference, strict=True):
        assert got.dtype == gate.dtype
        assert_low_precision_close(got, pln, ref, gate.dtype, name)


def _run_all(gate, up, dh, activation):
    h = gated_act_forward(gate, up, activation)
    h2, d_gate, d_up = gated_act_backward_with_h(dh, gate, up, activation)
    d_gate2, d_up2 = gated_act_backward(dh, gate, up, activation)
    assert torch.equal(h, h2) and torch.equal(d_gate, d_gate2) and torch.equal(d_up, d_up2)
    return h, d_gate, d_up


@pytest.mark.parametrize("activation", sorted(ACTIVATIONS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", SHAPES)
def test_triton_interpreter_matches_torch(interpret, activation, dtype, shape):
    gate, up, dh = _inputs(shape, dtype)
    assert triton_usable(gate)
    _check(_run_all(gate, up, dh, activation), gate, up, dh, activation)


@pytest.mark.parametrize("activation", sorted(ACTIVATIONS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_torch_fallback_matches_torch(monkeypatch, activation, dtype):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    gate, up, dh = _inputs((5, 130), dtype)
    assert not triton_usable(gate)
    _check(_run_all(gate, up, dh, activation), gate, up, dh, activation)


@pytest.mark.parametrize("use_interpreter", [False, True])
def test_inplace_backward_reuses_buffers(monkeypatch, use_interpreter):
    if use_interpreter:
        pytest.importorskip("triton")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    else:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    gate, up, dh = _inputs((3, 37), torch.float32)
    expected = gated_act_backward_with_h(dh, gate, up, "gelu_tanh")
    buffers = (dh.clone(), gate.clone(), up.clone())
    versions = [t._version for t in buffers]
    got = gated_act_backward_with_h(*buffers, "gelu_tanh", inplace=True)
    for out, buf, exp, version in zip(got, buffers, expected, versions, strict=True):
        assert out.data_ptr() == buf.data_ptr()
        assert torch.equal(out, exp)
        assert buf._version > version  # autograd must see the overwrite


def test_noncontiguous_inputs(interpret):
    gate, up, dh = (t.t() for t in _inputs((37, 3), torch.float32))
    _check(_run_all(gate, up, dh, "silu"), gate, up, dh, "silu")
    with pytest.raises(ValueError, match="contiguous"):
        gated_act_backward(dh, gate, up, "silu", inplace=True)


def test_forward_is_differentiable():
    gate, up, dh = _inputs((3, 37), torch.float32)
    g, u = gate.requires_grad_(), up.requires_grad_()
    d_gate, d_up = torch.autograd.grad(gated_act_forward(g, u, "gelu"), (g, u), dh)
    assert torch.equal(d_gate, gated_act_backward(dh, gate, up, "gelu")[0])
    assert torch.equal(d_up, gated_act_backward(dh, gate, up, "gelu")[1])


def test_bf16_skips_the_interpreter(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not triton_usable(torch.zeros(2, dtype=torch.bfloat16))


def test_bad_input_errors():
    gate, up, dh = _inputs((3, 37), torch.float32)
    with pytest.raises(ValueError, match=r"activation='relu'.*gelu.*gelu_tanh.*silu"):
        gated_act_forward(gate, up, "relu")
    with pytest.raises(ValueError, match=r"up has shape \(3, 36\)"):
        gated_act_forward(gate, up[:, :36], "silu")
    with pytest.raises(ValueError, match=r"gate has shape .* dtype torch.float64, .* but dh has"):
        gated_act_backward(dh, gate.double(), up, "silu")
    with pytest.raises(ValueError, match="int32 is not supported; use fp32, fp16, bf16 or fp64"):
        gated_act_forward(gate.int(), up.int(), "silu")


@pytest.mark.gpu
@pytest.mark.parametrize("activation", sorted(ACTIVATIONS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cuda_kernel_matches_torch(monkeypatch, activation, dtype):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    gate, up, dh = (t.cuda() for t in _inputs((257, 1000), dtype))
    assert triton_usable(gate)
    _check(_run_all(gate, up, dh, activation), gate, up, dh, activation)


def test_custom_ops_only_where_autograd_or_compile_needs_them(monkeypatch):
    """Eager calls without autograd run the implementation directly (torch.library dispatch costs CPU time per
    call); a forward whose inputs require grad still goes through the differentiable op."""
    from loralei.kernels import activations

    calls = []
    for name in ("_fwd_op", "_bwd_op", "_bwd_inplace_op"):
        real = getattr(activations, name)
        monkeypatch.setattr(activations, name, lambda *a, _n=name, _f=real: calls.append(_n) or _f(*a))
    gate, up, dh = _inputs((3, 37), torch.float32)
    gated_act_forward(gate, up, "silu")
    gated_act_backward(dh, gate, up, "silu")
    gated_act_backward_with_h(dh.clone(), gate.clone(), up.clone(), "silu", inplace=True)
    assert calls == []
    h = gated_act_forward(gate.requires_grad_(), up, "silu")
    assert calls == ["_fwd_op"] and h.requires_grad
