r"""DoRA's output-gradient pass: ``dY ⊙ g`` written and ``Σ_t dY ⊙ Y`` summed per column, reading ``dY`` and
``Y`` once (a Triton kernel).

Shapes: ``dY`` and ``Y`` (T, N), ``g`` (N,) FP32. The DoRA backward (:mod:`loralei.ops.dora`) needs the scaled
output gradient ``dY ⊙ g`` (LoRA's backward then runs on it) and the column dots ``Σ_t dY ⊙ Y`` (the magnitude's
gradient). In torch these are three memory-bound passes over (T, N) tensors (the product, its sum, the scaling:
four reads and two writes); here one pass reads each tile of ``dY`` and ``Y`` once, stores ``dY ⊙ g`` and adds
``dY ⊙ Y`` (in FP32) into a per-program column accumulator.

One program per block of columns and share of the rows; each share's FP32 column sums are written as a partial
row and the (shares, N) partials summed afterwards (deterministic, no atomics).

Launch only where :func:`usable` says so; the caller keeps the torch passes for the rest.
"""

from __future__ import annotations

import functools

import torch

from .activations import add_combine, build_kernel, interpret_requested, tl, triton, triton_usable
from .gated_mlp_launch import default_splits, interpreter_runs_loops

_BLOCKS = (32, 256)  # (rows, columns) per program on the GPU: a 16 KiB bf16 tile of each operand
_INTERPRETER_BLOCKS = (16, 32)
_ROWS_PER_SPLIT = 256  # about this many rows per program


def _scaled_grad_kernel(
    dy_ptr, y_ptr, g_ptr, out_ptr, part_ptr, n_tokens, n_out, stride_dy, stride_y, stride_out,
    BT: tl.constexpr, BN: tl.constexpr,
):  # fmt: skip
    """Columns ``pid(0)``, row share ``pid(1)``: ``dY ⊙ g`` of the share's rows stored, ``Σ dY ⊙ Y`` over them
    stored as the share's partial row (FP32)."""
    block, split, n_split = tl.program_id(0), tl.program_id(1), tl.num_programs(1)
    per_split = ((n_tokens + n_split - 1) // n_split + BT - 1) // BT * BT  # no tl.cdiv: see build_kernel
    t_begin = split * per_split
    t_end = tl.minimum(n_tokens, t_begin + per_split)
    cols = block * BN + tl.arange(0, BN)
    col_ok = cols < n_out
    g = tl.load(g_ptr + cols, mask=col_ok, other=0.0)
    acc = tl.full((BT, BN), 0.0, tl.float32)  # reduced over its rows once, after the loop
    for t0 in range(t_begin, t_end, BT):
        rows = (t0 + tl.arange(0, BT)).to(tl.int64)
        ok = (rows < t_end)[:, None] & col_ok[None, :]
        dy = tl.load(dy_ptr + rows[:, None] * stride_dy + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        y = tl.load(y_ptr + rows[:, None] * stride_y + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        acc += dy * y
        scaled = (dy * g[None, :]).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], scaled, mask=ok)
    tl.store(part_ptr + split.to(tl.int64) * n_out + cols, tl.reduce(acc, 0, add_combine), mask=col_ok)


@functools.cache
def _kernel(interpret: bool):
    """The kernel compiled for the GPU or wrapped for the interpreter, built once per mode."""
    return build_kernel(_scaled_grad_kernel, interpret)


def usable(dy: torch.Tensor, y: torch.Tensor) -> bool:
    """Whether the kernel can run on the (T, N) ``dy`` and ``y``: Triton runs on ``dy`` (in the interpreter, one
    that runs loops), ``y`` has its dtype, both have contiguous columns, and no ``torch.compile`` trace is
    running (the launcher is plain Python)."""
    if torch.compiler.is_compiling() or not triton_usable(dy) or y.dtype != dy.dtype:
        return False
    if dy.stride(1) != 1 or y.stride(1) != 1:
        return False
    return not interpret_requested() or interpreter_runs_loops()


def scaled_grad_and_dots(
    dy: torch.Tensor, y: torch.Tensor, g: torch.Tensor, splits: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dY ⊙ g, Σ_t dY ⊙ Y)`` from one pass; :func:`usable` must hold.

    Args:
        dy: (T, N) output gradient, contiguous columns.
        y: (T, N) in ``dy``'s dtype, contiguous columns.
        g: (N,) FP32 column factors.
        splits: programs sharing one column block's rows (default: about one per 256 rows, at most 16).

    Returns:
        ``dY ⊙ g`` (T, N) in ``dy``'s dtype (the product taken in FP32, rounded once) and the (N,) column dots
        in FP32.
    """
    tokens, n_out = dy.shape
    splits = splits or default_splits(tokens, _ROWS_PER_SPLIT)
    interpret = interpret_requested()
    rows, columns = _INTERPRETER_BLOCKS if interpret else _BLOCKS
    grid = (triton.cdiv(n_out, columns), splits)
    out = torch.empty_like(dy, memory_format=torch.contiguous_format)
    parts = dy.new_empty(splits, n_out, dtype=torch.float32)  # every slot written by its share
    g = g.to(torch.float32).contiguous()
    args = (dy, y, g, out, parts, tokens, n_out, dy.stride(0), y.stride(0), out.stride(0))
    _kernel(interpret)[grid](*args, BT=rows, BN=columns, **({} if interpret else {"num_warps": 8}))
    return out, parts.sum(0)
