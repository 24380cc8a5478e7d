"""NF4 kernels vs plain torch and TorchAO: the dequantization (bit for bit) and the fused dequant-matmul
(Triton interpreter, fp32 and fp16; bf16 on the GPU), their shape checks, and the tile cache."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from loralei.kernels import nf4, tile_cache
from loralei.kernels import nf4_matmul as nm
from loralei.kernels.nf4 import NF4Packed, dequantize, dequantize_torch
from tolerances import assert_fp32_close, assert_low_precision_close

_BITS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def _to_nf4():
    """TorchAO's ``to_nf4`` (its module moved in torchao 0.15)."""
    pytest.importorskip("torchao")
    try:
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4
    except ImportError:
        from torchao.dtypes.nf4tensor import to_nf4
    return to_nf4


def _quantize(shape: tuple[int, int], block: int, sblock: int, dtype: torch.dtype, device: str = "cpu"):
    """``(NF4Packed, NF4Tensor)`` of a seeded random weight."""
    gen = torch.Generator().manual_seed(shape[0] * 7 + shape[1] + block)
    weight = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    t = _to_nf4()(weight, block, sblock)
    packed = NF4Packed(
        t.quantized_data, t.quantized_scalers, t.quantization_factor, t.scaler_mean, t.nf4,
        tuple(t.shape), t.block_size, t.scaler_block_size,
    )  # fmt: skip
    return packed, t


def _fake_packed(shape: tuple[int, int], block: int, dtype: torch.dtype = torch.float32) -> NF4Packed:
    """A packed weight of arbitrary shape and block size (TorchAO refuses some of these), for the shape checks."""
    n = shape[0] * shape[1]
    return NF4Packed(
        torch.zeros(n // 2, dtype=torch.uint8), torch.ones(n // block, dtype=torch.int8),
        torch.ones(1, dtype=dtype), torch.zeros((), dtype=dtype), torch.linspace(-1, 1, 16, dtype=dtype),
        shape, block, n // block,
    )  # fmt: skip


def _fails(*args, **kwargs):
    raise AssertionError("the torch fallback ran where the Triton interpreter should have")


@pytest.fixture
def nf4_interpret(interpret, monkeypatch: pytest.MonkeyPatch) -> None:
    """The interpreter, failing the test if a kernel falls back to torch."""
    if not nf4.usable(torch.empty(1)):
        pytest.skip("this Triton's interpreter cannot run the fused kernel's loop; the GPU tests cover it")
    monkeypatch.setattr(nf4, "dequantize_torch", _fails)


def _assert_bits_equal(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    assert torch.equal(actual.view(_BITS[actual.dtype]), expected.view(_BITS[expected.dtype]))


# (out, in, block, scaler block): odd sizes, blocks straddling rows (in=40, block 16), a partial last program
DEQUANT_CASES = [(48, 96, 32, 3), (64, 128, 64, 2), (16, 48, 16, 6), (6, 40, 16, 5), (96, 160, 16, 5)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", DEQUANT_CASES)
def test_dequantize_is_bit_identical(nf4_interpret, case, dtype):
    out_f, in_f, block, sblock = case
    p, t = _quantize((out_f, in_f), block, sblock, dtype)
    expected = t.get_original_weight()
    _assert_bits_equal(
        dequantize_torch(p), expected
    )  # the module's own reference (the fixture patched nf4's)
    buffer = torch.full((out_f, in_f), float("nan"), dtype=dtype)
    assert dequantize(p, buffer) is buffer
    _assert_bits_equal(buffer, expected)


def test_dequantize_falls_back_to_torch_without_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(nf4, "_dequantize_launcher", _fails)
    p, t = _quantize((48, 96), 32, 3, torch.float32)
    assert not nf4.usable(p.lut)
    _assert_bits_equal(dequantize(p, torch.empty(48, 96)), t.get_original_weight())


def test_dequantize_rejects_a_wrong_buffer():
    p = _fake_packed((8, 32), 16)
    for bad in (torch.empty(8, 16), torch.empty(8, 32, dtype=torch.float16), torch.empty(32, 8).t()):
        with pytest.raises(ValueError, match="buffer"):
            dequantize(p, bad)


# (T, out, in, block, scaler block): T of 1 and odd; out not a multiple of the tile; blocks narrower and wider
# than the conservative tile's side along in (64), and an in that only a 32- or 16-wide side divides
MATMUL_CASES = [
    (1, 48, 96, 32, 3),
    (7, 80, 128, 64, 2),
    (33, 48, 64, 16, 4),
    (20, 64, 256, 128, 2),
    (5, 16, 48, 8, 2),
]


def _matmul_expected(x, p, before, transpose, dtype):
    """``before + x Wᵀ`` (or ``x W``) in ``dtype`` from the dequantized weight (``before`` may be None)."""
    w = dequantize_torch(p).to(dtype)
    product = x.to(dtype) @ (w if transpose else w.T)
    return product if before is None else before.to(dtype) + product


@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", MATMUL_CASES)
def test_nf4_matmul_matches_the_dense_product(nf4_interpret, case, dtype, transpose, accumulate):
    tokens, out_f, in_f, block, sblock = case
    p, _ = _quantize((out_f, in_f), block, sblock, dtype)
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, out_f if transpose else in_f, generator=gen).to(dtype)
    before = (
        torch.randn(tokens, in_f if transpose else out_f, generator=gen).to(dtype) if accumulate else None
    )
    out = (
        before.clone() if accumulate else None
    )  # poison: the product must add to these values, not replace them
    got = nm.nf4_matmul(x, p, out=out, transpose=transpose)
    assert got.dtype == dtype and (out is None or got is out)
    reference = _matmul_expected(x, p, before, transpose, torch.float64)
    if dtype == torch.float32:
        assert_fp32_close(got, reference, f"{case} transpose={transpose}")
    else:
        plain = _matmul_expected(x, p, before, transpose, dtype)
        assert_low_precision_close(got, plain, reference, dtype, f"{case} transpose={transpose}")


def test_nf4_matmul_reads_strided_rows(nf4_interpret):
    p, _ = _quantize((48, 64), 32, 2, torch.float32)
    wide = torch.randn(9, 100)
    x = wide[:, 10:74]  # rows 100 apart
    assert_fp32_close(nm.nf4_matmul(x, p), _matmul_expected(x, p, None, False, torch.float64))


@pytest.mark.parametrize(
    ("shape", "block", "match"),
    [
        ((4, 24), 16, "not a multiple of block_size"),
        ((4, 24), 8, "multiple of 16"),
        ((4, 48), 12, "power of two"),
    ],
)
def test_nf4_matmul_refuses_shapes_the_kernel_cannot_take(shape, block, match):
    p = _fake_packed(shape, block)
    with pytest.raises(ValueError, match=match):
        nm.nf4_matmul(torch.randn(3, shape[1]), p)


def test_nf4_matmul_rejects_mismatched_operands():
    p = _fake_packed((16, 32), 16)
    with pytest.raises(ValueError, match=r"\(T, 32\)"):
        nm.nf4_matmul(torch.randn(3, 16), p)
    with pytest.raises(ValueError, match=r"\(T, 16\)"):
        nm.nf4_matmul(torch.randn(3, 32), p, transpose=True)
    with pytest.raises(ValueError, match="cast x to the weight"):
        nm.nf4_matmul(torch.randn(3, 32, dtype=torch.float16), p)
    with pytest.raises(ValueError, match="contiguous"):
        nm.nf4_matmul(torch.randn(3, 32), p, out=torch.empty(16, 3).t())


def test_nf4_matmul_falls_back_to_torch_without_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(nm, "_launch", _fails)
    p, _ = _quantize((48, 96), 32, 3, torch.float32)
    x, before = torch.randn(5, 96), torch.randn(5, 48)
    got = nm.nf4_matmul(x, p, out=before.clone())
    assert_fp32_close(got, _matmul_expected(x, p, before, False, torch.float64))


def test_interpreter_never_searches_nor_writes_the_cache(nf4_interpret, monkeypatch, tmp_path):
    monkeypatch.setenv("LORALEI_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(nm, "_search", _fails)
    p, _ = _quantize((48, 96), 32, 3, torch.float32)
    x = torch.randn(4, 96)
    assert nm.choose_tile(x, p, False, autotune=True) == nm.conservative_tile(96, False)
    nm.nf4_matmul(x, p, autotune=True)
    assert list(tmp_path.iterdir()) == []


def test_conservative_tile_fits_in():
    assert nm.conservative_tile(4096, False) == nm.Tile(64, 64, 64, 4, 3)
    assert nm.conservative_tile(96, False).block_k == 32
    assert nm.conservative_tile(48, True).block_n == 16
    assert all(nm.fits(nm.conservative_tile(n, t), n, t) for n in (16, 48, 96, 4096) for t in (False, True))


def test_tile_cache_file_round_trip_and_corruption(tmp_path):
    path = tmp_path / "sub" / "tiles.json"
    assert tile_cache.load(path) == {}
    tile_cache.store(path, "a|1", {"block_m": 128})
    tile_cache.store(path, "b|2", {"block_m": 64})
    assert tile_cache.load(path) == {"a|1": {"block_m": 128}, "b|2": {"block_m": 64}}
    assert [f.name for f in path.parent.iterdir()] == ["tiles.json"]  # no temporary file left behind
    path.write_text('{"a|1": {"block_m": 12')  # e.g. a truncated file
    assert tile_cache.load(path) == {}
    tile_cache.store(path, "c|3", {"block_m": 32})
    assert json.loads(path.read_text()) == {"c|3": {"block_m": 32}}
    assert tile_cache.key_string(("H200", "2.8", 4096, 1)) == "H200|2.8|4096|1"


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("LORALEI_CACHE_DIR", str(tmp_path))
    assert tile_cache.cache_dir() == tmp_path
    monkeypatch.delenv("LORALEI_CACHE_DIR")
    assert tile_cache.cache_dir() == Path.home() / ".cache" / "loralei"


@pytest.fixture
def gpu_like(monkeypatch, tmp_path) -> Path:
    """choose_tile as on a GPU (no interpreter), with the search stubbed and the cache in ``tmp_path``."""
    pytest.importorskip("triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("LORALEI_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(nm, "_TILES", {})
    return tmp_path / "nf4_tiles.json"


def test_choose_tile_searches_once_and_reads_the_winner_back(gpu_like, monkeypatch):
    p, x = _fake_packed((64, 128), 64), torch.randn(100, 128)
    winner = nm.Tile(128, 64, 128, 8, 3)
    searched = []
    monkeypatch.setattr(
        nm, "_search", lambda x, p, transpose, candidates: searched.append(candidates) or winner
    )
    assert nm.choose_tile(x, p, False, autotune=True) == winner
    assert all(nm.fits(t, 128, False) for t in searched[0]) and len(searched[0]) == len(nm.CANDIDATES)
    key = tile_cache.key_string(nm.tile_key(x, p, False))
    assert "|128|64|128|0|float32" in key  # T=100 buckets to 128
    assert tile_cache.load(gpu_like) == {key: winner._asdict()}
    monkeypatch.setattr(nm, "_TILES", {})  # a fresh process: the file answers, no search
    monkeypatch.setattr(nm, "_search", _fails)
    assert nm.choose_tile(torch.randn(128, 128), p, False, autotune=True) == winner
    assert nm.choose_tile(x, p, False, autotune=False) == nm.conservative_tile(128, False)


def test_choose_tile_under_deterministic_algorithms_takes_the_conservative_tile(gpu_like, monkeypatch):
    p, x = _fake_packed((64, 128), 64), torch.randn(100, 128)
    key = tile_cache.key_string(nm.tile_key(x, p, False))
    tile_cache.store(gpu_like, key, nm.Tile(128, 64, 128, 8, 3)._asdict())  # a timed winner from another run
    monkeypatch.setattr(nm, "_search", _fails)
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert nm.choose_tile(x, p, False, autotune=True) == nm.conservative_tile(128, False)
    finally:
        torch.use_deterministic_algorithms(previous)
    assert nm.choose_tile(x, p, False, autotune=True) == nm.Tile(128, 64, 128, 8, 3)


def test_choose_tile_ignores_a_corrupt_file_or_entry(gpu_like, monkeypatch):
    p, x = _fake_packed((64, 96), 32), torch.randn(8, 96)
    key = tile_cache.key_string(nm.tile_key(x, p, False))
    winner = nm.Tile(64, 64, 32, 4, 3)
    monkeypatch.setattr(nm, "_search", lambda *args: winner)
    gpu_like.write_text("not json")
    assert nm.choose_tile(x, p, False, autotune=True) == winner
    assert tile_cache.load(gpu_like) == {key: winner._asdict()}  # rewritten
    # an entry whose side along in does not divide in=96 (or lacks fields) is searched again
    tile_cache.store(gpu_like, key, {**winner._asdict(), "block_k": 64})
    monkeypatch.setattr(nm, "_TILES", {})
    assert nm.choose_tile(x, p, False, autotune=True) == winner
    tile_cache.store(gpu_like, key, {"block_m": 64})
    monkeypatch.setattr(nm, "_TILES", {})
    assert nm.choose_tile(x, p, False, autotune=True) == winner


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@needs_cuda
def test_gpu_bf16_dequantize_is_bit_identical():
    for shape in ((4096, 4096), (1024, 4096), (14336, 4096)):
        p, t = _quantize(shape, 64, 256, torch.bfloat16, "cuda")
        expected = dequantize_torch(p)
        _assert_bits_equal(expected, t.get_original_weight())
        _assert_bits_equal(dequantize(p, torch.empty_like(expected)), expected)


@pytest.mark.gpu
@needs_cuda
def test_gpu_dequantize_past_two_to_the_31_weights():
    """A whole expert bank can hold more than 2^31 weights (one launch: NF4Bank.dequantize): the kernel's
    offsets must not wrap. Random codes and scales; the rows past 2^31 elements against the torch formula."""
    cols, block, sblock = 4096, 64, 256
    rows = 2**31 // cols + 64  # the last 64 rows lie past element 2^31
    n = rows * cols
    gen = torch.Generator(device="cuda").manual_seed(0)
    p = NF4Packed(
        torch.randint(0, 256, (n // 2,), dtype=torch.uint8, device="cuda", generator=gen),
        torch.randint(-128, 128, (n // block,), dtype=torch.int8, device="cuda", generator=gen),
        torch.rand(n // (block * sblock), device="cuda", generator=gen).add_(0.5).bfloat16(),
        torch.tensor(0.25, dtype=torch.bfloat16, device="cuda"),
        torch.linspace(-1, 1, 16, dtype=torch.bfloat16, device="cuda"),
        (rows, cols), block, sblock,
    )  # fmt: skip
    out = dequantize(p, torch.full((rows, cols), float("nan"), dtype=torch.bfloat16, device="cuda"))
    tail = 128  # rows: a whole number of scaler groups (block · sblock / cols = 4 rows each)
    start = (rows - tail) * cols
    last = p._replace(
        data=p.data[start // 2 :], scalers=p.scalers[start // block :],
        factors=p.factors[start // (block * sblock) :], shape=(tail, cols),
    )  # fmt: skip
    _assert_bits_equal(out[-tail:], dequantize_torch(last))
    head = tail * cols
    first = p._replace(
        data=p.data[: head // 2], scalers=p.scalers[: head // block],
        factors=p.factors[: head // (block * sblock)], shape=(tail, cols),
    )  # fmt: skip
    _assert_bits_equal(out[:tail], dequantize_torch(first))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("shape", [(4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336)])
@pytest.mark.parametrize("transpose", [False, True])
def test_gpu_bf16_nf4_matmul_error_within_cublas(shape, transpose, monkeypatch, tmp_path):
    monkeypatch.setenv("LORALEI_CACHE_DIR", str(tmp_path))
    p, _ = _quantize(shape, 64, 256, torch.bfloat16, "cuda")
    w = dequantize(p, torch.empty(shape, dtype=torch.bfloat16, device="cuda"))
    x = torch.randn(4096, shape[0] if transpose else shape[1], device="cuda", dtype=torch.bfloat16)
    reference = _matmul_expected(x, p, None, transpose, torch.float64)
    plain = x @ (w if transpose else w.T)
    fused = nm.nf4_matmul(x, p, transpose=transpose)
    assert_low_precision_close(fused, plain, reference, torch.bfloat16, f"{shape} transpose={transpose}")
    before = torch.randn_like(plain)
    accumulated = nm.nf4_matmul(x, p, out=before.clone(), transpose=transpose)
    assert_low_precision_close(accumulated, before + plain, before.double() + reference, torch.bfloat16)
    assert (tmp_path / "nf4_tiles.json").exists()
