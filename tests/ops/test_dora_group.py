"""DoRA members in a shared-input group against PEFT's DoRA written plainly (``reference.dora_linear`` per DoRA
member, ``reference.lora_linear`` for the others): every output and the gradients of x, every A, B and every
magnitude, in fp64 and fp32."""

from __future__ import annotations

import contextlib

import pytest
import torch

from loralei.errors import LoraleiError
from loralei.ops import reference
from loralei.ops.dora import dora_scale, row_norms, squared_row_norms
from loralei.ops.recompute import recomputation
from loralei.ops.shared_input import lora_group
from loralei.ops.weights import LoRAWeights
from op_cases import as_dtype, keep_mask, outputs_and_grads, projection
from tolerances import assert_fp32_close

# (in, outs): q/k/v-like members of different widths
SHAPES = pytest.mark.parametrize(("inp", "outs"), [(16, (16, 8, 8)), (12, (20, 6)), (10, (7,))])


def _magnitude(w: LoRAWeights, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    norms = row_norms(w, squared_row_norms(w)).to(w.dtype)
    return (norms * (1 + 0.3 * torch.randn(norms.shape, generator=g, dtype=w.dtype))).requires_grad_()


def _setup(inp: int, outs: tuple[int, ...], bias: bool, dtype: torch.dtype, dora: list[bool]):
    ws = [as_dtype(projection(inp, o, 4, bias, scale=0.5 + k, seed=k), dtype) for k, o in enumerate(outs)]
    mags = [_magnitude(w, 20 + k) if d else None for k, (w, d) in enumerate(zip(ws, dora, strict=True))]
    return ws, mags


def _check(ws, mags, x, tolerance, masks=None):
    masks = masks or [None] * len(ws)
    scales = [
        None if m is None else dora_scale(w, m, squared_row_norms(w)) for w, m in zip(ws, mags, strict=True)
    ]

    def plain(t):
        return [
            reference.lora_linear(t, w, dropout_mask=k) if m is None else reference.dora_linear(t, w, m)
            for w, m, k in zip(ws, mags, masks, strict=True)
        ]

    params = [p for w in ws for p in (w.A, w.B)] + [m for m in mags if m is not None]
    fused = outputs_and_grads(lambda t: lora_group(t, ws, masks, scales), x, params)
    expected = outputs_and_grads(plain, x, params)
    for k, (got, want) in enumerate(zip(fused, expected, strict=True)):
        assert got.shape == want.shape and got.dtype == want.dtype, k
        assert_fp32_close(got, want, f"output/grad {k}", tolerance=tolerance)


@SHAPES
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("pattern", ["all", "first", "last"])
@pytest.mark.parametrize("keep", [False, True], ids=["z-again", "y-kept"])
def test_matches_peft_dora_fp64(inp, outs, bias, pattern, keep):
    """Outside a recomputation the backward forms each Z_i again; inside one it reads dm from the kept Y_i."""
    n = len(outs)
    dora = {"all": [True] * n, "first": [k == 0 for k in range(n)], "last": [k == n - 1 for k in range(n)]}
    ws, mags = _setup(inp, outs, bias, torch.float64, dora[pattern])
    with recomputation(early_stop=False) if keep else contextlib.nullcontext():
        _check(ws, mags, torch.randn(2, 5, inp, dtype=torch.float64), 1e-12)


def test_fp32_and_a_plain_member_with_dropout():
    """A LoRA member with a dropout mask beside DoRA members without one."""
    ws, mags = _setup(16, (16, 8, 8), True, torch.float32, [True, False, True])
    x = torch.randn(3, 4, 16)
    _check(ws, mags, x, 1e-5, [None, keep_mask(x.shape, 0.3, torch.float32, seed=2), None])


def test_refuses_dora_member_with_dropout():
    ws, mags = _setup(8, (8, 4), False, torch.float32, [True, True])
    scales = [dora_scale(w, m, squared_row_norms(w)) for w, m in zip(ws, mags, strict=True)]
    ws[1] = ws[1]._replace(dropout_p=0.1)
    with pytest.raises(LoraleiError, match=r"lora_group member 1: DoRA with dropout \(dropout_p=0\.1\)"):
        lora_group(torch.randn(2, 8), ws, scales=scales)


@pytest.mark.parametrize("keep", [False, True], ids=["outside", "inside-recomputation"])
def test_keeps_the_outputs_only_inside_a_recomputation(keep):
    """Outside a recomputation the group saves what LoRA's saves (no (T, out_i) tensor); inside, each DoRA Y_i."""
    ws, mags = _setup(10, (12, 6), False, torch.float32, [True, True])
    scales = [dora_scale(w, m, squared_row_norms(w)) for w, m in zip(ws, mags, strict=True)]
    x = torch.randn(7, 10, requires_grad=True)
    shapes = []
    with (
        recomputation(early_stop=False) if keep else contextlib.nullcontext(),
        torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.append(tuple(t.shape)) or t, lambda t: t),
    ):
        lora_group(x, ws, scales=scales)
    outputs = [s for s in shapes if s in ((7, 12), (7, 6))]
    assert sorted(outputs) == ([(7, 6), (7, 12)] if keep else [])
