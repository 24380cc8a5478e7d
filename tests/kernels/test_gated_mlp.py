"""Gated-activation backward fused with the MLP's rank-r reductions vs torch: Triton interpreter, fp32 and fp16."""

from __future__ import annotations

import pytest
import torch

from loralei.kernels import gated_mlp
from loralei.kernels.activations import ACTIVATIONS
from loralei.ops.reference import gated_activation
from tolerances import assert_fp32_close, assert_low_precision_close


@pytest.fixture
def looping_interpreter(interpret) -> None:
    if not gated_mlp.interpreter_runs_loops():
        pytest.skip(
            "this Triton's interpreter cannot run loops with run-time bounds; the GPU tests cover the kernel"
        )


# (T, I, r_down, r_gate, r_up, splits): odd sizes, ranks below and above the 16-wide padding, unequal ranks,
# and reductions split among several programs (some of them left with no rows or columns).
CASES = [(37, 45, 8, 8, 8, 1), (21, 70, 1, 3, 20, 2), (50, 33, 16, 16, 16, 3), (5, 19, 64, 2, 5, 7)]


def _tensors(tokens, inter, r_d, r_g, r_u, dtype):
    gen = torch.Generator().manual_seed(tokens * inter + r_d)
    gate = (torch.randn(tokens, inter, generator=gen) * 3).to(dtype)  # wide: reaches the activations' tails
    up, dh = (torch.randn(tokens, inter, generator=gen).to(dtype) for _ in range(2))
    p_down = torch.randn(tokens, r_d, generator=gen).to(dtype)
    z = torch.randn(tokens, r_g + r_u, generator=gen).to(dtype)
    return gate, up, dh, p_down, z[:, :r_g], z[:, r_g:]  # z_gate, z_up: strided column views


def _expected(gate, up, dh, p_down, z_gate, z_up, activation, dtype):
    """``(dG, dU, P_dᵀh, dGᵀZ_g, dUᵀZ_u)`` by autograd and matmuls in ``dtype`` (h, dG, dU rounded to it)."""
    g, u = gate.to(dtype).requires_grad_(), up.to(dtype).requires_grad_()
    h = gated_activation(g, u, activation)
    d_gate, d_up = torch.autograd.grad(h, (g, u), dh.to(dtype))
    # the products from the dtype's values, accumulated in fp32 for fp16 (as the kernel and the GEMMs it replaces)
    acc = torch.float32 if dtype == torch.float16 else dtype
    h, dg, du, pd, zg, zu = (t.detach().to(acc) for t in (h, d_gate, d_up, p_down, z_gate, z_up))
    return d_gate, d_up, pd.t() @ h, dg.t() @ zg, du.t() @ zu


NAMES = ("dG", "dU", "P_d^T h", "dG^T Z_g", "dU^T Z_u")


@pytest.mark.parametrize("activation", sorted(ACTIVATIONS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", CASES)
def test_kernel_matches_torch_in_interpreter(looping_interpreter, activation, dtype, case):
    tokens, inter, r_d, r_g, r_u, splits = case
    gate, up, dh, p_down, z_gate, z_up = _tensors(tokens, inter, r_d, r_g, r_u, dtype)
    assert gated_mlp.usable(gate, (r_d, r_g, r_u))
    d_gate, d_up = gate.clone(), up.clone()
    products = gated_mlp.gated_mlp_backward_(dh, d_gate, d_up, p_down, z_gate, z_up, activation, splits)
    got = (d_gate, d_up, *products)
    assert [t.shape for t in got] == [
        (tokens, inter),
        (tokens, inter),
        (r_d, inter),
        (inter, r_g),
        (inter, r_u),
    ]
    assert [t.dtype for t in got] == [dtype] * 2 + [torch.float32] * 3
    reference = _expected(gate, up, dh, p_down, z_gate, z_up, activation, torch.float64)
    if dtype == torch.float32:
        for name, g, ref in zip(NAMES, got, reference, strict=True):
            assert_fp32_close(g, ref, name)
        return
    plain = _expected(gate, up, dh, p_down, z_gate, z_up, activation, dtype)
    for name, g, pln, ref in zip(NAMES, got, plain, reference, strict=True):
        assert_low_precision_close(g.to(dtype), pln.to(dtype), ref, dtype, name)


def test_split_count_does_not_change_the_result(looping_interpreter):
    """Any number of programs sharing the row reduction gives the same values (fp32)."""
    gate, up, dh, p_down, z_gate, z_up = _tensors(40, 50, 8, 8, 8, torch.float32)
    results = []
    for splits in (1, 2, 5):
        d_gate, d_up = gate.clone(), up.clone()
        products = gated_mlp.gated_mlp_backward_(dh, d_gate, d_up, p_down, z_gate, z_up, "silu", splits)
        results.append([d_gate, d_up, *products])
    for other in results[1:]:
        for a, b in zip(results[0], other, strict=True):
            assert_fp32_close(b, a)


def test_usable_only_where_triton_runs_and_rank_fits(monkeypatch):
    gate = torch.zeros(4, 8)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not gated_mlp.usable(gate, (8, 8, 8))  # CPU tensor, compiled mode: the unfused path runs
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert gated_mlp.usable(gate, (8, 8, gated_mlp.MAX_RANK)) == gated_mlp.interpreter_runs_loops()
    assert not gated_mlp.usable(gate, (8, 8, gated_mlp.MAX_RANK + 1))
    assert not gated_mlp.usable(gate.double(), (8, 8, 8))


def test_bad_layouts_are_refused(interpret):
    gate, up, dh, p_down, z_gate, z_up = _tensors(8, 16, 4, 4, 4, torch.float32)
    with pytest.raises(ValueError, match="dh must be contiguous"):
        gated_mlp.gated_mlp_backward_(dh.t().contiguous().t(), gate, up, p_down, z_gate, z_up, "silu")
    with pytest.raises(ValueError, match="p_down must have contiguous columns"):
        gated_mlp.gated_mlp_backward_(dh, gate, up, p_down.t().contiguous().t(), z_gate, z_up, "silu")


def test_op_passes_opcheck(looping_interpreter):
    """The custom op torch.compile sees: schema (gate/up mutated), fake outputs, no aliasing."""
    gate, up, dh, p_down, z_gate, z_up = _tensors(12, 20, 4, 4, 4, torch.float32)
    args = (dh, gate, up, p_down, z_gate.contiguous(), z_up.contiguous(), "silu", 2)
    torch.library.opcheck(gated_mlp._backward_op, args)
