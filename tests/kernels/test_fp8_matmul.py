"""The FP8 Triton GEMM against ``torch._scaled_mm`` and the exact (fp64) product of its quantized operands: in the
Triton interpreter at small shapes (ragged edges, masked K, several tile groups, strided operands, e4m3's extremes),
compiled for Hopper without a GPU (every tile fits an H200), and on an FP8 GPU (GPU-marked)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from loralei.kernels import fp8_matmul as fm
from loralei.modules.quantized.fp8_gemm import quantize_rows
from tolerances import FP32_REL, LOW_PRECISION_FLOOR, rel_err

needs_fp8_gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9), reason="needs an FP8 GPU"
)
E4M3_SMALLEST = 2.0**-9  # e4m3's smallest subnormal
# Half an ulp of the output dtype, relative to the value.
HALF_ULP = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


@pytest.fixture
def fp8_interpret(interpret) -> None:
    if not fm.usable(torch.empty(0)):
        pytest.skip("this Triton's interpreter cannot run the kernel's K loop; the GPU tests cover it")


def _operands(m: int, n: int, k: int, device: str = "cpu"):
    """``(a8, scale_a, b_t, scale_b)`` quantized per row from seeded random data whose rows span decades; every
    row of either operand holds ±448 (its amax), and a8's first column and b's first row e4m3's smallest
    subnormal."""
    g = torch.Generator().manual_seed(m * 10_000 + n * 100 + k)
    a8, sa = quantize_rows(torch.randn(m, k, generator=g) * torch.logspace(-2, 1.5, m).unsqueeze(1))
    w8, sw = quantize_rows(torch.randn(n, k, generator=g) * torch.logspace(0.5, -1.5, n).unsqueeze(1))
    a8[:, 0] = E4M3_SMALLEST
    w8[0] = -E4M3_SMALLEST
    return a8.to(device), sa.to(device), w8.to(device).t(), sw.to(device).t()


def _assert_rounded_exact_product(y: torch.Tensor, a8, sa, b_t, sb) -> None:
    """Every element within half an ulp of ``y``'s dtype of the exact product, plus FP32 accumulation's error:
    ``(K + 2) 2⁻²⁴ Σ_k |a b|`` (K sums and two scale multiplications), plus half fp16's smallest subnormal."""
    a, b = a8.double() * sa.double(), b_t.double() * sb.double()
    exact, magnitude = a @ b, a.abs() @ b.abs()
    accumulation = (a8.shape[1] + 2) * 2.0**-24 * magnitude
    bound = HALF_ULP[y.dtype] * (exact.abs() + accumulation) + accumulation + 2.0**-25
    excess = (y.double() - exact).abs() - bound
    assert (excess <= 0).all(), f"{int((excess > 0).sum())} elements off; worst by {excess.max().item():.3e}"


def _assert_like_scaled_mm(y: torch.Tensor, a8, sa, b_t, sb) -> None:
    expected = torch._scaled_mm(a8, b_t, scale_a=sa, scale_b=sb, out_dtype=y.dtype)
    bound = FP32_REL if y.dtype == torch.float32 else LOW_PRECISION_FLOOR[y.dtype]
    assert rel_err(y, expected) <= bound


# (M, N, K) with the interpreter's 32 × 32 × 32 tiles in groups of 2: ragged M and N with masked K, 7 × 3 tiles
# (the last group of rows partial), one partial tile, five steps along K
SHAPES = [(48, 80, 48), (200, 96, 64), (5, 16, 16), (64, 32, 160)]


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_matches_scaled_mm_and_the_exact_product(fp8_interpret, shape, out_dtype) -> None:
    ops = _operands(*shape)
    y = fm.fp8_matmul(*ops, out_dtype=out_dtype)
    assert y.dtype == out_dtype and y.shape == (shape[0], shape[1]) and y.is_contiguous()
    _assert_rounded_exact_product(y, *ops)
    _assert_like_scaled_mm(y, *ops)


@pytest.mark.parametrize(
    ("tile", "group"),
    [(fm.Tile(16, 64, 16, 4, 1), 3), (fm.Tile(64, 16, 64, 4, 1), 1)],
    ids=["16x64x16", "64x16x64"],
)
def test_other_tiles_and_groups(fp8_interpret, monkeypatch, tile, group) -> None:
    monkeypatch.setattr(fm, "INTERPRETER_TILE", tile)
    monkeypatch.setattr(fm, "INTERPRETER_GROUP_M", group)
    ops = _operands(100, 48, 96)
    _assert_rounded_exact_product(fm.fp8_matmul(*ops, out_dtype=torch.float32), *ops)


def test_strided_operands_are_read_in_place(fp8_interpret) -> None:
    a_wide, sa, w_t, sw = _operands(40, 48, 96)
    a8 = a_wide[:, :64]  # rows 96 apart
    b_t = w_t.t()[:, 16:80].t()  # columns 96 apart, of a slice along K
    y = fm.fp8_matmul(a8, sa, b_t, sw, out_dtype=torch.float32)
    _assert_rounded_exact_product(y, a8, sa, b_t, sw)


def test_fast_accumulation_is_accepted(fp8_interpret) -> None:
    ops = _operands(48, 32, 64)
    y = fm.fp8_matmul(*ops, out_dtype=torch.float32, fast_accum=True)
    _assert_rounded_exact_product(y, *ops)


def test_no_rows(fp8_interpret) -> None:
    a8, sa, b_t, sb = _operands(16, 32, 16)
    y = fm.fp8_matmul(a8[:0], sa[:0], b_t, sb)
    assert y.shape == (0, 32) and y.dtype == torch.bfloat16


def _bad(a8, sa, b_t, sb, **kwargs):
    return (a8, sa, b_t, sb), kwargs


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda a8, sa, b_t, sb: _bad(a8.float(), sa, b_t, sb), "must be torch.float8_e4m3fn"),
        (lambda a8, sa, b_t, sb: _bad(a8[:, :16], sa, b_t, sb), "must be .M, K. and .K, N."),
        (lambda a8, sa, b_t, sb: _bad(a8[:, :24], sa, b_t[:24], sb), "multiples of 16"),
        (lambda a8, sa, b_t, sb: _bad(a8, sa, b_t[:, :24], sb[:, :24]), "multiples of 16"),
        (lambda a8, sa, b_t, sb: _bad(a8, sa, b_t.contiguous(), sb), "column-major"),
        (lambda a8, sa, b_t, sb: _bad(a8.t().contiguous().t(), sa, b_t, sb), "row-major"),
        (lambda a8, sa, b_t, sb: _bad(a8, sa.t(), b_t, sb), "scale_a"),
        (lambda a8, sa, b_t, sb: _bad(a8, sa, b_t, sb.double()), "scale_b"),
        (lambda a8, sa, b_t, sb: _bad(a8, sa, b_t, sb, out_dtype=torch.float64), "out_dtype"),
    ],
)
def test_operands_are_checked(change, message) -> None:
    args, kwargs = change(*_operands(32, 32, 32))
    with pytest.raises(ValueError, match=message):
        fm.fp8_matmul(*args, **kwargs)


def test_refuses_to_run_where_triton_cannot(monkeypatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not fm.usable(torch.empty(0))
    with pytest.raises(RuntimeError, match=r"use torch\._scaled_mm there"):
        fm.fp8_matmul(*_operands(16, 16, 16))


class _Recorder:
    """Stands in for a launchable kernel: records each launch's grid (for these meta-parameters) and keywords."""

    def __init__(self, name: str, calls: list) -> None:
        self.name, self.calls = name, calls

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.calls.append((self.name, grid({"BLOCK_M": 128, "BLOCK_N": 256}), kwargs))

        return launch


def test_gpu_launches_reuse_the_autotuned_tile(monkeypatch) -> None:
    """The first launch per (M, N, K, dtype, fast_accum) goes through the autotuner, later ones call the kernel
    with its choice; the autotuner's tiles and its EVEN_K heuristic are those the module declares."""
    built = fm._kernel(False)
    assert [c.all_kwargs() for c in built.configs] == [
        {"BLOCK_M": t.block_m, "BLOCK_N": t.block_n, "BLOCK_K": t.block_k, "num_warps": t.num_warps,
         "num_ctas": 1, "num_stages": t.num_stages}
        for t in fm.CONFIGS
    ]  # fmt: skip
    even_k = built.fn.values["EVEN_K"]
    assert even_k({"K": 6144, "BLOCK_K": 128}) and not even_k({"K": 6160, "BLOCK_K": 128})
    calls: list = []
    autotuned = _Recorder("autotune", calls)
    autotuned.fn = _Recorder("direct", calls)
    autotuned.best_config = SimpleNamespace(all_kwargs=lambda: {"BLOCK_M": 128, "num_warps": 8})
    monkeypatch.setattr(fm, "_kernel", lambda interpret: autotuned)
    monkeypatch.setattr(fm, "_TUNED", {})
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    a8, sa, b_t, sb = _operands(300, 512, 32)
    out = torch.empty(300, 512)
    for fast in (False, False, True, False):
        fm._launch(a8, sa.view(-1), b_t, sb.view(-1), out, fast)
    assert [name for name, _, _ in calls] == ["autotune", "direct", "autotune", "direct"]
    assert all(grid == (3 * 2,) for _, grid, _ in calls)
    assert calls[1][2] == {"FAST_ACC": False, "GROUP_M": fm.GROUP_M, "BLOCK_M": 128, "num_warps": 8}


H200_SHARED_MEMORY = 232_448  # bytes one program may use (227 KiB)


@pytest.mark.parametrize("fast_accum", [False, True], ids=["precise", "fast"])
@pytest.mark.parametrize("tile", fm.CONFIGS, ids=lambda t: "x".join(map(str, t)))
def test_every_tile_compiles_for_hopper(tile, fast_accum) -> None:
    """Each autotune tile compiled for sm_90 without a GPU (Triton ships ptxas): it uses Hopper's wgmma and
    pipelines its loads into shared memory that an H200 has."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {
        **dict.fromkeys(("a_ptr", "b_ptr"), "*fp8e4nv"), **dict.fromkeys(("sa_ptr", "sb_ptr"), "*fp32"),
        "c_ptr": "*bf16", **dict.fromkeys(("M", "N", "K", "stride_am", "stride_bn", "stride_cm"), "i32"),
    }  # fmt: skip
    constants = {
        "EVEN_K": True, "FAST_ACC": fast_accum, "BLOCK_M": tile.block_m, "BLOCK_N": tile.block_n,
        "BLOCK_K": tile.block_k, "GROUP_M": fm.GROUP_M,
    }  # fmt: skip
    # as Triton specializes a launch at the 8B shapes: pointers, sizes and strides divisible by 16
    aligned = {(i,): [["tt.divisibility", 16]] for i in range(len(signature))}
    source = ASTSource(triton.jit(fm._fp8_matmul_kernel), {**signature, **dict.fromkeys(constants, "constexpr")},
                       constants, aligned)  # fmt: skip
    try:
        kernel = triton.compile(
            source, target=GPUTarget("cuda", 90, 32),
            options={"num_warps": tile.num_warps, "num_stages": tile.num_stages},
        )  # fmt: skip
    except RuntimeError as error:  # no CUDA backend or ptxas in this Triton
        pytest.skip(f"cannot compile for sm_90 here: {error}")
    ptx = kernel.asm["ptx"]
    assert "wgmma.mma_async" in ptx
    assert ("add.f32" in ptx) != fast_accum  # the partial sums' promotion: FP32 additions, only where precise
    stage = (tile.block_m + tile.block_n) * tile.block_k  # one byte per e4m3 element
    assert tile.num_stages * stage <= kernel.metadata.shared <= H200_SHARED_MEMORY


# At the Llama-3-8B products' widths (the last the joint qkv dY W), fewer rows, a multiple of 16 as _scaled_mm
# takes on the GPU but not of the tiles.
GPU_SHAPES = [(512, 4096, 4096), (384, 1024, 4096), (256, 4096, 14336), (304, 4096, 6144)]


@pytest.mark.gpu
@needs_fp8_gpu
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_gpu_matches_scaled_mm(shape) -> None:
    ops = _operands(*shape, device="cuda")
    y = fm.fp8_matmul(*ops)
    assert y.dtype == torch.bfloat16
    _assert_rounded_exact_product(y, *ops)
    _assert_like_scaled_mm(y, *ops)
    assert torch.equal(fm.fp8_matmul(*ops), y)  # the remembered tile, launched without the autotuner


@pytest.mark.gpu
@needs_fp8_gpu
def test_gpu_fast_accumulation_stays_near_the_exact_product() -> None:
    """Hopper's tensor cores sum FP8 products at less than FP32 precision: bf16's rounding is not guaranteed,
    only an error below half e4m3's own (2⁻⁵ of 2⁻⁴)."""
    a8, sa, b_t, sb = ops = _operands(512, 4096, 14336, device="cuda")
    exact = (a8.double() * sa.double()) @ (b_t.double() * sb.double())
    assert rel_err(fm.fp8_matmul(*ops, fast_accum=True), exact) <= 2.0**-5
