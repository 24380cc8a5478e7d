r"""``torch._scaled_mm``'s row-wise scaled FP8 product as a Triton kernel: a candidate to measure against it
(``benchmarks/bench_fp8.py``), not yet used by the FP8 bases.

For e4m3 ``a8`` (M, K), row-major, with FP32 row scales ``scale_a`` (M, 1), and e4m3 ``b_t`` (K, N),
column-major (the transposed view of row-major (N, K) codes), with FP32 column scales ``scale_b`` (1, N)::

    out[i, j] = (Σ_k a8[i, k] b_t[k, j]) · scale_b[j] · scale_a[i]      (FP32, then cast to out_dtype)

Each program computes one (BLOCK_M, BLOCK_N) tile of ``out``: its K loop feeds ``tl.dot`` the e4m3 tiles of both
operands (each read along K, its contiguous dimension) into an FP32 accumulator, and the scales are applied
once, in the epilogue. Programs take the tiles GROUP_M row tiles at a time
(:func:`~loralei.kernels.nf4_matmul.grouped_tile_ids`), so those running together share ``b_t``'s column tiles
in L2. Rows and columns past the edges are read from inside the operands (their index modulo M or N) and never
stored, so M and N need no masked loads; K is masked only where BLOCK_K does not divide it.

**Accumulation.** On Hopper, an FP8 ``tl.dot`` sums its products inside the tensor cores at less than FP32
precision, unless its partial sums are moved into the FP32 accumulator every ``max_num_imprecise_acc``
products. ``fast_accum=False`` (the default, as ``_scaled_mm``'s ``use_fast_accum=False``) moves them every
BLOCK_K products; ``fast_accum=True`` leaves the whole reduction to the tensor cores (Triton's sm_90 default):
faster and less exact. Elsewhere (other GPUs, the interpreter) the flag changes nothing.

**Tiles.** On the GPU, ``triton.autotune`` picks among :data:`CONFIGS` once per (M, N, K, output dtype,
``fast_accum``); later launches call the kernel with the remembered tile, skipping the autotuner's per-call
Python work. The interpreter uses one small tile (:data:`INTERPRETER_TILE`).

**Interpreter.** ``TRITON_INTERPRET=1`` runs the kernel on the CPU: its FP8 dots widen the codes to FP16 (exact
for e4m3) and sum the products in FP32, but its FP32 → bf16 cast truncates where the GPU rounds to nearest even,
so there the kernel writes FP32 and torch casts the result.

Shapes: K and N multiples of 16 (as ``_scaled_mm`` needs on the GPU), M any.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from .activations import build_kernel, interpret_requested, tl, triton
from .gated_mlp import interpreter_runs_loops
from .nf4_matmul import Tile, grouped_tile_ids

E4M3 = torch.float8_e4m3fn
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
ALIGN = 16  # K and N must be multiples of this


# Hopper-sized tiles (e4m3 operands: 128 × 128 × 128 takes 32 KiB of shared memory per stage, 128 × 256 × 128
# takes 48 KiB); a tile that does not fit a GPU's shared memory is skipped by the autotuner. Compiled for sm_90
# by Triton 3.9 (its ptxas 13.4, no GPU needed), the fast-accumulation kernels neither spill nor wait; with the
# precise accumulation ptxas waits for each K step's wgmmas before the FP32 additions, 128 × 256 spills 224 bytes
# and 256 × 128 serializes its wgmmas: the GPU measurements say what that costs.
CONFIGS = [
    Tile(128, 128, 128, 8, 3),
    Tile(128, 128, 128, 8, 4),
    Tile(128, 256, 128, 8, 3),
    Tile(128, 256, 128, 8, 4),
    Tile(256, 128, 128, 8, 3),
    Tile(256, 128, 128, 8, 4),
]
GROUP_M = 8  # row tiles per group in the launch order (L2 reuse of b_t's column tiles)
# The interpreter's tile and group: small, so that test shapes span several tiles and groups (warps and stages
# are ignored there).
INTERPRETER_TILE = Tile(32, 32, 32, 4, 1)
INTERPRETER_GROUP_M = 2


def _fp8_matmul_kernel(
    a_ptr, sa_ptr, b_ptr, sb_ptr, c_ptr, M, N, K, stride_am, stride_bn, stride_cm,
    EVEN_K: tl.constexpr, FAST_ACC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """One (BLOCK_M, BLOCK_N) tile of ``(a8 b_t) · scale_b · scale_a`` (module docstring)."""
    pid_m, pid_n = grouped_tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # in range: the rows and columns past the edges are computed from real ones, and never stored
    a_rows, b_cols = rows % M, cols % N
    ks = tl.arange(0, BLOCK_K)
    a_tile = a_ptr + a_rows.to(tl.int64)[:, None] * stride_am + ks[None, :]
    b_tile = b_ptr + b_cols.to(tl.int64)[None, :] * stride_bn + ks[:, None]
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_tile)
            b = tl.load(b_tile)
        else:
            a = tl.load(a_tile, mask=ks[None, :] < K - k0, other=0.0)
            b = tl.load(b_tile, mask=ks[:, None] < K - k0, other=0.0)
        # without FAST_ACC, the tensor cores' partial sums move into the FP32 accumulator every BLOCK_K products
        acc = tl.dot(a, b, acc) if FAST_ACC else tl.dot(a, b, acc, max_num_imprecise_acc=BLOCK_K)
        a_tile += BLOCK_K
        b_tile += BLOCK_K
    scaled = acc * tl.load(sb_ptr + b_cols)[None, :] * tl.load(sa_ptr + a_rows)[:, None]
    ok = (rows < M)[:, None] & (cols < N)[None, :]
    out = c_ptr + rows.to(tl.int64)[:, None] * stride_cm + cols[None, :]
    tl.store(out, scaled.to(c_ptr.dtype.element_ty), mask=ok)


def _autotuned(kernel):
    """``triton.autotune`` over :data:`CONFIGS`, keyed by M, N and K, with EVEN_K derived from each tile."""
    even_k = triton.heuristics({"EVEN_K": lambda args: args["K"] % args["BLOCK_K"] == 0})(kernel)
    configs = [
        triton.Config(
            {"BLOCK_M": t.block_m, "BLOCK_N": t.block_n, "BLOCK_K": t.block_k},
            num_warps=t.num_warps,
            num_stages=t.num_stages,
        )
        for t in CONFIGS
    ]
    return triton.autotune(configs, key=["M", "N", "K"])(even_k)


@functools.cache
def _kernel(interpret: bool):
    """The kernel for the GPU (autotuned) or for the interpreter, built once per mode."""
    return build_kernel(_fp8_matmul_kernel, interpret, _autotuned)


def usable(t: Tensor) -> bool:
    """Whether the kernel can run on ``t``'s device: Triton importable and a CUDA GPU of capability 8.9 or
    higher (FP8 tensor cores), or ``TRITON_INTERPRET=1`` with an interpreter that runs the kernel's K loop."""
    if triton is None:
        return False
    if interpret_requested():
        return interpreter_runs_loops()
    return t.is_cuda and torch.cuda.get_device_capability(t.device) >= (8, 9)


def check_operands(a8: Tensor, scale_a: Tensor, b_t: Tensor, scale_b: Tensor, out_dtype: torch.dtype) -> None:
    """Raises unless the operands are those the module docstring describes.

    Raises:
        ValueError: naming the operand and what it should be.
    """
    if a8.dtype != E4M3 or b_t.dtype != E4M3:
        raise ValueError(f"a8 is {a8.dtype} and b_t is {b_t.dtype}; both must be {E4M3}")
    if a8.dim() != 2 or b_t.dim() != 2 or a8.shape[1] != b_t.shape[0]:
        raise ValueError(f"a8 {tuple(a8.shape)} and b_t {tuple(b_t.shape)} must be (M, K) and (K, N)")
    (m, k), n = a8.shape, b_t.shape[1]
    if k % ALIGN or n % ALIGN:
        raise ValueError(f"K={k} and N={n} must be multiples of {ALIGN}")
    if a8.stride(1) != 1 or b_t.stride(0) != 1:
        raise ValueError(
            f"a8 (strides {a8.stride()}) must be row-major and b_t (strides {b_t.stride()}) column-major, "
            "e.g. the .t() of row-major (N, K) codes"
        )
    for name, scale, shape in (("scale_a", scale_a, (m, 1)), ("scale_b", scale_b, (1, n))):
        if scale.dtype != torch.float32 or tuple(scale.shape) != shape:
            raise ValueError(
                f"{name} is {scale.dtype} {tuple(scale.shape)}; it must be torch.float32 {shape}"
            )
    if len({t.device for t in (a8, scale_a, b_t, scale_b)}) > 1:
        raise ValueError("a8, scale_a, b_t and scale_b must be on one device")
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"out_dtype={out_dtype} is not supported; use one of {OUT_DTYPES}")


_TUNED: dict[tuple, dict] = {}  # (M, N, K, output dtype, fast_accum) -> the autotuner's choice, as kwargs


def _launch(a8: Tensor, sa: Tensor, b_t: Tensor, sb: Tensor, out: Tensor, fast_accum: bool) -> None:
    """Runs the kernel: ``out = (a8 b_t) · sb · sa`` for the flat scales ``sa`` (M,) and ``sb`` (N,)."""
    (m, k), n = a8.shape, b_t.shape[1]
    args = (a8, sa, b_t, sb, out, m, n, k, a8.stride(0), b_t.stride(1), out.stride(0))
    interpret = interpret_requested()
    kernel = _kernel(interpret)
    if interpret:
        t = INTERPRETER_TILE
        grid = (triton.cdiv(m, t.block_m) * triton.cdiv(n, t.block_n),)
        kernel[grid](
            *args, EVEN_K=k % t.block_k == 0, FAST_ACC=fast_accum, BLOCK_M=t.block_m, BLOCK_N=t.block_n,
            BLOCK_K=t.block_k, GROUP_M=INTERPRETER_GROUP_M,
        )  # fmt: skip
        return

    def grid(meta: dict) -> tuple[int]:
        return (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)

    key = (m, n, k, out.dtype, fast_accum)
    tuned = _TUNED.get(key)
    if tuned is None:
        kernel[grid](*args, FAST_ACC=fast_accum, GROUP_M=GROUP_M)
        _TUNED[key] = kernel.best_config.all_kwargs()
    else:
        kernel.fn[grid](*args, FAST_ACC=fast_accum, GROUP_M=GROUP_M, **tuned)


def fp8_matmul(
    a8: Tensor,
    scale_a: Tensor,
    b_t: Tensor,
    scale_b: Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    fast_accum: bool = False,
) -> Tensor:
    """``torch._scaled_mm(a8, b_t, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)`` with row-wise
    scales, computed by the Triton kernel (module docstring).

    Args:
        a8: (M, K) e4m3 codes, rows with unit stride (rows may be strided).
        scale_a: (M, 1) FP32 row scales.
        b_t: (K, N) e4m3 codes, column-major (the ``.t()`` of row-major (N, K) codes).
        scale_b: (1, N) FP32 column scales.
        out_dtype: bf16, fp16 or fp32.
        fast_accum: leave the whole reduction to Hopper's tensor cores (``_scaled_mm``'s ``use_fast_accum``).

    Returns:
        A new contiguous (M, N) tensor of ``out_dtype``.

    Raises:
        ValueError: operands that :func:`check_operands` refuses.
        RuntimeError: where the kernel cannot run (:func:`usable`).
    """
    check_operands(a8, scale_a, b_t, scale_b, out_dtype)
    if not usable(a8):
        raise RuntimeError(
            f"the FP8 Triton GEMM cannot run on {a8.device}: it needs Triton and a CUDA GPU of capability 8.9 or "
            "higher, or TRITON_INTERPRET=1; use torch._scaled_mm there"
        )
    m, n = a8.shape[0], b_t.shape[1]
    interpret = interpret_requested()  # the interpreter writes FP32 (module docstring)
    out = torch.empty(m, n, dtype=torch.float32 if interpret else out_dtype, device=a8.device)
    if m:
        sa, sb = scale_a.reshape(-1).contiguous(), scale_b.reshape(-1).contiguous()
        _launch(a8, sa, b_t, sb, out, fast_accum)
    return out.to(out_dtype)
