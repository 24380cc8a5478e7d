"""The MoE elementwise kernels (per-token combine, gated activation of [gate, up] rows and its backward with the
routing weights' gradient) in the Triton interpreter against plain torch, at shapes with ragged edges."""

from __future__ import annotations

import pytest
import torch

from loralei.kernels import moe
from loralei.ops import reference
from tolerances import assert_fp32_close

SHAPES = [(7, 5), (33, 24), (64, 100)]  # (rows, I): not multiples of the kernels' row / column blocks
ACTIVATIONS = ["silu", "gelu", "gelu_tanh"]


@pytest.fixture
def interpret_moe(interpret, monkeypatch: pytest.MonkeyPatch) -> None:
    """The interpreter for loralei.kernels.moe too: its torch fallback must not run."""

    def fail(*args, **kwargs):
        raise AssertionError("the torch fallback ran where the Triton interpreter should have")

    monkeypatch.setattr(moe, "torch_act_and_slope", fail)


def _act_reference(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    return reference.gated_activation(*gate_up.double().chunk(2, dim=-1), activation)


@pytest.mark.parametrize(("rows", "inter"), SHAPES)
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("path", ["interpreter", "torch"])
def test_activation_forward_and_backward(rows: int, inter: int, activation: str, path: str, request) -> None:
    if path == "interpreter":
        request.getfixturevalue("interpret_moe")
    g = torch.Generator().manual_seed(rows)
    gate_up = torch.randn(rows, 2 * inter, generator=g)
    dh1 = torch.randn(rows, inter, generator=g)
    w = torch.rand(rows, generator=g)
    assert_fp32_close(moe.act_forward(gate_up, activation), _act_reference(gate_up, activation), "h")

    leaf = gate_up.double().requires_grad_()
    h = _act_reference(leaf, activation)
    (d_gate_up,) = torch.autograd.grad(h, leaf, dh1.double() * w.double().unsqueeze(-1))
    dh_buf, gu_buf = dh1.clone(), gate_up.clone()
    dw = moe.act_backward_(dh_buf, gu_buf, w, activation)
    assert_fp32_close(gu_buf, d_gate_up, "[d_gate, d_up] written over gate_up")
    assert_fp32_close(dh_buf, h, "h written over dh")
    assert_fp32_close(dw, (dh1.double() * h).sum(-1), "routing weight gradient")


@pytest.mark.parametrize(("tokens", "top_k", "n"), [(5, 2, 7), (9, 3, 1030), (4, 1, 16)])
@pytest.mark.parametrize("weighted", [True, False])
def test_combine_sums_each_tokens_rows(
    tokens: int, top_k: int, n: int, weighted: bool, interpret_moe
) -> None:
    g = torch.Generator().manual_seed(n)
    rows = torch.randn(tokens * top_k, n, generator=g)
    position = torch.randperm(tokens * top_k, generator=g)
    weights = torch.rand(tokens, top_k, generator=g) if weighted else None
    picked = rows[position].view(tokens, top_k, n).double()
    expected = (picked * weights.double().unsqueeze(-1) if weighted else picked).sum(1)
    assert_fp32_close(moe.combine(rows, position, weights, tokens), expected, "combine")


@pytest.mark.parametrize(("rows", "inter"), SHAPES)
@pytest.mark.parametrize("path", ["interpreter", "torch"])
def test_activation_sums_its_two_addends(rows: int, inter: int, path: str, request) -> None:
    """``act_forward`` / ``act_backward_`` with ``extra``: the same as on the summed input, and the forward
    writes the sum back over its first addend only when asked (``store_sum``)."""
    if path == "interpreter":
        request.getfixturevalue("interpret_moe")
    g = torch.Generator().manual_seed(rows + 1)
    base, lora = torch.randn(rows, 2 * inter, generator=g), torch.randn(rows, 2 * inter, generator=g)
    dh_base, dh_lora = torch.randn(rows, inter, generator=g), torch.randn(rows, inter, generator=g)
    w = torch.rand(rows, generator=g)
    summed = base + lora
    kept = base.clone()
    assert_fp32_close(moe.act_forward(kept, "silu", lora), _act_reference(summed, "silu"), "h of the sum")
    assert torch.equal(kept, base), "without store_sum the first addend is left alone"
    assert_fp32_close(
        moe.act_forward(kept, "silu", lora, store_sum=True), _act_reference(summed, "silu"), "h"
    )
    assert_fp32_close(kept, summed, "the sum written over the first addend")

    dh_expected, gu_expected = dh_base + dh_lora, summed.clone()
    dw_expected = moe.act_backward_(dh_expected, gu_expected, w, "silu")
    dh_buf = dh_base.clone()
    dw = moe.act_backward_(dh_buf, kept, w, "silu", dh_lora)
    assert_fp32_close(dw, dw_expected, "routing weight gradient")
    assert_fp32_close(kept, gu_expected, "[d_gate, d_up]")
    assert_fp32_close(dh_buf, dh_expected, "h written over the first addend")


@pytest.mark.parametrize(("tokens", "top_k", "n"), [(5, 2, 7), (9, 3, 1030)])
def test_combine_sums_both_addends(tokens: int, top_k: int, n: int, interpret_moe) -> None:
    g = torch.Generator().manual_seed(n + 1)
    rows, extra = torch.randn(tokens * top_k, n, generator=g), torch.randn(tokens * top_k, n, generator=g)
    position = torch.randperm(tokens * top_k, generator=g)
    weights = torch.rand(tokens, top_k, generator=g)
    expected = moe.combine(rows + extra, position, weights, tokens)
    assert_fp32_close(
        moe.combine(rows, position, weights, tokens, extra), expected, "combine of rows + extra"
    )


@pytest.mark.parametrize(("tokens", "routes", "n"), [(4, 9, 7), (3, 12, 1030)])
def test_gather_picks_each_routes_token_row(tokens: int, routes: int, n: int, interpret_moe) -> None:
    g = torch.Generator().manual_seed(routes)
    x = torch.randn(tokens, n, generator=g)
    token = torch.randint(0, tokens, (routes,), generator=g)
    assert torch.equal(moe.gather(x, token), x[token])
