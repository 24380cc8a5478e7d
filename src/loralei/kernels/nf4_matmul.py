r"""Products with an NF4 weight that stays packed: ``Y = X Wᵀ`` (forward) and ``dX = dY W`` (input gradient).

Each program computes a (BLOCK_M × BLOCK_N) tile of the output, looping over the reduction in BLOCK_K steps. Per
step it loads the packed bytes of its W tile, splits the nibbles, looks the codes up in the 16-entry table,
multiplies by the block scales (formed from the int8 scalers as :mod:`loralei.kernels.nf4` forms them, so the
tile equals the dequantized weight bit for bit) and runs ``tl.dot`` with fp32 accumulation. The dense weight is
never written: the kernel reads 0.5 bytes per weight element (plus the scalers) instead of the 2 that a bf16
GEMM reads after a dequantization pass.

Shape constraints (:func:`check_shapes` raises ``ValueError`` otherwise; the caller then dequantizes and uses a
dense GEMM): ``in % block_size == 0`` (a block never straddles two rows), ``block_size`` a power of two, and
``in % 16 == 0``. The tile side that runs along ``in`` (BLOCK_K forward, BLOCK_N transposed) always divides
``in``, so tiles never need a mask along ``in``, and, both being powers of two, it is a multiple of
``block_size`` or divides it: one scale per (row, block) of the tile. The side along ``out`` is masked, so
``out`` and the token count T may be anything.

Tiles are searched once per (GPU, torch, triton, T bucket, out, in, transpose, dtype) with
``triton.testing.do_bench`` and kept in :mod:`loralei.kernels.tile_cache`'s file; ``autotune=False`` and the
interpreter use one conservative tile.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch
from torch import Tensor

from . import nf4, tile_cache
from .activations import build_kernel, dot_precision, interpret_requested, jit_helper, tl, triton
from .nf4 import NF4Packed, nf4_weight_tile

_CACHE_FILE = "nf4_tiles.json"
_GROUP_M = 8  # row tiles per group in the launch order, so neighbouring programs share W tiles in L2


class Tile(NamedTuple):
    """One launch configuration of a GEMM kernel (this one's, and the FP8 GEMM's)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# The tiles the search tries (those whose side along ``in`` divides ``in``).
CANDIDATES = [
    Tile(128, 128, 64, 8, 3),
    Tile(128, 256, 64, 8, 3),
    Tile(64, 128, 64, 4, 4),
    Tile(128, 64, 64, 4, 4),
    Tile(128, 128, 128, 8, 3),
    Tile(64, 256, 64, 8, 3),
    Tile(64, 64, 128, 4, 4),
]
_CONSERVATIVE = Tile(64, 64, 64, 4, 3)


@jit_helper
def grouped_tile_ids(n_rows, n_cols, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """This program's (row tile, column tile), visited GROUP_M row tiles at a time (no tl.cdiv: build_kernel)."""
    pid = tl.program_id(0)
    tiles_m = (n_rows + BLOCK_M - 1) // BLOCK_M
    tiles_n = (n_cols + BLOCK_N - 1) // BLOCK_N
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % group_rows, (pid % per_group) // group_rows


def _nf4_matmul_kernel(
    x_ptr, data_ptr, scalers_ptr, factors_ptr, mean_ptr, lut_ptr, y_ptr,
    n_rows, n_cols, n_red, in_features, stride_x, sblock,
    TRANSPOSE: tl.constexpr, ACCUMULATE: tl.constexpr, BLOCK: tl.constexpr, KB: tl.constexpr, SUB: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    """One (BLOCK_M, BLOCK_N) tile of ``X Wᵀ`` (columns = out, reduction = in) or ``dY W`` (columns = in)."""
    dtype = y_ptr.dtype.element_ty
    pid_m, pid_n = grouped_tile_ids(n_rows, n_cols, BLOCK_M, BLOCK_N, GROUP_M)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < n_rows, cols < n_cols
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_x
    mean = tl.load(mean_ptr).to(tl.float32)
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for k0 in range(0, n_red, BLOCK_K):
        red = k0 + tl.arange(0, BLOCK_K)
        if TRANSPOSE:  # reduction over out (masked), W tile (BLOCK_K out rows, BLOCK_N in columns)
            red_ok = red < n_red
            x = tl.load(x_rows + red[None, :], mask=row_ok[:, None] & red_ok[None, :], other=0.0)
            w = nf4_weight_tile(
                data_ptr, scalers_ptr, factors_ptr, mean, lut_ptr, red, red_ok, pid_n * BLOCK_N, in_features,
                sblock, dtype, BLOCK, BLOCK_K, BLOCK_N, KB, SUB,
            )  # fmt: skip
            acc = tl.dot(x, w, acc, input_precision=PRECISION)
        else:  # reduction over in (BLOCK_K divides it: no mask), W tile (BLOCK_N out rows, BLOCK_K in columns)
            x = tl.load(x_rows + red[None, :], mask=row_ok[:, None], other=0.0)
            w = nf4_weight_tile(
                data_ptr, scalers_ptr, factors_ptr, mean, lut_ptr, cols, col_ok, k0, in_features,
                sblock, dtype, BLOCK, BLOCK_N, BLOCK_K, KB, SUB,
            )  # fmt: skip
            acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
    offs = rows.to(tl.int64)[:, None] * n_cols + cols[None, :]
    ok = row_ok[:, None] & col_ok[None, :]
    if ACCUMULATE:  # added in fp32 and rounded once
        acc += tl.load(y_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, acc.to(dtype), mask=ok)


@functools.cache
def _launcher(interpret: bool):
    """The fused kernel compiled for the GPU or wrapped for the interpreter, built once per mode."""
    return build_kernel(_nf4_matmul_kernel, interpret)


def check_shapes(x: Tensor, p: NF4Packed, transpose: bool) -> None:
    """Raises unless the fused kernel can take ``x`` and ``p`` (module docstring: the constraints).

    Args:
        x: (T, in) input, or (T, out) output gradient when ``transpose``.
        p: the packed weight.
        transpose: whether the product is ``dY W`` rather than ``X Wᵀ``.

    Raises:
        ValueError: naming the shape and the constraint it breaks.
    """
    n_out, n_in = p.shape
    want = n_out if transpose else n_in
    if x.dim() != 2 or x.shape[1] != want:
        what = "dY (T, out)" if transpose else "X (T, in)"
        raise ValueError(
            f"x is {tuple(x.shape)}; for a weight of shape {p.shape} it must be {what} = (T, {want})"
        )
    if x.dtype != p.dtype:
        raise ValueError(f"x is {x.dtype} but the weight is {p.dtype}; cast x to the weight's dtype")
    reason = unsupported_weight(p)
    if reason:
        raise ValueError(f"{reason} (dequantize and use a dense matmul instead)")


def unsupported_weight(p: NF4Packed) -> str | None:
    """Why the fused kernel cannot take this weight at all (module docstring: the constraints), or ``None``."""
    n_in, bs = p.shape[1], p.block_size
    if bs < 2 or bs & (bs - 1):
        return f"block_size={bs} is not a power of two; the fused NF4 kernel needs one"
    if n_in % bs:
        return (
            f"weight shape {p.shape}: in={n_in} is not a multiple of block_size={bs}, so blocks straddle rows; "
            "the fused NF4 kernel needs in % block_size == 0"
        )
    if n_in % 16:
        return (
            f"weight shape {p.shape}: in={n_in} is not a multiple of 16, the smallest tile side the fused NF4 "
            "kernel uses along in"
        )
    return None


def fits(tile: Tile, n_in: int, transpose: bool) -> bool:
    """Whether ``tile``'s side along ``in`` (BLOCK_N transposed, else BLOCK_K) divides ``in``."""
    return n_in % (tile.block_n if transpose else tile.block_k) == 0


def conservative_tile(n_in: int, transpose: bool) -> Tile:
    """The one tile used without a search: 64 × 64 × 64, its side along ``in`` halved until it divides ``in``."""
    side = next(s for s in (64, 32, 16) if n_in % s == 0)  # check_shapes ensured in % 16 == 0
    if transpose:
        return _CONSERVATIVE._replace(block_n=side)
    return _CONSERVATIVE._replace(block_k=side)


def tile_key(x: Tensor, p: NF4Packed, transpose: bool) -> tuple:
    """The search's key: GPU name, torch and triton versions, T rounded up to a power of two, out, in, direction."""
    tokens = max(16, 1 << max(0, x.shape[0] - 1).bit_length())
    gpu = torch.cuda.get_device_name(x.device) if x.is_cuda else "cpu"
    dtype = str(p.dtype).removeprefix("torch.")
    return (gpu, torch.__version__, triton.__version__, tokens, *p.shape, int(transpose), dtype)


def _launch(x: Tensor, p: NF4Packed, y: Tensor, transpose: bool, accumulate: bool, tile: Tile) -> None:
    """Runs the kernel: ``y (+)= x Wᵀ`` or ``x W`` with ``tile``."""
    n_out, n_in = p.shape
    n_rows, n_cols, n_red = (x.shape[0], n_in, n_out) if transpose else (x.shape[0], n_out, n_in)
    side = tile.block_n if transpose else tile.block_k
    sub = min(p.block_size, side)
    interpret = interpret_requested()
    # the compiled kernel's launch options; the interpreter takes none
    options = {} if interpret else {"num_warps": tile.num_warps, "num_stages": tile.num_stages}
    grid = (math.ceil(n_rows / tile.block_m) * math.ceil(n_cols / tile.block_n),)
    _launcher(interpret)[grid](
        x, p.data, p.scalers, p.factors, p.mean, p.lut, y, n_rows, n_cols, n_red, n_in, x.stride(0),
        p.scaler_block_size, TRANSPOSE=transpose, ACCUMULATE=accumulate, BLOCK=p.block_size, KB=side // sub,
        SUB=sub, BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, GROUP_M=_GROUP_M,
        PRECISION=dot_precision(x.dtype), **options,
    )  # fmt: skip


_TILES: dict[str, Tile] = {}  # this process's choices, so the file is read once per key


def _search(x: Tensor, p: NF4Packed, transpose: bool, candidates: list[Tile]) -> Tile:
    """The fastest of ``candidates`` (median of ``do_bench``), timed into a scratch output so ``out`` is untouched."""
    scratch = x.new_empty(x.shape[0], p.shape[1] if transpose else p.shape[0])
    best, best_ms = None, math.inf
    for tile in candidates:
        try:
            ms = triton.testing.do_bench(
                lambda tile=tile: _launch(x, p, scratch, transpose, False, tile), return_mode="median"
            )
        except Exception:  # a tile this GPU cannot compile (e.g. out of shared memory) is just skipped
            continue
        if ms < best_ms:
            best, best_ms = tile, ms
    return best or conservative_tile(p.shape[1], transpose)


def choose_tile(x: Tensor, p: NF4Packed, transpose: bool, autotune: bool) -> Tile:
    """The tile for this product: the conservative one without autotune, in the interpreter or under torch's
    deterministic algorithms (a search picks by timing), else the cached winner for :func:`tile_key` (from this
    process, then the cache file), else the winner of a search now.

    Args:
        x: the kernel's input (its rows are T).
        p: the packed weight.
        transpose: the product's direction.
        autotune: whether to search (and use the file) at all.

    Returns:
        A tile that fits ``in`` (:func:`fits`).
    """
    n_in = p.shape[1]
    if not autotune or interpret_requested() or torch.are_deterministic_algorithms_enabled():
        return conservative_tile(n_in, transpose)
    key = tile_cache.key_string(tile_key(x, p, transpose))
    tile = _TILES.get(key)
    if tile is None:
        path = tile_cache.cache_dir() / _CACHE_FILE
        stored = tile_cache.load(path).get(key)
        tile = _tile_from(stored, n_in, transpose)
        if tile is None:
            tile = _search(x, p, transpose, [t for t in CANDIDATES if fits(t, n_in, transpose)])
            tile_cache.store(path, key, tile._asdict())
        _TILES[key] = tile
    return tile


def _tile_from(entry: dict | None, n_in: int, transpose: bool) -> Tile | None:
    """The tile a cache entry names, or None when it is missing, malformed or does not fit ``in``."""
    try:
        tile = Tile(**{name: int(entry[name]) for name in Tile._fields})
    except (TypeError, KeyError, ValueError):
        return None
    return tile if fits(tile, n_in, transpose) else None


def nf4_matmul(
    x: Tensor, p: NF4Packed, out: Tensor | None = None, transpose: bool = False, autotune: bool = True
) -> Tensor:
    """``X Wᵀ`` (forward) or ``dY W`` (input gradient, ``transpose=True``) with W read packed.

    Runs the fused Triton kernel where :func:`loralei.kernels.nf4.usable` holds for ``x``; elsewhere the same
    product in torch from :func:`~loralei.kernels.nf4.dequantize_torch`.

    Args:
        x: (T, in), or (T, out) when ``transpose``, in the weight's dtype; rows may be strided.
        p: the packed (out, in) weight.
        out: contiguous (T, out) (or (T, in)) tensor of ``x``'s dtype to ACCUMULATE into (``out += product``,
            added in fp32 and rounded once); a new tensor when None.
        transpose: compute ``dY W`` instead of ``X Wᵀ``.
        autotune: search the tile on the GPU (once per key, cached in a file); False uses a conservative tile.

    Returns:
        ``out`` (or the new tensor) holding the (accumulated) product.

    Raises:
        ValueError: shapes the kernel does not take (:func:`check_shapes`) or an ``out`` of the wrong shape,
            dtype, device or layout.
    """
    check_shapes(x, p, transpose)
    shape = (x.shape[0], p.shape[1] if transpose else p.shape[0])
    if out is not None and (tuple(out.shape) != shape or out.dtype != x.dtype or not out.is_contiguous()):
        raise ValueError(
            f"out is {tuple(out.shape)} {out.dtype} (contiguous: {out.is_contiguous()}); "
            f"expected a contiguous {shape} tensor of {x.dtype}"
        )
    if out is not None and out.device != x.device:
        raise ValueError(f"out is on {out.device} but x is on {x.device}")
    if not nf4.usable(x):
        w = nf4.dequantize_torch(p)
        product = x @ w if transpose else x @ w.T
        return product if out is None else out.add_(product)
    if x.stride(1) != 1:
        x = x.contiguous()
    y = out if out is not None else x.new_empty(shape)
    if x.shape[0] > 0:
        _launch(x, p, y, transpose, out is not None, choose_tile(x, p, transpose, autotune))
    elif out is None:
        y.zero_()
    return y
