r"""Grouped GEMMs straight from an NVFP4 expert bank's codes (W4A16): the dense bank is never written.

Rows sorted by expert (``offsets[e]``: the end row of expert ``e``'s group) are multiplied by their expert's
matrix of the (E, d1, d2) bank, whose codes are packed two per byte along d2 with one e4m3 scale per 16 values:

- forward, ``out[rows_e] = x[rows_e] W[e]ᵀ`` (x is S × d2, out S × d1): the reduction runs along the packed d2;
- input gradient (``transpose``), ``out[rows_e] = x[rows_e] W[e]`` (x is S × d1, out S × d2).

Each program computes a (BLOCK_M, BLOCK_N) tile of one expert's rows: per BLOCK_K step it decodes its W tile
from the bytes and scales (:func:`loralei.kernels.checkpoint_dequant.e2m1_tile`, so the tile is bit for bit the
dequantized weight the shared-buffer path multiplies), rounds it once to x's dtype and runs ``tl.dot`` with
fp32 accumulation. Each expert's rows start a new row tile (:func:`tile_schedule`, on the device: no host
synchronisation); the programs past the last tile return at once. Against dequantizing the routed experts into
a shared (E, d1, d2) buffer and a grouped GEMM, this reads half a byte a weight per row tile instead of writing
and reading two, and holds no buffer (1.1 GiB in bf16 for the two banks of the Qwen3-30B-A3B shape).

The tiles along N and K are searched once per (direction, shape, dtype) by ``triton.autotune`` on the GPU; the
interpreter runs one small tile.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
from torch import Tensor

from .activations import (
    build_kernel,
    dot_precision,
    interpret_requested,
    launch_autotuned,
    tl,
    triton,
    triton_usable,
)
from .checkpoint_dequant import FloatCodes, e2m1_halves

_PER_BYTE = 2
_BLOCK = 16  # values per NVFP4 block scale
_ROW_TILES = (64, 128)  # rows per program: 128 where the experts average that many rows, else 64
_INTERPRETED = {"BLOCK_N": 32, "BLOCK_K": 32}
# (BLOCK_N, BLOCK_K, warps, stages) tried by the GPU's autotune; both sides multiples of the 16-value block
_CONFIGS = ((128, 64, 8, 3), (64, 64, 4, 4), (128, 128, 8, 3))


class Schedule(NamedTuple):
    """The row tiles of one grouped product: ``expert[t]`` (E past the last tile) and ``first_row[t]`` of each
    program ``t`` along the rows, and the ``offsets`` the rows end at per expert."""

    expert: Tensor
    first_row: Tensor
    offsets: Tensor


def tile_schedule(offsets: Tensor, rows: int, block_m: int) -> Schedule:
    """The row tiles of ``rows`` rows grouped by ``offsets`` (E,) (int32 cumulative ends), each expert's rows
    cut into tiles of ``block_m``; as many entries as the most tiles any routing of ``rows`` rows can need
    (``ceil(rows / block_m) + E``), so the grid is known without reading the offsets on the host."""
    experts = offsets.shape[0]
    ends = offsets.long()
    starts = ends - torch.diff(ends, prepend=ends.new_zeros(1))
    tiles = (ends - starts + block_m - 1) // block_m
    tile_ends = torch.cumsum(tiles, 0)
    t = torch.arange(-(-rows // block_m) + experts, device=offsets.device)
    expert = torch.searchsorted(tile_ends, t, right=True)
    e = expert.clamp(max=experts - 1)
    first_row = starts[e] + (t - (tile_ends[e] - tiles[e])) * block_m
    return Schedule(expert.to(torch.int32), first_row.to(torch.int32), offsets)


def _grouped_kernel(
    x_ptr, weight_ptr, block_ptr, global_ptr, out_ptr, expert_ptr, first_row_ptr, offsets_ptr,
    n_experts, n_cols, n_red, d1, d2, run_rows, n_runs, stride_x,
    TRANSPOSE: tl.constexpr, SCALE_OUTPUT: tl.constexpr, W_LEFT: tl.constexpr, PER_BYTE: tl.constexpr, BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """One (BLOCK_M, BLOCK_N) tile of expert ``expert[program_id(0)]``'s rows: ``x W[e]ᵀ`` (columns = d1,
    reduction = d2) or, ``TRANSPOSE``, ``x W[e]`` (columns = d2, reduction = d1). W's tiles are decoded as their
    even and odd columns (a byte's two nibbles), each multiplied on its own: forward, by the even and odd columns
    of x; transposed, into the even and odd columns of the output. ``SCALE_OUTPUT`` (forward only): the global
    scale of each output column multiplies the accumulator at the end instead of every decoded weight."""
    e = tl.load(expert_ptr + tl.program_id(0))
    if e >= n_experts:
        return
    rows = tl.load(first_row_ptr + tl.program_id(0)) + tl.arange(0, BLOCK_M)
    row_ok = rows < tl.load(offsets_ptr + e)
    first = e.to(tl.int64) * d1  # the expert's first row of the stacked codes
    weight_ptr += first * (d2 // PER_BYTE)
    block_ptr += first * (d2 // BLOCK)
    global_ptr += e * n_runs
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_x
    dtype = out_ptr.dtype.element_ty
    out_rows = out_ptr + rows.to(tl.int64)[:, None] * n_cols
    x_cols = x_ptr + rows.to(tl.int64)[None, :] * stride_x
    out_cols = out_ptr + rows.to(tl.int64)[None, :] * n_cols
    if TRANSPOSE:  # W tiles: BLOCK_K rows of d1, BLOCK_N packed columns of d2; output columns interleaved
        half: tl.constexpr = BLOCK_N // PER_BYTE
        even = tl.program_id(1) * BLOCK_N + 2 * tl.arange(0, half)
        if W_LEFT:
            acc_even = tl.full((half, BLOCK_M), 0.0, tl.float32)
            acc_odd = tl.full((half, BLOCK_M), 0.0, tl.float32)
        else:
            acc_even = tl.full((BLOCK_M, half), 0.0, tl.float32)
            acc_odd = tl.full((BLOCK_M, half), 0.0, tl.float32)
        for k0 in range(0, n_red, BLOCK_K):
            red = k0 + tl.arange(0, BLOCK_K)
            red_ok = red < n_red
            low, high = e2m1_halves(
                weight_ptr, block_ptr, global_ptr, red, red_ok, tl.program_id(1) * BLOCK_N, d2, run_rows,
                PER_BYTE, BLOCK, BLOCK_K, BLOCK_N, True,
            )  # fmt: skip
            if W_LEFT:
                xt = tl.load(x_cols + red[:, None], mask=red_ok[:, None] & row_ok[None, :], other=0.0)
                acc_even = tl.dot(tl.trans(low.to(dtype)), xt, acc_even, input_precision=PRECISION)
                acc_odd = tl.dot(tl.trans(high.to(dtype)), xt, acc_odd, input_precision=PRECISION)
            else:
                x = tl.load(x_rows + red[None, :], mask=row_ok[:, None] & red_ok[None, :], other=0.0)
                acc_even = tl.dot(x, low.to(dtype), acc_even, input_precision=PRECISION)
                acc_odd = tl.dot(x, high.to(dtype), acc_odd, input_precision=PRECISION)
        if W_LEFT:
            ok = (even < n_cols)[:, None] & row_ok[None, :]
            tl.store(out_cols + even[:, None], acc_even.to(dtype), mask=ok)
            tl.store(out_cols + even[:, None] + 1, acc_odd.to(dtype), mask=ok)
        else:
            ok = row_ok[:, None] & (even < n_cols)[None, :]
            tl.store(out_rows + even[None, :], acc_even.to(dtype), mask=ok)
            tl.store(out_rows + even[None, :] + 1, acc_odd.to(dtype), mask=ok)
    else:  # W tiles: BLOCK_N rows of d1, BLOCK_K packed columns of d2
        half_k: tl.constexpr = BLOCK_K // PER_BYTE
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < n_cols
        if W_LEFT:
            acc = tl.full((BLOCK_N, BLOCK_M), 0.0, tl.float32)
        else:
            acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
        for k0 in range(0, n_red, BLOCK_K):
            red_even = k0 + 2 * tl.arange(0, half_k)
            low, high = e2m1_halves(
                weight_ptr, block_ptr, global_ptr, cols, col_ok, k0, d2, run_rows, PER_BYTE, BLOCK, BLOCK_N,
                BLOCK_K, not SCALE_OUTPUT,
            )  # fmt: skip
            if W_LEFT:
                ok = (red_even < n_red)[:, None] & row_ok[None, :]
                x_even = tl.load(x_cols + red_even[:, None], mask=ok, other=0.0)
                x_odd = tl.load(x_cols + red_even[:, None] + 1, mask=ok, other=0.0)
                acc = tl.dot(low.to(dtype), x_even, acc, input_precision=PRECISION)
                acc = tl.dot(high.to(dtype), x_odd, acc, input_precision=PRECISION)
            else:
                ok = row_ok[:, None] & (red_even < n_red)[None, :]
                x_even = tl.load(x_rows + red_even[None, :], mask=ok, other=0.0)
                x_odd = tl.load(x_rows + red_even[None, :] + 1, mask=ok, other=0.0)
                acc = tl.dot(x_even, tl.trans(low.to(dtype)), acc, input_precision=PRECISION)
                acc = tl.dot(x_odd, tl.trans(high.to(dtype)), acc, input_precision=PRECISION)
        if W_LEFT:
            if SCALE_OUTPUT:
                acc = acc * tl.load(global_ptr + cols // run_rows, mask=col_ok, other=0)[:, None]
            tl.store(out_cols + cols[:, None], acc.to(dtype), mask=col_ok[:, None] & row_ok[None, :])
        else:
            if SCALE_OUTPUT:
                acc = acc * tl.load(global_ptr + cols // run_rows, mask=col_ok, other=0)[None, :]
            tl.store(out_rows + cols[None, :], acc.to(dtype), mask=row_ok[:, None] & col_ok[None, :])


@functools.cache
def _launcher(interpret: bool):
    """The kernel for the interpreter, or compiled for the GPU under ``triton.autotune`` (built once per mode)."""
    if interpret:
        return build_kernel(_grouped_kernel, True)
    configs = [
        triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=warps, num_stages=stages)
        for n, k, warps, stages in _CONFIGS
    ]
    return build_kernel(
        _grouped_kernel,
        False,
        triton.autotune(configs, key=["n_cols", "n_red", "TRANSPOSE", "SCALE_OUTPUT", "W_LEFT", "BLOCK_M"]),
    )


_TUNED: dict[tuple, dict] = {}  # (device, direction, shape, dtype) -> the config the autotune chose


def usable(x: Tensor) -> bool:
    """Whether the kernel runs on ``x`` (a CUDA fp32/fp16/bf16 tensor, or fp32/fp16 under the interpreter)."""
    return triton_usable(x)


def grouped_mm(
    x: Tensor,
    codes: FloatCodes,
    offsets: Tensor,
    transpose: bool,
    block_m: int | None = None,
    scale_output: bool = True,
    w_left: bool = False,
) -> Tensor:
    """Each expert's rows times its NVFP4 matrix, read packed (module docstring: the products).

    Args:
        x: (S, d2) rows sorted by expert, or (S, d1) with ``transpose``; the product's dtype (the bank's).
        codes: the bank: ``weight`` uint8 (E, d1, d2/2), ``block_scale`` (E, d1, d2/16), ``global_scale``
            float32 (E, R), one global scale for each of R equal runs of an expert's rows.
        offsets: (E,) int32 end row of each expert's group.
        transpose: ``x W[e]`` (the input gradient) instead of ``x W[e]ᵀ``.

    Returns:
        (S, d1), or (S, d2) with ``transpose``, in ``x``'s dtype; rows past ``offsets[-1]`` are not written.
    """
    experts, d1, half = codes.weight.shape
    d2 = half * _PER_BYTE
    n_cols, n_red = (d2, d1) if transpose else (d1, d2)
    out = x.new_empty(x.shape[0], n_cols)
    if x.shape[0] == 0:
        return out
    x = x if x.stride(-1) == 1 else x.contiguous()
    if block_m is None:
        block_m = _ROW_TILES[x.shape[0] >= _ROW_TILES[1] * experts]
    schedule = tile_schedule(offsets, x.shape[0], block_m)
    runs = codes.global_scale.shape[-1]
    args = (
        x, codes.weight, codes.block_scale.view(torch.uint8), codes.global_scale, out, *schedule, experts,
        n_cols, n_red, d1, d2, d1 // runs, runs, x.stride(0),
    )  # fmt: skip
    constants = {
        "TRANSPOSE": transpose, "SCALE_OUTPUT": scale_output and not transpose, "W_LEFT": w_left, "PER_BYTE": _PER_BYTE,
        "BLOCK": _BLOCK, "BLOCK_M": block_m,
        "PRECISION": dot_precision(x.dtype),
    }  # fmt: skip
    interpret = interpret_requested()
    kernel = _launcher(interpret)
    if interpret:
        kernel[(schedule.expert.shape[0], -(-n_cols // _INTERPRETED["BLOCK_N"]))](
            *args, **constants, **_INTERPRETED
        )
        return out

    def grid(meta: dict) -> tuple[int, int]:
        return schedule.expert.shape[0], -(-n_cols // meta["BLOCK_N"])

    key = (x.device, transpose, experts, d1, d2, x.dtype, block_m, scale_output, w_left)
    launch_autotuned(kernel, _TUNED, key, grid, *args, **constants)
    return out
