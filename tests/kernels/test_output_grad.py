"""The output-gradient kernel vs torch (Triton interpreter, fp32 and fp16): ``dY B`` and ``dYᵀ U`` from one pass
over ``dY``, at odd shapes, ranks below, at and above the 16-wide padding, strided operands and row shares
left with no rows."""

from __future__ import annotations

import pytest
import torch

from loralei.kernels import gated_mlp, output_grad
from tolerances import assert_fp32_close, assert_low_precision_close


@pytest.fixture
def looping_interpreter(interpret) -> None:
    if not gated_mlp.interpreter_runs_loops():
        pytest.skip(
            "this Triton's interpreter cannot run loops with run-time bounds; the GPU tests cover the kernel"
        )


# (T, N, r, splits): splits None takes the default; 7 shares of 5 rows leave some shares empty
CASES = [(37, 45, 8, 1), (21, 70, 1, 2), (50, 33, 16, 3), (5, 19, 64, 7), (300, 40, 20, None)]
SCALE = 1.75


def _inputs(tokens: int, n_out: int, rank: int, dtype: torch.dtype, b_dtype: torch.dtype = torch.float32):
    """``dY`` as a column slice of a wider buffer (row stride > N), ``B`` as the transposed view of an (r, N)
    tensor (fp32 by default: a factor kept in fp32), ``U`` as a column slice of a (T, r + 3) buffer (as
    U_plain's)."""
    gen = torch.Generator().manual_seed(tokens * n_out + rank)
    dy = torch.randn(tokens, n_out + 5, generator=gen).to(dtype)[:, 2 : 2 + n_out]
    b = (torch.randn(rank, n_out, generator=gen) / 4).to(b_dtype).t()
    u = torch.randn(tokens, rank + 3, generator=gen).to(dtype)[:, 3:]
    return dy, b, u


def _expected(dy, b, u, dtype):
    """``(dY B, s dYᵀ U)`` from the dtype's values (``B`` cast to it), accumulated in fp32 for low precision."""
    acc = torch.float32 if dtype != torch.float64 else dtype
    dy_, b_, u_ = dy.to(acc), b.to(dy.dtype).to(acc), u.to(acc)
    return (dy_ @ b_).to(dtype), SCALE * (dy_.t() @ u_)


def _assert_close(got, dy, b, u, dtype) -> None:
    reference = _expected(dy.double(), b.double(), u.double(), torch.float64)
    plain = _expected(dy, b, u, dtype)
    for name, g, ref, pln in zip(("dY B", "s dY^T U"), got, reference, plain, strict=True):
        if dtype == torch.float32:
            assert_fp32_close(g, ref, name)
        else:
            assert_low_precision_close(g.to(dtype), pln.to(dtype), ref, dtype, name)


@pytest.mark.parametrize("b_in_fp32", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", CASES)
def test_kernel_matches_torch_in_interpreter(looping_interpreter, dtype, case, b_in_fp32):
    tokens, n_out, rank, splits = case
    dy, b, u = _inputs(tokens, n_out, rank, dtype, torch.float32 if b_in_fp32 else dtype)
    assert output_grad.usable(dy, u)
    g, db = output_grad.output_grad_products(dy, b, u, SCALE, splits)
    assert (g.shape, g.dtype, db.shape, db.dtype) == ((tokens, rank), dtype, (n_out, rank), b.dtype)
    _assert_close((g, db), dy, b, u, dtype)


def test_split_count_does_not_change_the_result(looping_interpreter):
    dy, b, u = _inputs(40, 50, 8, torch.float32)
    first = output_grad.output_grad_products(dy, b, u, SCALE, 1)
    for splits in (2, 5, 40):
        for a, other in zip(first, output_grad.output_grad_products(dy, b, u, SCALE, splits), strict=True):
            assert_fp32_close(other, a)


def _copy_target(dy: torch.Tensor) -> torch.Tensor:
    """A (T, N) column block of a wider buffer, as a group's spare columns are."""
    return torch.full((dy.shape[0], dy.shape[1] + 7), float("nan"), dtype=dy.dtype, device=dy.device)[:, 4:-3]


@pytest.mark.parametrize("case", [CASES[0], CASES[3], CASES[4]])
def test_the_same_pass_copies_dy(looping_interpreter, case):
    """``copy_to`` gets every element of ``dY`` (empty row shares and partial blocks included), the products stay."""
    tokens, n_out, rank, splits = case
    dy, b, u = _inputs(tokens, n_out, rank, torch.float32)
    copy = _copy_target(dy)
    got = output_grad.output_grad_products(dy, b, u, SCALE, splits, copy_to=copy)
    assert torch.equal(copy, dy)
    _assert_close(got, dy, b, u, torch.float32)
    with pytest.raises(ValueError, match="copy_to"):
        output_grad.output_grad_products(dy, b, u, SCALE, splits, copy_to=copy.double())


def test_usable_only_where_triton_runs_and_layouts_fit(monkeypatch):
    dy, u = torch.zeros(6, 8), torch.zeros(6, 4)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not output_grad.usable(dy, u)  # CPU tensor, compiled mode: the GEMMs run
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert output_grad.usable(dy, u) == gated_mlp.interpreter_runs_loops()
    assert not output_grad.usable(dy.t(), torch.zeros(8, 4))  # columns not contiguous
    assert not output_grad.usable(dy, torch.zeros(4, 6).t())
    assert not output_grad.usable(dy, u.half())  # U in another dtype
    assert not output_grad.usable(dy, torch.zeros(6, gated_mlp.MAX_RANK + 1))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not output_grad.usable(dy, u)  # inside a torch.compile trace: the GEMMs


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(("tokens", "n_out", "rank"), [(8192, 4096, 16), (8192, 1024, 16), (1000, 333, 8)])
def test_cuda_kernel_matches_torch(monkeypatch, dtype, tokens, n_out, rank):
    """On the GPU (autotuned), at the 8B shape's q/o/down and k/v widths and an odd one: within the tolerance
    table of the same products in torch in the dtype."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    dy, b, u = (t.cuda() for t in _inputs(tokens, n_out, rank, dtype))
    assert output_grad.usable(dy, u)
    _assert_close(output_grad.output_grad_products(dy, b, u, SCALE), dy, b, u, dtype)
    copy = _copy_target(dy)
    _assert_close(output_grad.output_grad_products(dy, b, u, SCALE, copy_to=copy), dy, b, u, dtype)
    assert torch.equal(copy, dy)
