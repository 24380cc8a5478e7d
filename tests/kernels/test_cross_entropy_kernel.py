"""The cross-entropy row kernel (loss per row, its gradient written over the logits) in the Triton interpreter
and its torch fallback, against autograd through F.cross_entropy in fp64: vocabularies that are not multiples of
the column block (and span several blocks), ignored rows, soft-capping; each row's log Σ p² (WPO's) beside them."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from loralei.kernels import cross_entropy
from tolerances import assert_fp32_close

IGNORE = -100


def _expected(
    logits: torch.Tensor, targets: torch.Tensor, cap: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    leaf = logits.double().requires_grad_()
    capped = cap * torch.tanh(leaf / cap) if cap is not None else leaf
    loss = F.cross_entropy(capped, targets, ignore_index=IGNORE, reduction="none")
    (grad,) = torch.autograd.grad(loss.sum(), leaf)
    return loss.detach(), grad


@pytest.mark.parametrize(("rows", "vocab"), [(3, 7), (5, 4096), (4, 9000)])
@pytest.mark.parametrize("cap", [None, 3.0])
@pytest.mark.parametrize("path", ["interpreter", "torch"])
def test_rows_loss_and_gradient(rows: int, vocab: int, cap: float | None, path: str, request) -> None:
    if path == "interpreter":
        request.getfixturevalue("interpret")
        if vocab > 4096:  # one multi-block row is enough for the interpreter's time
            rows = 2
    g = torch.Generator().manual_seed(vocab)
    logits = 4 * torch.randn(rows, vocab, generator=g)
    targets = torch.randint(0, vocab, (rows,), generator=g)
    targets[0] = IGNORE
    targets[-1] = vocab - 1  # the last column of a ragged final block
    loss_ref, grad_ref = _expected(logits, targets, cap)
    buf, sum_sq = logits.clone(), torch.full((rows,), torch.nan)
    loss = cross_entropy.cross_entropy_rows_(buf, targets, IGNORE, cap, sum_sq)
    assert_fp32_close(loss, loss_ref, "per-row loss")
    assert_fp32_close(buf, grad_ref, "gradient written over the logits")
    assert torch.all(buf[0] == 0) and loss[0] == 0, "an ignored row has neither loss nor gradient"
    capped = cap * torch.tanh(logits.double() / cap) if cap is not None else logits.double()
    want = torch.log((torch.softmax(capped, -1) ** 2).sum(-1))  # WPO's term, every row's
    assert_fp32_close(sum_sq.double(), want, "log sum of squared probabilities")
    assert (want > -math.log(vocab) + 0.5).all()  # peaked rows, not the floor -log V


def test_interpreter_path_is_taken(interpret, monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args, **kwargs):
        raise AssertionError("the torch fallback ran where the Triton interpreter should have")

    monkeypatch.setattr(cross_entropy, "_torch_ce_rows_", fail)
    logits = torch.randn(2, 10)
    cross_entropy.cross_entropy_rows_(logits, torch.tensor([1, 2]))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("cap", [None, 30.0])
def test_cuda_kernel_matches_fp64(monkeypatch, dtype: torch.dtype, cap: float | None) -> None:
    """The compiled kernel (a 128k vocabulary, many column blocks): loss, gradient and log Σ p² against fp64."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    g = torch.Generator().manual_seed(0)
    logits = (4 * torch.randn(6, 128_256, generator=g)).to(dtype)
    targets = torch.randint(0, 128_256, (6,), generator=g)
    targets[0] = IGNORE
    loss_ref, grad_ref = _expected(logits.float(), targets, cap)
    capped = cap * torch.tanh(logits.double() / cap) if cap is not None else logits.double()
    want = torch.log((torch.softmax(capped, -1) ** 2).sum(-1))
    buf, sum_sq = logits.cuda(), torch.full((6,), torch.nan, device="cuda")
    loss = cross_entropy.cross_entropy_rows_(buf, targets.cuda(), IGNORE, cap, sum_sq)
    assert_fp32_close(loss.cpu(), loss_ref, "per-row loss")
    assert_fp32_close(sum_sq.cpu().double(), want, "log sum of squared probabilities")
    tolerance = 1e-2 if dtype == torch.bfloat16 else 1e-5  # the gradient is stored in the logits' dtype
    torch.testing.assert_close(
        buf.cpu().double(), grad_ref, rtol=tolerance, atol=tolerance * grad_ref.abs().max()
    )
