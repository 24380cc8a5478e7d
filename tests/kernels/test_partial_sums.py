"""The closing sums of split reductions (Triton interpreter): scaled, cut to the kept block, rounded once."""

from __future__ import annotations

import pytest
import torch

from loralei.kernels import gated_mlp
from loralei.kernels.partial_sums import Partials, sum_partials


@pytest.fixture
def looping_interpreter(interpret) -> None:
    if not gated_mlp.interpreter_runs_loops():
        pytest.skip("this Triton's interpreter cannot run loops with run-time bounds")


def _job(
    parts: int, rows: int, cols: int, keep: tuple[int, int], scale: float, dtype: torch.dtype, seed: int
):
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(parts, rows, cols, generator=gen)
    want = (scale * values.double().sum(0))[: keep[0], : keep[1]]
    return Partials(values, torch.full(keep, float("nan"), dtype=dtype), scale), want


@pytest.mark.parametrize(
    ("first", "second"),
    [
        ((3, 37, 16, (37, 5), 1.0, torch.float16), (7, 45, 16, (45, 16), 0.5, torch.float32)),  # G and dB
        ((16, 16, 70, (3, 70), 2.0, torch.float32), None),  # dA_d: the first rows of (R, I)
        (
            (1, 2500, 16, (2500, 16), -1.5, torch.float32),
            (2, 1, 1, (1, 1), 3.0, torch.float16),
        ),  # many blocks
    ],
)
def test_sums_match_torch_in_interpreter(looping_interpreter, first, second):
    jobs = [_job(*spec, seed=i) for i, spec in enumerate(filter(None, (first, second)))]
    sum_partials(*(job for job, _ in jobs))
    for job, want in jobs:
        tolerance = 1e-6 if job.out.dtype == torch.float32 else 1e-3
        torch.testing.assert_close(job.out.double(), want, rtol=tolerance, atol=tolerance)


def test_bad_partials_are_refused(interpret):
    parts = torch.zeros(2, 4, 8)
    with pytest.raises(ValueError, match="contiguous fp32"):
        sum_partials(Partials(parts.double(), torch.zeros(4, 8), 1.0))
    with pytest.raises(ValueError, match="contiguous fp32"):
        sum_partials(Partials(parts, torch.zeros(8, 4).t(), 1.0))
    with pytest.raises(ValueError, match=r"out \(4, 9\) exceeds a part's \(4, 8\)"):
        sum_partials(Partials(parts, torch.zeros(4, 8), 1.0), Partials(parts, torch.zeros(4, 9), 1.0))
