"""The grouped GEMM reading an NVFP4 expert bank's codes (W4A16) against each expert's dequantized matrix from the
format's definition (tests/checkpoint_quant.py), multiplied in fp64: both directions, partial tiles, an expert
without rows, an expert whose rows span several row tiles, several global scales per expert, strided rows
(Triton interpreter, fp32 and fp16; bf16 against the dequantize-then-``torch._grouped_mm`` path on the GPU). Its
row-tile schedule covers every row once; the bank falls back to its dense buffer where Triton cannot run."""

from __future__ import annotations

import pytest
import torch

from checkpoint_quant import nvfp4_reference, nvfp4_tensors
from loralei.kernels import nvfp4_grouped
from loralei.kernels.checkpoint_dequant import FloatCodes
from loralei.modules.quantized.checkpoint_bank import CheckpointBank
from loralei.modules.quantized.checkpoint_formats import QuantSpec
from loralei.modules.quantized.checkpoint_tensor import CheckpointTensor

COUNTS = [5, 0, 70, 3]  # rows per expert: one empty, one over a 64-row tile


def _bank(experts: int, d1: int, d2: int, runs: int, seed: int = 0) -> tuple[FloatCodes, torch.Tensor]:
    """A random NVFP4 bank (each expert's ``runs`` runs of rows with a global scale each) and its dense fp64
    matrices by the format's definition."""
    parts, dense = [], []
    for e in range(experts):
        per_run = [nvfp4_tensors(d1 // runs, d2, seed=seed + runs * e + k) for k in range(runs)]
        parts.append(per_run)
        dense.append(torch.cat([nvfp4_reference(t, torch.float64) for t in per_run]))
    codes = FloatCodes(
        torch.stack([torch.cat([t["weight"] for t in run]) for run in parts]),
        torch.stack([torch.cat([t["weight_scale"] for t in run]) for run in parts]),
        torch.stack([torch.stack([t["weight_scale_2"] for t in run]) for run in parts]),
    )
    return codes, torch.stack(dense)


def _offsets(counts: list[int], device: str = "cpu") -> torch.Tensor:
    return torch.cumsum(torch.tensor(counts), 0).to(device=device, dtype=torch.int32)


def _expected(x: torch.Tensor, dense: torch.Tensor, counts: list[int], transpose: bool) -> torch.Tensor:
    """Each expert's rows times its matrix, in fp64."""
    parts = x.double().split(counts)
    return torch.cat([p @ (w if transpose else w.T) for p, w in zip(parts, dense.double(), strict=True)])


# (d1, d2, global scales per expert): partial tiles along both (the interpreter's tile is 32 wide), a packed side
# that is not a multiple of 32, two projections fused into one bank
SHAPES = [(48, 96, 1), (80, 64, 2), (33, 48, 1)]


@pytest.mark.parametrize("transpose", [False, True], ids=["forward", "input-grad"])
@pytest.mark.parametrize(("d1", "d2", "runs"), SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_grouped_products_equal_the_dequantized_experts(interpret, d1, d2, runs, transpose, dtype):
    codes, dense = _bank(len(COUNTS), d1, d2, runs, seed=d1 + d2)
    torch.manual_seed(0)
    wide = torch.randn(sum(COUNTS), 2 * max(d1, d2)).to(dtype)
    x = wide[:, : d1 if transpose else d2]  # strided rows
    y = nvfp4_grouped.grouped_mm(x, codes, _offsets(COUNTS), transpose)
    assert y.dtype == dtype and y.shape == (sum(COUNTS), d2 if transpose else d1)
    # the kernel multiplies the weight rounded to the rows' dtype, as the dequantized buffer holds it
    expected = _expected(x, dense.to(dtype), COUNTS, transpose)
    tol = {torch.float32: 1e-5, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(y.double(), expected, rtol=tol, atol=tol * expected.abs().max().item())


@pytest.mark.parametrize("block_m", [1, 16, 64])
def test_the_schedule_covers_every_row_once_with_one_expert_per_tile(block_m):
    counts = [0, 3, 130, 0, 64, 65, 1, 0]
    offsets = _offsets(counts)
    rows = sum(counts)
    schedule = nvfp4_grouped.tile_schedule(offsets, rows, block_m)
    assert schedule.expert.shape[0] == -(-rows // block_m) + len(counts)  # the grid, known on the host
    owner = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    seen = torch.zeros(rows, dtype=torch.long)
    for e, first in zip(schedule.expert.tolist(), schedule.first_row.tolist(), strict=True):
        if e == len(counts):  # past the last tile: the program returns
            continue
        tile = torch.arange(first, min(first + block_m, int(offsets[e])))
        assert tile.numel() > 0 and (owner[tile] == e).all()
        seen[tile] += 1
    assert (seen == 1).all()


def test_without_triton_the_bank_multiplies_its_dequantized_experts(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    codes, _ = _bank(2, 32, 32, 1)
    parts = {"weight": codes.weight, "weight_scale": codes.block_scale, "weight_scale_2": codes.global_scale}
    tensor = CheckpointTensor(parts, QuantSpec("nvfp4", 16), torch.Size((2, 32, 32)), torch.float32)
    bank = CheckpointBank(tensor)
    assert bank.grouped_mm(torch.randn(3, 32), _offsets([1, 2]), False) is None
    assert "shared buffer" in bank.backend


def test_the_bank_runs_the_grouped_kernel_where_triton_runs(interpret):
    codes, dense = _bank(2, 32, 48, 1)
    parts = {"weight": codes.weight, "weight_scale": codes.block_scale, "weight_scale_2": codes.global_scale}
    bank = CheckpointBank(
        CheckpointTensor(parts, QuantSpec("nvfp4", 16), torch.Size((2, 32, 48)), torch.float32)
    )
    assert "grouped Triton GEMMs reading the stored codes" in bank.backend
    x = torch.randn(5, 48)
    y = bank.grouped_mm(x, _offsets([2, 3]), False)
    torch.testing.assert_close(y.double(), _expected(x, dense.float(), [2, 3], False), rtol=1e-5, atol=1e-5)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(("d1", "d2", "runs"), [(1536, 2048, 2), (2048, 768, 1), (136, 384, 1)])
def test_gpu_bf16_grouped_products_match_the_dequantized_grouped_mm(d1, d2, runs):
    counts = [700, 0, 1, 64, 300, 2000, 63, 65]
    codes, _ = _bank(len(counts), d1, d2, runs, seed=7)
    codes = FloatCodes(*(t.cuda() for t in codes))
    parts = {"weight": codes.weight, "weight_scale": codes.block_scale, "weight_scale_2": codes.global_scale}
    spec, shape = QuantSpec("nvfp4", 16), torch.Size((len(counts), d1, d2))
    bank = CheckpointBank(CheckpointTensor(parts, spec, shape, torch.bfloat16))
    dense = bank.dequantize(list(range(len(counts))), torch.empty(shape, dtype=torch.bfloat16, device="cuda"))
    offsets = _offsets(counts, "cuda")
    for transpose in (False, True):
        x = torch.randn(sum(counts), d1 if transpose else d2, device="cuda", dtype=torch.bfloat16)
        y = nvfp4_grouped.grouped_mm(x, codes, offsets, transpose)
        w = dense if transpose else dense.transpose(-2, -1)
        reference = torch._grouped_mm(x, w, offs=offsets) if d2 % 8 == 0 else None
        exact = _expected(x, dense, counts, transpose)
        err = (y.double() - exact).abs().max().item()
        # the same bf16 weight and rows, fp32 accumulation: the rounding of the output dominates both
        bound = exact.abs().max().item() * 2**-7
        assert err <= bound, (transpose, err, bound)
        if reference is not None:
            assert (reference.double() - exact).abs().max().item() <= bound
