r"""The two rank-r products of a LoRA projection's output gradient, from one read of it (a Triton kernel).

Shapes: ``dY`` (T, N), ``B`` (N, r), ``U = D(X) Aᵀ`` (T, r) from the forward. The backward needs
``G = dY B`` (T, r: the input gradient's and dA's left factor) and ``dB = s dYᵀ U`` (N, r). As two GEMMs each
reads all of ``dY``, a memory-bound pass over the largest operand either takes (at the 8B shape 67 MB for a
4096-wide output, against 0.5 MB for ``U`` or ``G``). Here one pass reads each ``dY`` tile once and feeds both
products while it is in registers.

One program per block of columns and share of the rows (``splits`` shares): it loops over its rows, adding each
tile's ``dYᵀ U`` into a (columns × R) accumulator and writing each tile's ``dY B`` over its columns as a
partial (rows × R) block. The fp32 partials are added afterwards, ``G``'s over the column blocks and ``dB``'s
over the row shares (deterministic, no atomics), both in one more small launch that also scales ``dB`` and
rounds each to its dtype (:mod:`loralei.kernels.partial_sums`). The rank is padded to ``R`` (a power of two
≥ 16, ``tl.dot``'s minimum) by masked loads. Products take ``dY``'s values and ``B`` cast to its dtype, with fp32
accumulation, like the GEMMs they replace.

On an H200 at the Llama-3-8B shape (T = 8192, r = 16) a profiled training step spent 5.9 ms in the two GEMMs
of the q, k, v, o and down projections and about 4.5 ms here (kernel and sums).

Launch only where :func:`usable` says so; the caller keeps the two GEMMs for the rest.
"""

from __future__ import annotations

import functools

import torch

from .activations import (
    build_kernel,
    dot_precision,
    interpret_requested,
    launch_autotuned,
    tl,
    triton,
    triton_usable,
)
from .gated_mlp_kernels import _load_narrow
from .gated_mlp_launch import MAX_RANK, default_splits, interpreter_runs_loops
from .partial_sums import Partials, sum_partials

# (rows, warps, stages) per program, tried once per (N, R) by triton.autotune on the GPU. The column block is
# not tuned: it fixes how many partial G blocks there are (_columns), which every config must fill alike.
_CONFIGS = [(32, 4, 3), (64, 4, 3), (64, 4, 4), (64, 8, 3), (128, 8, 3)]
_INTERPRETER_BLOCKS = (16, 32)  # (rows, columns) per program in the interpreter: small and still tl.dot-sized
_ROWS_PER_SPLIT = 256  # about this many rows per program (the grid fills the GPU at narrow outputs too)
_MAX_SPLITS = 32


def _output_grad_kernel(
    dy_ptr, b_ptr, u_ptr, gp_ptr, dbp_ptr, cp_ptr,
    n_tokens, n_out, RANK, stride_dy, stride_bn, stride_bk, stride_u, stride_cp,
    R: tl.constexpr, FULL: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr, PRECISION: tl.constexpr,
    COPY: tl.constexpr,
):  # fmt: skip
    """Columns ``pid(0)``, row share ``pid(1)``: the block's partial ``dY B`` of each of the share's rows, and the
    share's partial ``dYᵀ U`` of each of the block's columns (fp32); with ``COPY``, each ``dY`` tile stored to
    ``cp_ptr`` too."""
    block, split, n_split = tl.program_id(0), tl.program_id(1), tl.num_programs(1)
    per_split = ((n_tokens + n_split - 1) // n_split + BT - 1) // BT * BT  # no tl.cdiv: see build_kernel
    t_begin = split * per_split
    t_end = tl.minimum(n_tokens, t_begin + per_split)
    cols = block * BN + tl.arange(0, BN)
    col_ok = cols < n_out
    rk = tl.arange(0, R)
    dtype = dy_ptr.dtype.element_ty
    b = tl.load(
        b_ptr + cols[:, None] * stride_bn + rk[None, :] * stride_bk,
        mask=col_ok[:, None] & (rk < RANK)[None, :],
        other=0.0,
    ).to(dtype)
    acc_db = tl.full((BN, R), 0.0, tl.float32)
    g_base = gp_ptr + block.to(tl.int64) * n_tokens * R
    for t0 in range(t_begin, t_end, BT):
        rows = t0 + tl.arange(0, BT)
        row_ok = rows < t_end
        tile_ok = row_ok[:, None] & col_ok[None, :]
        dy = tl.load(dy_ptr + rows.to(tl.int64)[:, None] * stride_dy + cols[None, :], mask=tile_ok, other=0.0)
        if COPY:
            tl.store(cp_ptr + rows.to(tl.int64)[:, None] * stride_cp + cols[None, :], dy, mask=tile_ok)
        u = _load_narrow(u_ptr, stride_u, rows, row_ok, rk, RANK, FULL)
        g = tl.dot(dy, b, input_precision=PRECISION)
        tl.store(g_base + rows.to(tl.int64)[:, None] * R + rk[None, :], g, mask=row_ok[:, None])
        acc_db = tl.dot(tl.trans(dy), u, acc_db, input_precision=PRECISION)
    out = dbp_ptr + split.to(tl.int64) * n_out * R + cols[:, None] * R + rk[None, :]
    tl.store(out, acc_db, mask=col_ok[:, None])


@functools.cache
def _kernel(interpret: bool):
    """The kernel for the GPU (autotuned, keyed by N and R) or the interpreter, built once per mode."""

    def autotuned(kernel):
        configs = [triton.Config({"BT": bt}, num_warps=w, num_stages=st) for bt, w, st in _CONFIGS]
        return triton.autotune(configs, key=["n_out", "R"])(kernel)

    return build_kernel(_output_grad_kernel, interpret, autotuned)


def usable(dy: torch.Tensor, u: torch.Tensor) -> bool:
    """Whether the kernel can run on the (T, N) ``dy`` and (T, r) ``u``: Triton runs on ``dy`` (see
    :func:`~loralei.kernels.activations.triton_usable`; in the interpreter, one that runs loops), both have
    contiguous columns, ``u`` is in ``dy``'s dtype, the rank is at most ``MAX_RANK``, and no ``torch.compile``
    trace is running (the launcher is plain Python, not a custom op: a compiled graph keeps the two GEMMs)."""
    if torch.compiler.is_compiling():
        return False
    if not triton_usable(dy) or u.dtype != dy.dtype or u.shape[1] > MAX_RANK:
        return False
    if dy.stride(1) != 1 or u.stride(1) != 1:
        return False
    return not interpret_requested() or interpreter_runs_loops()


def _columns(n_out: int) -> int:
    """Columns per program: 256 for wide outputs (half the partial G blocks of 128), 128 for narrow ones (the
    grid still fills the GPU)."""
    return 256 if n_out >= 4096 else 128


_TUNED: dict[tuple, dict] = {}  # launch key -> the autotuner's choice, as launch keyword arguments


def output_grad_products(
    dy: torch.Tensor,
    b: torch.Tensor,
    u: torch.Tensor,
    scale: float,
    splits: int | None = None,
    copy_to: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dY B, s dYᵀ U)`` from one pass over ``dY``; :func:`usable` must hold.

    Args:
        dy: (T, N) output gradient, contiguous columns, rows any stride.
        b: (N, r) LoRA factor ``B``, any strides and floating dtype (cast to ``dy``'s for the product).
        u: (T, r) the forward's ``U``, in ``dy``'s dtype, contiguous columns.
        scale: ``s``, applied to ``dYᵀ U`` once it is summed.
        splits: programs sharing one column block's rows (default: about one per 256 rows, at most 32).
        copy_to: a (T, N) tensor of ``dy``'s dtype with contiguous columns that gets a copy of ``dY`` from the
            same pass (the tiles are stored as they are read).

    Returns:
        ``dY B`` (T, r) in ``dy``'s dtype and ``s dYᵀ U`` (N, r) in ``b``'s (both rounded once, from fp32).
    """
    if copy_to is not None and (
        copy_to.shape != dy.shape or copy_to.dtype != dy.dtype or copy_to.stride(1) != 1
    ):
        raise ValueError(
            f"copy_to is {tuple(copy_to.shape)} {copy_to.dtype} with strides {copy_to.stride()}; expected dy's "
            f"{tuple(dy.shape)} {dy.dtype} with contiguous columns"
        )
    tokens, n_out = dy.shape
    rank = b.shape[1]
    padded = max(16, triton.next_power_of_2(rank))
    splits = splits or min(_MAX_SPLITS, default_splits(tokens, _ROWS_PER_SPLIT))
    interpret = interpret_requested()
    rows, columns = _INTERPRETER_BLOCKS if interpret else (None, _columns(n_out))
    grid = (triton.cdiv(n_out, columns), splits)
    # every slot of both is written: G's by its column block, dB's by its row share
    g_parts = dy.new_empty(grid[0], tokens, padded, dtype=torch.float32)
    db_parts = dy.new_empty(splits, n_out, padded, dtype=torch.float32)
    copy = copy_to if copy_to is not None else dy  # never written without COPY
    args = (
        dy, b, u, g_parts, db_parts, copy, tokens, n_out, rank, dy.stride(0), *b.stride(), u.stride(0),
        copy.stride(0),
    )  # fmt: skip
    precision = dot_precision(dy.dtype)
    constexprs = {
        "R": padded,
        "FULL": rank == padded,
        "BN": columns,
        "PRECISION": precision,
        "COPY": copy_to is not None,
    }
    kernel = _kernel(interpret)
    if interpret:
        kernel[grid](*args, **constexprs, BT=rows)
    else:
        key = (n_out, padded, dy.dtype, b.dtype, copy_to is not None)
        launch_autotuned(kernel, _TUNED, key, grid, *args, **constexprs)
    g, db = dy.new_empty(tokens, rank), b.new_empty(n_out, rank)
    sum_partials(Partials(g_parts, g, 1.0), Partials(db_parts, db, scale))
    return g, db
