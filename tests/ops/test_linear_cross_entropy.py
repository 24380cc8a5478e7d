"""Chunked linear + cross entropy against its plain twin (full logits, F.cross_entropy): the summed loss and the
gradients of the hidden states and of a trainable head, over chunk sizes that split the rows raggedly, with
ignored rows, soft-capping and an upstream gradient other than 1; the per-row losses (a different upstream
gradient for every row) with each row's log Σ p² (WPO's); each row's mean logit over the vocabulary; and its
errors."""

from __future__ import annotations

import pytest
import torch

from loralei.errors import LoraleiError
from loralei.ops import reference
from loralei.ops.linear_cross_entropy import (
    chunk_rows,
    linear_cross_entropy,
    linear_mean_logits,
    linear_token_losses,
)
from tolerances import assert_fp32_close


def _case(rows: int, hidden: int, vocab: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, hidden, generator=g)
    w = torch.randn(vocab, hidden, generator=g) / hidden**0.5
    targets = torch.randint(0, vocab, (rows,), generator=g)
    targets[::3] = -100
    return x, w, targets


@pytest.mark.parametrize(
    ("rows", "hidden", "vocab", "chunk"), [(10, 8, 33, 3), (64, 16, 100, 64), (7, 12, 50, 100), (9, 8, 20, 1)]
)
@pytest.mark.parametrize("cap", [None, 5.0])
@pytest.mark.parametrize("train_head", [False, True])
def test_matches_the_plain_loss_and_gradients(rows, hidden, vocab, chunk, cap, train_head) -> None:
    x, w, targets = _case(rows, hidden, vocab, rows + vocab)
    budget = chunk * vocab * w.element_size()
    assert chunk_rows(vocab, w.element_size(), budget) == 1 << (chunk.bit_length() - 1)  # a power of two
    leaves = [t.clone().requires_grad_(i == 0 or train_head) for i, t in enumerate((x, w))]
    plain_leaves = [t.clone().requires_grad_(i == 0 or train_head) for i, t in enumerate((x, w))]
    loss = linear_cross_entropy(*leaves, targets, softcap=cap, chunk_bytes=budget)
    plain = reference.linear_cross_entropy(*plain_leaves, targets, softcap=cap)
    assert_fp32_close(loss, plain, "summed loss")
    (0.5 * loss).backward()
    (0.5 * plain).backward()
    assert_fp32_close(leaves[0].grad, plain_leaves[0].grad, "hidden gradient")
    if train_head:
        assert_fp32_close(leaves[1].grad, plain_leaves[1].grad, "head gradient")
    else:
        assert leaves[1].grad is None


def test_bf16_matches_the_plain_loss() -> None:
    x, w, targets = _case(20, 16, 70, 0)
    x, w = x.bfloat16().requires_grad_(), w.bfloat16()
    loss = linear_cross_entropy(x, w, targets, chunk_bytes=7 * 70 * 2)
    plain = reference.linear_cross_entropy(x, w, targets)
    assert abs(loss.item() - plain.item()) <= 1e-4 * abs(plain.item())
    loss.backward()
    assert x.grad.dtype == torch.bfloat16


def test_target_outside_the_vocabulary_is_named() -> None:
    x, w, targets = _case(4, 8, 10, 1)
    targets[2] = 10
    with pytest.raises(LoraleiError, match="target 10 is outside the vocabulary"):
        linear_cross_entropy(x, w, targets)


def test_the_target_check_can_be_left_to_a_caller_that_checked_them(monkeypatch) -> None:
    """check_targets=False reads no target on the host (the runner checks its batches before the device sees
    them); the shapes are still checked."""
    x, w, targets = _case(4, 8, 10, 1)
    monkeypatch.setattr(torch.Tensor, "any", lambda self: pytest.fail("read the targets"))
    loss = linear_cross_entropy(x, w, targets, check_targets=False)
    monkeypatch.undo()
    torch.testing.assert_close(loss, linear_cross_entropy(x, w, targets))
    with pytest.raises(LoraleiError, match="targets must be"):
        linear_cross_entropy(x, w, targets[:3], check_targets=False)


def test_mismatched_shapes_are_named() -> None:
    x, w, targets = _case(4, 8, 10, 1)
    with pytest.raises(LoraleiError, match="hidden must be"):
        linear_cross_entropy(x, w[:, :4], targets)
    with pytest.raises(LoraleiError, match="targets must be"):
        linear_cross_entropy(x, w, targets[:3])


def test_kernel_path_matches_the_plain_loss(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    x, w, targets = _case(9, 8, 40, 2)
    x = x.requires_grad_()
    plain_x = x.detach().clone().requires_grad_()
    loss = linear_cross_entropy(x, w, targets, chunk_bytes=4 * 40 * 4)
    plain = reference.linear_cross_entropy(plain_x, w, targets)
    assert_fp32_close(loss, plain, "summed loss (Triton interpreter)")
    loss.backward()
    plain.backward()
    assert_fp32_close(x.grad, plain_x.grad, "hidden gradient (Triton interpreter)")


@pytest.mark.parametrize(
    ("rows", "hidden", "vocab", "chunk"), [(10, 8, 33, 3), (7, 12, 50, 100), (9, 8, 20, 1)]
)
@pytest.mark.parametrize("cap", [None, 5.0])
def test_per_row_losses_match_the_plain_ones_with_a_gradient_per_row(rows, hidden, vocab, chunk, cap) -> None:
    x, w, targets = _case(rows, hidden, vocab, rows * vocab)
    budget = chunk * vocab * w.element_size()
    weights = torch.randn(
        rows, generator=torch.Generator().manual_seed(3)
    )  # each row its own upstream gradient
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    sum_sq = torch.full((rows,), torch.nan)
    losses = linear_token_losses(x1, w, targets, softcap=cap, chunk_bytes=budget, sum_sq=sum_sq)
    plain = reference.linear_token_losses(x2, w, targets, softcap=cap)
    assert_fp32_close(losses, plain, "per-row losses")
    assert bool((losses[targets == -100] == 0).all())
    (losses * weights).sum().backward()
    (plain * weights).sum().backward()
    assert_fp32_close(x1.grad, x2.grad, "hidden gradient")
    logits = x.double() @ w.double().t()
    logits = cap * torch.tanh(logits / cap) if cap is not None else logits
    want = torch.log((torch.softmax(logits, 1) ** 2).sum(1))  # every row's, ignored ones too
    assert_fp32_close(sum_sq.double(), want, "log sum of squared probabilities")


def test_per_row_losses_refuse_a_head_that_trains() -> None:
    x, w, targets = _case(4, 8, 10, 1)
    with pytest.raises(LoraleiError, match="output head requires a gradient"):
        linear_token_losses(x, w.requires_grad_(), targets)
    with torch.no_grad():  # a reference pass: nothing trains
        assert linear_token_losses(x, w, targets).shape == (4,)


@pytest.mark.parametrize(
    ("rows", "hidden", "vocab", "chunk"), [(10, 8, 33, 3), (7, 12, 50, 100), (9, 8, 20, 1)]
)
@pytest.mark.parametrize("cap", [None, 5.0])
def test_mean_logits_match_the_fp64_mean_of_the_full_logits(rows, hidden, vocab, chunk, cap) -> None:
    x, w, _ = _case(rows, hidden, vocab, 7 * rows)
    w = w + 0.1  # a nonzero mean over the vocabulary
    logits = x.double() @ w.double().t()
    if cap is not None:
        logits = cap * torch.tanh(logits / cap)
    means = linear_mean_logits(x.requires_grad_(), w, softcap=cap, chunk_bytes=chunk * vocab * 4)
    assert means.dtype == torch.float32 and not means.requires_grad
    assert_fp32_close(means.double(), logits.mean(1), "mean logits")
