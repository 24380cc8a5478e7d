r"""Rows gathered from up to two places each and added: ``out[m] = src[a[m]] + src[b[m]]``, a place < 0 reading
zeros (a Triton kernel, plain torch elsewhere).

This is the backward of a row gather in which each source row is read at most twice, given the places that read
it: :mod:`loralei.train.shared_prompt` gathers the stored tokens' queries, keys and values into each pair's two
virtual rows (a prompt token is read by both) and the outputs back (each virtual place by one stored token at
most). Torch's backward of ``index_select`` adds the gradient rows into zeros with atomic adds (``index_add_``),
in an order that changes between runs: 24 ms of a 606 ms DPO step at the Llama-3-8B shape on an H100
(``benchmarks/results/2026-12-06-h100-dpo-share-prompt.md``). Here every output row is written once, by one
program, so the result is the same in every run (``benchmarks/bench_shared_gathers.py`` times both).

Exactly torch's values: the two rows are added in FP32 and rounded once to the dtype (what ``x + y`` of two
tensors of the dtype gives, and what ``index_add_`` into zeros gives for two rows); one row is copied.

Shapes: ``src`` (N, D) with contiguous rows; ``first``, ``second`` (M,) int64 places in ``0..N-1`` or < 0.
"""

from __future__ import annotations

import functools

import torch

from .activations import build_kernel, interpret_requested, tl, triton, triton_usable

_GPU_BLOCK = (16, 512)  # (rows, columns) a program: 16 KiB of bf16 read from each place
_INTERPRETER_BLOCK = (4, 32)


def _gather_sum_kernel(
    src_ptr, out_ptr, first_ptr, second_ptr, n_rows, n_cols, stride_src, stride_out,
    TWO: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr,
):  # fmt: skip
    """Rows ``pid(0)``, columns ``pid(1)`` of ``out``: the source rows at ``first`` (and ``second`` where
    ``TWO``), added in FP32; a place < 0 reads zeros."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BD + tl.arange(0, BD)
    row_ok = rows < n_rows
    col_ok = (cols < n_cols)[None, :]
    place = tl.load(first_ptr + rows, mask=row_ok, other=-1)
    acc = tl.load(
        src_ptr + place.to(tl.int64)[:, None] * stride_src + cols[None, :],
        mask=(place >= 0)[:, None] & col_ok,
        other=0.0,
    ).to(tl.float32)
    if TWO:
        place = tl.load(second_ptr + rows, mask=row_ok, other=-1)
        acc += tl.load(
            src_ptr + place.to(tl.int64)[:, None] * stride_src + cols[None, :],
            mask=(place >= 0)[:, None] & col_ok,
            other=0.0,
        ).to(tl.float32)
    out = out_ptr + rows.to(tl.int64)[:, None] * stride_out + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok)


@functools.cache
def _kernel(interpret: bool):
    """The kernel compiled for the GPU or wrapped for the interpreter, built once per mode."""
    return build_kernel(_gather_sum_kernel, interpret)


def gather_sum(src: torch.Tensor, first: torch.Tensor, second: torch.Tensor | None = None) -> torch.Tensor:
    """``out[m] = src[first[m]] + src[second[m]]`` (module docstring), in the kernel where Triton runs on ``src``.

    Args:
        src: (N, D).
        first: (M,) int64 places, < 0 for none.
        second: (M,) int64 places, < 0 for none; None: ``first`` alone.

    Returns:
        (M, D) in ``src``'s dtype.
    """
    src = src.contiguous()
    if not triton_usable(src) or torch.compiler.is_compiling():
        return _torch_gather_sum(src, first, second)
    out = src.new_empty(first.shape[0], src.shape[1])
    if not out.numel():
        return out
    interpret = interpret_requested()
    rows, cols = _INTERPRETER_BLOCK if interpret else _GPU_BLOCK
    grid = (triton.cdiv(out.shape[0], rows), triton.cdiv(out.shape[1], cols))
    _kernel(interpret)[grid](
        src, out, first.contiguous(), (first if second is None else second).contiguous(), out.shape[0],
        out.shape[1], src.stride(0), out.stride(0), TWO=second is not None, BM=rows, BD=cols,
    )  # fmt: skip
    return out


def _torch_gather_sum(src: torch.Tensor, first: torch.Tensor, second: torch.Tensor | None) -> torch.Tensor:
    """The same in torch: the rows read from ``src`` with one row of zeros after it for the places < 0."""
    padded = torch.cat([src, src.new_zeros(1, src.shape[1])])
    none = src.shape[0]
    out = padded.index_select(0, torch.where(first < 0, none, first))
    if second is not None:
        out = out + padded.index_select(0, torch.where(second < 0, none, second))
    return out
