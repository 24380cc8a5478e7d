"""The per-row e4m3 quantization kernel (activations for the FP8 GEMMs) against its torch recipe,
``fp8_gemm.quantize_rows``, bit for bit: codes and scales, with and without the column factor (the weight's row
scales folded into ``dY``), rows padded, ragged and multi-block rows, all-zero rows, values past e4m3's range."""

from __future__ import annotations

import pytest
import torch

from loralei.kernels import fp8_quant
from loralei.modules.quantized import fp8_gemm

needs_fp8_gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9), reason="needs an FP8 GPU"
)


def _expected(x: torch.Tensor, padded: int, factor: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    v = x.float() if factor is None else x.float() * factor
    return fp8_gemm.quantize_rows(torch.nn.functional.pad(v, (0, 0, 0, padded - x.shape[0])))


def _case(rows: int, cols: int, dtype: torch.dtype, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(rows * cols)
    x = torch.randn(rows, cols, generator=g) * torch.logspace(-3, 3, rows).unsqueeze(1)
    x[0] = 0  # an all-zero row: scale 1
    x[-1, -1] = 1e4  # an outlier the scale must absorb
    factor = torch.rand(cols, generator=g) * 1e-2
    return x.to(device, dtype), factor.to(device)


def _assert_same(
    actual: tuple[torch.Tensor, torch.Tensor], expected: tuple[torch.Tensor, torch.Tensor]
) -> None:
    codes, scales = actual
    assert codes.dtype == torch.float8_e4m3fn and scales.dtype == torch.float32
    assert torch.equal(scales, expected[1]), "scales differ"
    assert torch.equal(codes.view(torch.uint8), expected[0].view(torch.uint8)), "codes differ"


@pytest.mark.parametrize(("rows", "cols", "padded"), [(1, 16, 16), (5, 48, 16), (16, 100, 32), (3, 9000, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("folded", [False, True], ids=["plain", "factor"])
def test_kernel_is_bit_identical_to_the_torch_recipe(interpret, rows, cols, padded, dtype, folded) -> None:
    x, factor = _case(rows, cols, dtype)
    factor = factor if folded else None
    _assert_same(fp8_quant.quantize_rows(x, padded, factor), _expected(x, padded, factor))


def test_rows_with_a_stride_are_read_in_place(interpret) -> None:
    wide, _ = _case(8, 96, torch.float32)
    x = wide[:, :64]  # rows 96 apart
    _assert_same(fp8_quant.quantize_rows(x, 16), _expected(x.contiguous(), 16, None))


def test_fp8_gemm_quantizes_activations_with_the_kernel(interpret, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = fp8_quant.quantize_rows
    monkeypatch.setattr(fp8_quant, "quantize_rows", lambda *a: calls.append(a) or real(*a))
    x, factor = _case(5, 32, torch.float32)
    _assert_same(fp8_gemm.quantize_activation(x, factor), _expected(x, 16, factor))
    assert len(calls) == 1


def test_without_triton_the_torch_recipe_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(fp8_quant, "quantize_rows", lambda *a: pytest.fail("the kernel ran on a CPU tensor"))
    x, factor = _case(5, 32, torch.float32)
    _assert_same(fp8_gemm.quantize_activation(x, factor), _expected(x, 16, factor))


@pytest.mark.gpu
@needs_fp8_gpu
@pytest.mark.parametrize("cols", [4096, 14336, 1000])
@pytest.mark.parametrize("folded", [False, True], ids=["plain", "factor"])
def test_gpu_bf16_kernel_is_bit_identical(cols: int, folded: bool) -> None:
    x, factor = _case(300, cols, torch.bfloat16, "cuda")
    factor = factor if folded else None
    _assert_same(fp8_quant.quantize_rows(x, 304, factor), _expected(x, 304, factor))
