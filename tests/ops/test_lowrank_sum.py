"""``Σ addends + U Bᵀ`` as one node (the MLP's down term joining the residual add) against torch's autograd:
output and the gradients of U, B and each addend, in the Triton interpreter and on torch's path."""

from __future__ import annotations

import pytest
import torch

from loralei.ops import lowrank_sum
from tolerances import assert_fp32_close


def _inputs(t: int, r: int, n: int, b_dtype: torch.dtype = torch.float32, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    u = torch.randn(t, r + 3, generator=gen)[:, :r].requires_grad_()  # a strided (T, r), like U' slices
    b = torch.randn(n, r, generator=gen).to(b_dtype).requires_grad_()
    addends = [torch.randn(t, n, generator=gen).requires_grad_() for _ in range(2)]
    return u, b, addends


def _grads(fn, u, b, addends, dy):
    out = fn(u, b, *addends)
    return [out.detach(), *torch.autograd.grad(out, [u, b, *addends], dy)]


def _torch(u, b, *addends):
    return sum(addends, u @ b.to(u.dtype).t())


@pytest.mark.parametrize("shape", [(24, 4, 40), (70, 16, 33), (5, 1, 64)])
@pytest.mark.parametrize("n_addends", [1, 2])
def test_the_kernel_node_matches_torch_in_the_interpreter(monkeypatch, shape, n_addends) -> None:
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    calls = []
    node = lowrank_sum._LowRankSum.apply
    monkeypatch.setattr(lowrank_sum._LowRankSum, "apply", lambda *a: calls.append(1) or node(*a))
    u, b, addends = _inputs(*shape)
    addends = addends[:n_addends]
    dy = torch.randn(shape[0], shape[2])
    got = _grads(lowrank_sum.lowrank_sum, u, b, addends, dy)
    want = _grads(_torch, u, b, addends, dy)
    assert calls == [1]
    names = ["out", "dU", "dB", *[f"d addend {i}" for i in range(n_addends)]]
    for name, g, w in zip(names, got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape, name
        assert_fp32_close(g, w, name)


def test_b_keeps_its_own_dtype(monkeypatch) -> None:
    """An FP32 ``B`` (``lora_fp32_gradients``) with fp16 activations: the product in fp16, dB in FP32."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    u, b, addends = _inputs(24, 8, 32)
    u16 = u.detach().half().requires_grad_()
    a16 = addends[0].detach().half().requires_grad_()
    assert lowrank_sum.usable(u16, b, a16)
    out = lowrank_sum.lowrank_sum(u16, b, a16)
    d_u, d_b, d_a = torch.autograd.grad(out, [u16, b, a16], torch.ones_like(out))
    assert (out.dtype, d_u.dtype, d_b.dtype, d_a.dtype) == (
        torch.float16,
        torch.float16,
        torch.float32,
        torch.float16,
    )
    exact_db = torch.ones(24, 32).double().t() @ u16.double()
    assert_fp32_close(d_b.double(), exact_db, "dB", tolerance=1e-3)


def test_elsewhere_torch_sums(monkeypatch) -> None:
    """No Triton here (CPU without the interpreter), or an addend in another dtype: torch's ops, same result."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    u, b, addends = _inputs(16, 4, 24)
    assert not lowrank_sum.usable(u, b, *addends)
    dy = torch.randn(16, 24)
    got, want = _grads(lowrank_sum.lowrank_sum, u, b, addends, dy), _grads(_torch, u, b, addends, dy)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert lowrank_sum.usable(u, b, *addends)
    assert not lowrank_sum.usable(u, b, addends[0].half())
