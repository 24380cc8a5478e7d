r"""The closing sum of a reduction that a kernel split among programs, scaled and rounded, in one launch.

Kernels that share a reduction among programs (deterministic, no atomics) leave fp32 partials, one
(rows × cols) matrix per share; their caller wants ``scale · Σ_p parts[p]`` cut to its leading
(keep_rows × keep_cols) block (the rank padded for ``tl.dot`` dropped) in a gradient's or an activation's dtype.
In torch that is a sum, a slice made contiguous, a multiply and a cast: up to four small kernels per result.
Here one program sums ``BLOCK`` elements over every part, scales, rounds and stores them; two results share one
launch (the first's programs, then the second's).

Callers launch only where their own kernels ran (:func:`~loralei.kernels.activations.triton_usable`; in the
interpreter, one that runs loops).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from .activations import build_kernel, interpret_requested, jit_helper, tl, triton

_BLOCK = 1024  # elements per program


class Partials(NamedTuple):
    """``out = scale · Σ_p parts[p][:keep_rows, :keep_cols]`` with ``out`` of shape (keep_rows, keep_cols)."""

    parts: torch.Tensor  # (P, rows, cols) fp32, contiguous
    out: torch.Tensor  # (keep_rows, keep_cols), contiguous, any floating dtype
    scale: float


@jit_helper
def _sum_block(
    parts_ptr, out_ptr, n_parts, rows, cols, keep_rows, keep_cols, scale, block, BLOCK: tl.constexpr
):
    """Block ``block`` of the kept rows: the sum over the parts, scaled, rounded to ``out``'s dtype."""
    offs = block * BLOCK + tl.arange(0, BLOCK)  # over the kept rows of one part, all their columns
    ok = offs < keep_rows * cols
    ptrs = parts_ptr + offs
    acc = tl.full((BLOCK,), 0.0, tl.float32)
    for _ in range(0, n_parts):
        acc += tl.load(ptrs, mask=ok, other=0.0)
        ptrs += rows * cols
    col = offs % cols
    out = (acc * scale).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + (offs // cols) * keep_cols + col, out, mask=ok & (col < keep_cols))


def _sums_kernel(
    p0, o0, n0, rows0, cols0, kr0, kc0, s0, programs0, p1, o1, n1, rows1, cols1, kr1, kc1, s1,
    BLOCK: tl.constexpr,
):  # fmt: skip
    """Programs below ``programs0`` write the first result, the rest the second."""
    pid = tl.program_id(0)
    if pid < programs0:
        _sum_block(p0, o0, n0, rows0, cols0, kr0, kc0, s0, pid, BLOCK)
    else:
        _sum_block(p1, o1, n1, rows1, cols1, kr1, kc1, s1, pid - programs0, BLOCK)


@functools.cache
def _kernel(interpret: bool):
    return build_kernel(_sums_kernel, interpret)


def _args(job: Partials) -> tuple[list, int]:
    """The kernel's arguments for ``job`` (all but its program count) and how many programs it takes; refuses
    a job :func:`sum_partials` cannot do."""
    n_parts, rows, cols = job.parts.shape
    keep_rows, keep_cols = job.out.shape
    if job.parts.dtype != torch.float32 or not job.parts.is_contiguous() or not job.out.is_contiguous():
        raise ValueError("sum_partials: parts must be contiguous fp32 and out contiguous")
    if keep_rows > rows or keep_cols > cols:
        raise ValueError(f"sum_partials: out {tuple(job.out.shape)} exceeds a part's {(rows, cols)}")
    programs = triton.cdiv(keep_rows * cols, _BLOCK)
    return [job.parts, job.out, n_parts, rows, cols, keep_rows, keep_cols, float(job.scale)], programs


def sum_partials(first: Partials, second: Partials | None = None) -> None:
    """Writes each job's ``out`` (one launch for both).

    Raises:
        ValueError: parts that are not contiguous fp32, or an ``out`` larger than a part or not contiguous.
    """
    args0, programs0 = _args(first)
    args1, programs1 = _args(second) if second is not None else (args0, 0)
    _kernel(interpret_requested())[(programs0 + programs1,)](*args0, programs0, *args1, BLOCK=_BLOCK)
