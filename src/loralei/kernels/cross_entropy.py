r"""Cross entropy over rows of logits, with the gradient written over the logits in the same call.

Per row ``x`` (V logits, optionally soft-capped ``c = s·tanh(x/s)``), target ``y``::

    lse  = log Σ_j exp(c_j)                  (one online pass: running max and rescaled sum)
    loss = lse - c_y                          (0 where y is the ignore index)
    dx_j = (exp(c_j - lse) - [j = y]) · c'_j   (a second pass, in place; c' = 1 - (c/s)² with a cap, else 1)
    log Σ_j p_j²,  p_j = exp(c_j - lse)       (optional, from the second pass: WPO's per-token term)

A program holds one row and walks it in blocks, so a row of any vocabulary size costs two reads and one write.
Math in FP32, stores in the logits' dtype. Where Triton cannot run, the same formulas run in torch over the
whole chunk (FP32 temporaries of the chunk's size).
"""

from __future__ import annotations

import functools

import torch

from .activations import add_combine, build_kernel, interpret_requested, jit_helper, tl, triton, triton_usable

_BLOCK = 4096


def _max_fn(a, b):
    return tl.maximum(a, b)


# reductions through ``tl.reduce`` with JIT combine functions, which the interpreter runs as Python
# (see activations.add_combine)
max_combine = triton.jit(_max_fn) if triton is not None else _max_fn


@jit_helper
def capped_logits(base, cols, n_cols, cap, CAPPED: tl.constexpr):
    """Logits of one row at ``cols`` in fp32, soft-capped (``cap·tanh(x/cap)``) when ``CAPPED``; 0 past its end."""
    c = tl.load(base + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    if CAPPED:
        c = cap * (1.0 - 2.0 / (tl.exp(2.0 * c / cap) + 1.0))
    return c


def _ce_rows_kernel(
    x_ptr,
    target_ptr,
    loss_ptr,
    sum_sq_ptr,
    n_cols,
    stride,
    ignore_index,
    cap,
    CAPPED: tl.constexpr,
    SUM_SQ: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = x_ptr + row * stride
    target = tl.load(target_ptr + row).to(tl.int64)
    m = tl.full((), float("-inf"), tl.float32)
    total = tl.full((), 0.0, tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        c = tl.where(cols < n_cols, capped_logits(base, cols, n_cols, cap, CAPPED), float("-inf"))
        m_new = tl.maximum(m, tl.reduce(c, 0, max_combine))
        total = total * tl.exp(m - m_new) + tl.reduce(tl.exp(c - m_new), 0, add_combine)
        m = m_new
    lse = m + tl.log(total)
    ignored = target == ignore_index
    c_y = capped_logits(base, tl.where(ignored, 0, target), n_cols, cap, CAPPED)
    tl.store(loss_ptr + row, tl.where(ignored, 0.0, lse - c_y))
    keep = tl.where(ignored, 0.0, 1.0)
    squares = tl.full((), 0.0, tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        c = capped_logits(base, cols, n_cols, cap, CAPPED)
        p = tl.exp(c - lse)
        if SUM_SQ:
            squares += tl.reduce(tl.where(cols < n_cols, p * p, 0.0), 0, add_combine)
        grad = p - tl.where(cols == target, 1.0, 0.0)
        if CAPPED:
            grad = grad * (1.0 - (c / cap) * (c / cap))
        tl.store(base + cols, (grad * keep).to(x_ptr.dtype.element_ty), mask=cols < n_cols)
    if SUM_SQ:
        tl.store(sum_sq_ptr + row, tl.log(squares))


@functools.cache
def _kernel(interpret: bool):
    return build_kernel(_ce_rows_kernel, interpret)


def _torch_ce_rows_(
    logits: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int,
    cap: float | None,
    sum_sq: torch.Tensor | None,
) -> torch.Tensor:
    x = logits.to(torch.promote_types(logits.dtype, torch.float32))
    c = cap * torch.tanh(x / cap) if cap is not None else x
    lse = torch.logsumexp(c, dim=-1)
    ignored = targets == ignore_index
    picked = targets.masked_fill(ignored, 0).unsqueeze(-1)
    loss = (lse - c.gather(-1, picked).squeeze(-1)).masked_fill(ignored, 0.0)
    grad = torch.exp(c - lse.unsqueeze(-1))
    if sum_sq is not None:
        sum_sq.copy_(grad.square().sum(-1).log())
    grad.scatter_add_(-1, picked, torch.full_like(picked, -1.0, dtype=grad.dtype))
    if cap is not None:
        grad.mul_(1.0 - (c / cap).square())
    logits.copy_(grad.masked_fill_(ignored.unsqueeze(-1), 0.0))
    return loss.float()


def cross_entropy_rows_(
    logits: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int = -100,
    softcap: float | None = None,
    sum_sq: torch.Tensor | None = None,
) -> torch.Tensor:
    """Each row's cross entropy; the logits are overwritten with the loss's gradient (module docstring).

    Args:
        logits: (rows, V) with contiguous rows (a row stride ≥ V is fine).
        targets: (rows,) integer class of each row, or ``ignore_index``; the caller checks the range.
        ignore_index: the target that marks a row without loss (its gradient row becomes zeros).
        softcap: ``s`` of ``s·tanh(x/s)`` applied to the logits first, or ``None``.
        sum_sq: (rows,) contiguous FP32, filled with each row's ``log Σ_j p_j²`` (ignored rows' too); or None.

    Returns:
        (rows,) FP32 losses (0 for ignored rows).
    """
    if not triton_usable(logits) or logits.stride(-1) != 1:
        return _torch_ce_rows_(logits, targets, ignore_index, softcap, sum_sq)
    rows, n_cols = logits.shape
    loss = torch.empty(rows, dtype=torch.float32, device=logits.device)
    _kernel(interpret_requested())[(rows,)](
        logits,
        targets.contiguous(),
        loss,
        loss if sum_sq is None else sum_sq,
        n_cols,
        logits.stride(0),
        ignore_index,
        softcap if softcap is not None else 1.0,
        CAPPED=softcap is not None,
        SUM_SQ=sum_sq is not None,
        BLOCK=min(_BLOCK, triton.next_power_of_2(n_cols)),
    )
    return loss
