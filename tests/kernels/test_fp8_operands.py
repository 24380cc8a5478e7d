"""The FP8 GEMM operand kernels against their torch recipes, bit for bit.

Quantization (``fp8_gemm.quantize_rows`` of the concatenated, factor-scaled rows): codes and scales, one to
three segments, with and without the column factors (the weight's row scales folded into ``dY``), rows padded,
ragged and multi-block rows, all-zero rows, values past e4m3's range. Transposition: codes into a column slice
of a wider buffer."""

from __future__ import annotations

import pytest
import torch

from loralei.kernels import fp8_operands
from loralei.modules.quantized import fp8_gemm

needs_fp8_gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9), reason="needs an FP8 GPU"
)


def _expected(xs: list[torch.Tensor], padded: int, factors: list[torch.Tensor] | None):
    parts = (
        [x.float() for x in xs]
        if factors is None
        else [x.float() * f for x, f in zip(xs, factors, strict=True)]
    )
    v = torch.cat(parts, 1)
    return fp8_gemm.quantize_rows(torch.nn.functional.pad(v, (0, 0, 0, padded - v.shape[0])), reciprocal=True)


def _case(rows: int, widths: list[int], dtype: torch.dtype, device: str = "cpu"):
    """Segments of ``rows`` rows whose magnitudes span six decades by row, an all-zero first row and an
    outlier in the last segment's last column; and a (width,) factor per segment."""
    g = torch.Generator().manual_seed(rows * sum(widths))
    xs, factors = [], []
    for width in widths:
        x = torch.randn(rows, width, generator=g) * torch.logspace(-3, 3, rows).unsqueeze(1)
        x[0] = 0
        xs.append(x)
        factors.append(torch.rand(width, generator=g) * 1e-2)
    xs[-1][-1, -1] = 1e4
    return [x.to(device, dtype) for x in xs], [f.to(device) for f in factors]


def _assert_same(actual, expected) -> None:
    codes, scales = actual
    assert codes.dtype == torch.float8_e4m3fn and scales.dtype == torch.float32
    assert torch.equal(scales, expected[1]), "scales differ"
    assert torch.equal(codes.view(torch.uint8), expected[0].view(torch.uint8)), "codes differ"


@pytest.mark.parametrize(
    ("rows", "widths", "padded"),
    [
        (1, [16], 16),
        (5, [48], 16),
        (16, [100], 32),
        (3, [200], 16),
        (5, [32, 16, 16], 16),
        (4, [48, 130], 16),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("folded", [False, True], ids=["plain", "factor"])
@pytest.mark.parametrize("passes", [1, 2])
def test_quantization_is_bit_identical_to_the_torch_recipe(
    interpret, rows, widths, padded, dtype, folded, passes
) -> None:
    # two passes: rows wider than one block are read twice, block by block (at small widths here)
    launch = None if passes == 1 else fp8_operands.Launch(one_pass=False, block=32, warps=4)
    xs, factors = _case(rows, widths, dtype)
    factors = factors if folded else None
    _assert_same(fp8_operands.quantize_rows(xs, padded, factors, launch), _expected(xs, padded, factors))


@pytest.mark.parametrize(
    ("rows", "widths", "padded"),
    [(1, [16], 16), (5, [48], 16), (16, [100], 32), (5, [32, 16, 16], 16), (4, [48, 130], 16)],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("folded", [False, True], ids=["plain", "factor"])
@pytest.mark.parametrize("passes", [1, 2])
def test_row_maxima_given_give_the_same_codes_in_one_read(
    interpret, rows, widths, padded, dtype, folded, passes
) -> None:
    """The maxima a producing kernel took (exact: a maximum rounds nothing) replace the kernel's own first
    read; codes and scales stay bit-identical, padding rows included."""
    launch = None if passes == 1 else fp8_operands.Launch(one_pass=False, block=32, warps=4)
    xs, factors = _case(rows, widths, dtype)
    factors = factors if folded else None
    v = torch.cat(
        [x.float() if factors is None else x.float() * f for x, f in zip(xs, factors or xs, strict=True)], 1
    )
    amax = v.abs().amax(1)
    got = fp8_operands.quantize_rows(xs, padded, factors, launch, amax=amax)
    _assert_same(got, _expected(xs, padded, factors))
    # the maxima are what sets the scales: other maxima give other scales (they are read, not recomputed)
    assert not torch.equal(fp8_operands.quantize_rows(xs, padded, factors, launch, amax=amax * 2)[1], got[1])


def test_offered_row_maxima_serve_one_quantization_of_exactly_those_tensors(interpret) -> None:
    xs, factors = _case(5, [32, 16], torch.float32)
    amax = torch.cat([x * f for x, f in zip(xs, factors, strict=True)], 1).abs().amax(1)
    take = fp8_operands.take_row_maxima
    fp8_operands.offer_row_maxima(xs, factors, amax)
    assert take(xs, None) is None and take(xs[:1], factors[:1]) is None, "other factors or tensors"
    assert take([xs[0].clone(), xs[1]], factors) is None, "another tensor with the same values"
    assert take(xs, [f.view(-1) for f in factors]) is amax, "the same factors seen through new views"
    assert take(xs, factors) is None, "taken twice"
    fp8_operands.offer_row_maxima(xs, factors, amax)
    xs[1].mul_(2)
    assert take(xs, factors) is None, "a tensor changed in place since"


def test_fp8_gemm_quantizes_with_offered_row_maxima(interpret, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = []
    real = fp8_operands.quantize_rows
    monkeypatch.setattr(
        fp8_operands, "quantize_rows", lambda *a, **kw: seen.append(kw["amax"]) or real(*a, **kw)
    )
    xs, factors = _case(5, [32, 16], torch.float32)
    amax = torch.cat([x * f for x, f in zip(xs, factors, strict=True)], 1).abs().amax(1)
    fp8_operands.offer_row_maxima(xs, factors, amax)
    _assert_same(fp8_gemm.quantize_activation(xs, factors), _expected(xs, 16, factors))
    _assert_same(fp8_gemm.quantize_activation(xs, factors), _expected(xs, 16, factors))
    assert seen[0] is amax and seen[1] is None


@pytest.mark.parametrize(
    ("widths", "one_pass"),
    [([16], True), ([1000], True), ([4096], True), ([2048, 1024, 1024], True), ([4096, 1024, 1024], False),
     ([14336], False), ([14336, 14336], False)],
)  # fmt: skip
def test_launches_keep_narrow_rows_in_registers(widths: list[int], one_pass: bool) -> None:
    """A one-pass launch's block covers the widest segment (the kernel reads one block per segment); blocks
    are powers of two."""
    launch = fp8_operands.launch_for(widths)
    assert launch.one_pass == one_pass and launch.block & (launch.block - 1) == 0
    assert not launch.one_pass or launch.block >= max(widths)


def test_rows_with_a_stride_are_read_in_place(interpret) -> None:
    (wide,), _ = _case(8, [96], torch.float32)
    x = wide[:, :64]  # rows 96 apart
    _assert_same(fp8_operands.quantize_rows([x], 16), _expected([x.contiguous()], 16, None))


def test_fp8_gemm_quantizes_activations_with_the_kernel(interpret, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = fp8_operands.quantize_rows
    monkeypatch.setattr(fp8_operands, "quantize_rows", lambda *a, **kw: calls.append(a) or real(*a, **kw))
    xs, factors = _case(5, [32, 16], torch.float32)
    _assert_same(fp8_gemm.quantize_activation(xs, factors), _expected(xs, 16, factors))
    assert len(calls) == 1


def test_without_triton_the_torch_recipe_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(
        fp8_operands, "quantize_rows", lambda *a: pytest.fail("the kernel ran on a CPU tensor")
    )
    xs, factors = _case(5, [32, 16], torch.float32)
    _assert_same(fp8_gemm.quantize_activation(xs, factors), _expected(xs, 16, factors))


def _codes(rows: int, cols: int, device: str = "cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(rows + cols)
    return (torch.randn(rows, cols, generator=g) * 50).to(device, torch.float8_e4m3fn)


@pytest.mark.parametrize(("rows", "cols"), [(16, 32), (70, 130), (64, 64)])
def test_transpose_into_a_column_slice(interpret, rows: int, cols: int) -> None:
    codes = _codes(rows, cols)
    buffer = torch.zeros(cols, rows + 24, dtype=torch.float8_e4m3fn)
    out = fp8_operands.transpose_into(codes, buffer[:, 8 : 8 + rows])
    assert torch.equal(out.view(torch.uint8), codes.t().view(torch.uint8))
    untouched = torch.cat([buffer[:, :8], buffer[:, 8 + rows :]], 1)
    assert not untouched.view(torch.uint8).any(), "the transpose wrote outside its slice"


@pytest.mark.gpu
@needs_fp8_gpu
@pytest.mark.parametrize("widths", [[4096], [14336], [1000], [20000], [4096, 1024, 1024], [14336, 14336]])
@pytest.mark.parametrize("folded", [False, True], ids=["plain", "factor"])
def test_gpu_bf16_quantization_is_bit_identical(widths: list[int], folded: bool) -> None:
    xs, factors = _case(300, widths, torch.bfloat16, "cuda")
    factors = factors if folded else None
    (codes, scales), (want_codes, want_scales) = (
        fp8_operands.quantize_rows(xs, 304, factors),
        _expected(xs, 304, factors),
    )
    assert torch.equal(scales, want_scales), f"{int((scales != want_scales).sum())} scales differ"
    bad = (codes.view(torch.uint8) != want_codes.view(torch.uint8)).nonzero()
    v = torch.cat(
        [x.float() if factors is None else x.float() * f for x, f in zip(xs, factors or xs, strict=True)], 1
    )
    seen = [
        (v[i, j].item() / scales[i].item(), codes[i, j].item(), want_codes[i, j].item())
        for i, j in bad[:4].tolist()
    ]
    assert not len(bad), f"{len(bad)} codes differ; (x/scale, kernel's, torch's): {seen}"


@pytest.mark.gpu
@needs_fp8_gpu
def test_gpu_transpose_into_a_column_slice() -> None:
    codes = _codes(4096, 14336, "cuda")
    buffer = torch.zeros(14336, 4096 + 2048, dtype=torch.float8_e4m3fn, device="cuda")
    out = fp8_operands.transpose_into(codes, buffer[:, 1024 : 1024 + 4096])
    assert torch.equal(out.view(torch.uint8), codes.t().view(torch.uint8))


def test_fp8_input_gradient_transposes_the_codes_with_the_kernel(interpret, monkeypatch) -> None:
    """Under Triton, ``dY W``'s codes are transposed by the kernel, each member into its own column slice, and
    the product is the one the torch copy gives."""
    g = torch.Generator().manual_seed(5)
    weights = [fp8_gemm.quantize_rows(torch.randn(out, 32, generator=g)) for out in (48, 16)]
    dys = [torch.randn(7, out, generator=g) for out in (48, 16)]
    codes, scales = [w[0] for w in weights], [w[1] for w in weights]
    calls = []
    real = fp8_operands.transpose_into
    monkeypatch.setattr(
        fp8_operands, "transpose_into", lambda src, dst: calls.append(dst.shape) or real(src, dst)
    )
    in_triton = fp8_gemm.fp8_grad_mm(dys, codes, scales)
    assert calls == [(32, 48), (32, 16)]
    monkeypatch.setattr(fp8_operands, "transposes_on", lambda device: False)
    assert torch.equal(in_triton, fp8_gemm.fp8_grad_mm(dys, codes, scales))
    assert len(calls) == 2, "the torch copy ran instead"
