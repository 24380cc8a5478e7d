"""DoRA's output-gradient kernel vs torch (Triton interpreter, fp32 and fp16): ``dY ⊙ g`` and ``Σ_t dY ⊙ Y`` from
one pass, at odd shapes, strided operands and row shares left with no rows; and the DoRA op with the kernel in
its backward against the fp64 twin."""

from __future__ import annotations

import pytest
import torch

from loralei.kernels import dora, gated_mlp
from loralei.ops import reference
from loralei.ops.dora import dora_w, row_norms, squared_row_norms
from op_cases import as_dtype, outputs_and_grads, projection
from tolerances import assert_fp32_close, assert_low_precision_close


@pytest.fixture
def looping_interpreter(interpret) -> None:
    if not gated_mlp.interpreter_runs_loops():
        pytest.skip("this Triton's interpreter cannot run loops with run-time bounds")


# (T, N, splits): splits None takes the default; 7 shares of 5 rows leave some shares empty
CASES = [(37, 45, 1), (21, 70, 2), (5, 19, 7), (300, 40, None)]


def _inputs(tokens: int, n_out: int, dtype: torch.dtype):
    """``dY`` as a column slice of a wider buffer (row stride > N), ``Y`` contiguous, ``g`` FP32."""
    gen = torch.Generator().manual_seed(tokens * n_out)
    dy = torch.randn(tokens, n_out + 5, generator=gen).to(dtype)[:, 2 : 2 + n_out]
    y = torch.randn(tokens, n_out, generator=gen).to(dtype)
    g = 1 + 0.3 * torch.randn(n_out, generator=gen)
    return dy, y, g


@pytest.mark.usefixtures("looping_interpreter")
@pytest.mark.parametrize(("tokens", "n_out", "splits"), CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kernel_matches_torch(tokens: int, n_out: int, splits: int | None, dtype: torch.dtype) -> None:
    dy, y, g = _inputs(tokens, n_out, dtype)
    assert dora.usable(dy, y)
    scaled, dots = dora.scaled_grad_and_dots(dy, y, g, splits)
    want_scaled = dy.double() * g.double()
    want_dots = (dy.double() * y.double()).sum(0)
    assert scaled.dtype == dtype and dots.dtype == torch.float32
    if dtype == torch.float32:
        assert_fp32_close(scaled, want_scaled, "dY ⊙ g")
        assert_fp32_close(dots, want_dots, "column dots")
    else:
        plain_scaled = (dy.float() * g).to(dtype)
        assert_low_precision_close(scaled, plain_scaled, want_scaled, dtype, "dY ⊙ g")
        assert_fp32_close(dots, want_dots, "column dots", tolerance=1e-6)


@pytest.mark.usefixtures("looping_interpreter")
def test_dora_op_with_the_kernel_matches_the_twin(monkeypatch) -> None:
    launched = []
    original = dora.scaled_grad_and_dots
    monkeypatch.setattr(dora, "scaled_grad_and_dots", lambda *a: launched.append(1) or original(*a))
    w = projection(24, 40, 4, True)
    norms = row_norms(w, squared_row_norms(w))
    m = (norms * (1 + 0.2 * torch.randn(norms.shape))).requires_grad_()
    w64 = as_dtype(w, torch.float64)
    m64 = m.detach().double().requires_grad_()
    x = torch.randn(3, 7, 24)
    fused = outputs_and_grads(lambda t: [dora_w(t, w, m, squared_row_norms(w))], x, [w.A, w.B, m])
    assert launched
    expected = outputs_and_grads(
        lambda t: [reference.dora_linear(t, w64, m64)], x.double(), [w64.A, w64.B, m64]
    )
    for name, f, e in zip(["Y", "dX", "dA", "dB", "dm"], fused, expected, strict=True):
        assert_fp32_close(f, e, name)


def test_not_usable_for_strided_columns_or_mixed_dtypes(interpret) -> None:
    dy, y, _ = _inputs(8, 6, torch.float32)
    assert not dora.usable(dy.t().contiguous().t(), y)
    assert not dora.usable(dy, y.half())
