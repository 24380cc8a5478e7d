"""The narrow product ``α · Z M`` (r ≤ 32) against torch: the Triton interpreter in fp32 and fp16 at odd shapes and
strided operands (a column slice of a batched U, ``B.t()``), which products ``scaled_mm`` hands it, and bf16 on
the GPU at the Llama-3-8B shapes."""

from __future__ import annotations

import pytest
import torch

from loralei.kernels import narrow_product as kernel
from loralei.ops import gemm
from tolerances import assert_fp32_close, assert_low_precision_close

# (T, r, N): one row, widths below/above a tile, r not a power of two, r = 1, the widest r
SHAPES = [(1, 16, 40), (70, 16, 300), (5, 3, 37), (130, 32, 64), (33, 1, 129), (48, 12, 96)]


def _operands(t: int, r: int, n: int, dtype: torch.dtype, seed: int = 0):
    """``z`` as a column slice of a wider (T, r + 5) matrix and ``m`` as the transpose of an (N, r) ``B``."""
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(t, r + 5, generator=gen)[:, 2 : 2 + r].to(dtype)
    m = torch.randn(n, r, generator=gen).to(dtype).t()
    return z, m


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_kernel_matches_torch_in_the_interpreter(interpret, shape, dtype) -> None:
    z, m = _operands(*shape, dtype)
    assert kernel.usable(z, m, dtype)
    got = kernel.narrow_product(z, m, 0.75)
    exact = 0.75 * z.double() @ m.double()
    assert got.shape == exact.shape and got.dtype == dtype and got.is_contiguous()
    if dtype == torch.float32:
        assert_fp32_close(got, exact, "Z M")
    else:
        assert_low_precision_close(got, (0.75 * z.float() @ m.float()).to(dtype), exact, dtype, "Z M")


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n_addends", [1, 2])
def test_addends_join_the_product_before_its_one_rounding(interpret, shape, dtype, n_addends) -> None:
    """``Σ addends + α Z M``; the first addend a column slice of a wider matrix (its rows strided)."""
    z, m = _operands(*shape, dtype)
    t, _, n = shape
    gen = torch.Generator().manual_seed(1)
    wide = torch.randn(t, n + 3, generator=gen)[:, 1 : 1 + n].to(dtype)
    addends = (wide, torch.randn(t, n, generator=gen).to(dtype))[:n_addends]
    got = kernel.narrow_product(z, m, 0.75, addends)
    exact = 0.75 * z.double() @ m.double() + sum(a.double() for a in addends)
    assert got.shape == exact.shape and got.dtype == dtype and got.is_contiguous()
    if dtype == torch.float32:
        assert_fp32_close(got, exact, "Z M + addends")
    else:
        plain = (0.75 * z.float() @ m.float() + sum(a.float() for a in addends)).to(dtype)
        assert_low_precision_close(got, plain, exact, dtype, "Z M + addends")


def test_addends_of_another_shape_dtype_or_layout_are_refused(interpret) -> None:
    z, m = _operands(8, 16, 24, torch.float32)
    good = torch.zeros(8, 24)
    bad = {
        "shape": torch.zeros(8, 23),
        "dtype": torch.zeros(8, 24, dtype=torch.float16),
        "columns": torch.zeros(24, 8).t(),
    }
    for addend in bad.values():
        with pytest.raises(ValueError, match=r"addend is .*expected \(8, 24\) torch.float32"):
            kernel.narrow_product(z, m, 1.0, (good, addend))
    with pytest.raises(ValueError, match="at most 2 addends, got 3"):
        kernel.narrow_product(z, m, 1.0, (good, good, good))


def test_empty_products_are_empty(interpret) -> None:
    z, m = _operands(0, 4, 8, torch.float32)
    assert kernel.narrow_product(z, m, 1.0).shape == (0, 8)


def test_only_narrow_products_of_one_dtype_run_here(interpret, monkeypatch) -> None:
    z, m = _operands(8, 16, 24, torch.float32)
    assert kernel.usable(z, m, torch.float32)
    wide, m_wide = _operands(8, kernel.MAX_WIDTH + 1, 24, torch.float32)
    assert not kernel.usable(wide, m_wide, torch.float32)
    assert not kernel.usable(z, m, torch.float64)  # an FP32 gradient from low-precision inputs: cuBLAS
    assert not kernel.usable(z, m.double(), torch.float32)
    assert not kernel.usable(z.bfloat16(), m.bfloat16(), torch.bfloat16)  # bf16: NaN in the interpreter
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not kernel.usable(z, m, torch.float32)  # a compiled graph keeps the GEMM


def test_without_the_interpreter_cpu_tensors_take_torch(monkeypatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    z, m = _operands(8, 16, 24, torch.float32)
    assert not kernel.usable(z, m, torch.float32)
    assert torch.equal(
        gemm.scaled_mm(z, m, 0.5, torch.float32), torch.addmm(z.new_empty(8, 24), z, m, beta=0, alpha=0.5)
    )


def test_scaled_mm_hands_narrow_products_to_the_kernel(interpret, monkeypatch) -> None:
    """The LoRA term ``s · U Bᵀ`` goes to the kernel; a gradient's long reduction (dA = Gᵀ X) stays a GEMM."""
    calls = []
    product = kernel.narrow_product
    monkeypatch.setattr(kernel, "narrow_product", lambda *a: calls.append(a[0].shape) or product(*a))
    z, m = _operands(40, 16, 24, torch.float32)
    torch.testing.assert_close(gemm.scaled_mm(z, m, 2.0, torch.float32), 2.0 * z @ m)
    g, x = torch.randn(40, 16), torch.randn(40, 24)
    torch.testing.assert_close(gemm.scaled_mm(g.t(), x, 2.0, torch.float32), 2.0 * g.t() @ x)
    assert calls == [(40, 16)]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(8192, 16, 4096), (8192, 32, 4096), (8192, 16, 1024), (300, 7, 5000)])
def test_the_kernel_matches_torch_on_the_gpu(shape) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    z, m = (t.cuda() for t in _operands(*shape, torch.bfloat16))
    got = kernel.narrow_product(z, m, 2.0)
    plain = torch.addmm(z.new_empty(z.shape[0], m.shape[1]), z, m, beta=0, alpha=2.0)
    assert_low_precision_close(got, plain, 2.0 * z.double() @ m.double(), torch.bfloat16, "Z M")


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(8192, 16, 4096), (300, 7, 5000)])
def test_addends_join_on_the_gpu(shape) -> None:
    """bf16: the down term with the MLP's base output and the residual, as the pre-norm layers' last add."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    z, m = (t.cuda() for t in _operands(*shape, torch.bfloat16))
    gen = torch.Generator().manual_seed(2)
    a1, a2 = (torch.randn(shape[0], shape[2], generator=gen).bfloat16().cuda() for _ in range(2))
    got = kernel.narrow_product(z, m, 1.0, (a1, a2))
    plain = torch.addmm(a1, z, m) + a2
    exact = z.double() @ m.double() + a1.double() + a2.double()
    assert_low_precision_close(got, plain, exact, torch.bfloat16, "Z M + addends")
