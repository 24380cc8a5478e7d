"""Choosing and launching the gated-MLP kernels (:mod:`loralei.kernels.gated_mlp_kernels`): the ranks they take,
how many programs share a reduction, their tile configs and the autotuner on the GPU, fixed small blocks in the
interpreter (and whether this Triton's interpreter runs their loops at all)."""

from __future__ import annotations

import functools

import torch

from .activations import build_kernel, dot_precision, interpret_requested, launch_autotuned, tl, triton
from .gated_mlp_kernels import _gated_mlp_backward_kernel, _gated_mlp_forward_kernel

MAX_RANK = 64  # larger ranks would spill the (R × block) accumulators out of registers
# (rows, columns, warps, stages) per program, tried once per (n_inter, R) by triton.autotune on the GPU. On an
# H200 the backward took 32×128 / 4 warps / 3 stages at the 8B MLP (I = 14336) and 32×64 at Qwen3-0.6B's
# (I = 3072) (benchmarks/results/archive/2026-11-29-h200-mlp-lowrank-ab.txt). The forward loops over its
# split's columns since it also forms h A_dᵀ; its configs add pipelined (3- and 4-stage) ones to the tile sizes
# that won when it ran one tile per program (32×128 / 4 warps at both). The autotuner took 64×64 / 4 warps /
# 3 stages at both shapes until 4 stages were offered; alone on an H200, 4 stages ran 0.268 ms against 0.309 at
# 8B and 0.141 against 0.158 at Qwen3-0.6B. Its registers (178 a thread) leave two programs an SM; capped at 168
# (a fifth value: ``maxnreg``), 64×64 / 4 warps / 3 stages ran 0.221 ms against 0.242 uncapped at 8B
# (benchmarks/results/archive/2026-12-02-h200-gated-kernel-probes.json; the backward only lost from a cap).
# The backward issues each row block's loads one iteration ahead (its docstring); alone at 8B, 16×64 / 4 warps /
# 2-3 stages then ran 0.398-0.408 ms against 0.478-0.526 for the kernel without (its autotuned 32×128, and 16×64)
# in the same call (eager launches, partial sums included;
# benchmarks/results/archive/2026-12-02-h200-power-and-gemm-probes.json), while 32×128 tiles lost (0.71: the
# second set of tiles spills). In the runner's profiled 8B step it took 14.4 ms a step against 15.8, and Qwen3-0.6B
# stayed level; the same prefetch in the forward was slower there (9.4 ms against 7.4)
# (benchmarks/results/archive/2026-12-02-h200-gated-prefetch-ab.json). With that prefetch, accumulating dB_g and
# dB_u as (R × columns) (``Z_gᵀ dG``) instead of (columns × R) (``dGᵀ Z_g``, a warp-group MMA through shared
# memory) ran 0.389 ms against 0.404 at 8B and 0.188 against 0.203 at Qwen3-0.6B, the same bits, and +0.3 % in
# the 8B runner (benchmarks/results/archive/2026-12-03-h200-gated-backward-row-major-products-ab.json).
_CONFIGS = [
    (16, 64, 4, 2),
    (16, 64, 4, 3),
    (32, 64, 4, 3),
    (32, 128, 4, 3),
    (16, 128, 4, 3),
    (64, 64, 4, 3),
    (32, 64, 8, 3),
    (64, 64, 8, 3),
]
_FORWARD_CONFIGS = [
    (32, 128, 4, 2),
    (32, 128, 4, 3),
    (64, 64, 4, 3),
    (64, 64, 4, 4),
    (64, 64, 4, 3, 168),
    (64, 128, 4, 3),
    (64, 128, 8, 3),
    (16, 128, 4, 3),
]
_INTERPRETER_BLOCKS = (16, 32)  # (rows, columns) per program in the interpreter: small and still tl.dot-sized
# Columns per forward program: a multiple of every column block; the 8B MLP (I = 14336) gets 14 splits.
SPLIT_COLUMNS = 1024


def _autotuned(configs: list[tuple[int, ...]], in_place: list[str]):
    """``triton.autotune`` over ``configs`` (rows, columns, warps, stages[, register cap]), keyed by n_inter and
    R; the ``in_place`` outputs restored per trial."""

    def wrap(kernel):
        return triton.autotune(
            [
                triton.Config(
                    {"BT": bt, "BI": bi}, num_warps=w, num_stages=st, maxnreg=cap[0] if cap else None
                )
                for bt, bi, w, st, *cap in configs
            ],
            key=["n_inter", "R"],
            restore_value=in_place,
        )(kernel)

    return wrap


@functools.cache
def _kernel(backward: bool, interpret: bool):
    """The forward or backward kernel for the GPU (autotuned) or the interpreter, built once per mode."""
    if backward:
        return build_kernel(_gated_mlp_backward_kernel, interpret, _autotuned(_CONFIGS, ["g_ptr", "u_ptr"]))
    return build_kernel(_gated_mlp_forward_kernel, interpret, _autotuned(_FORWARD_CONFIGS, []))


def _loop_probe_kernel(out_ptr, n):
    total = 0
    for i in range(0, n, 1):
        total += i
    tl.store(out_ptr, total)


@torch.compiler.assume_constant_result
@functools.cache
def interpreter_runs_loops() -> bool:
    """Whether this Triton's interpreter runs loops with run-time bounds (Triton 3.6's fails under numpy ≥ 2.4)."""
    out = torch.zeros(1, dtype=torch.int32)
    try:
        build_kernel(_loop_probe_kernel, interpret=True)[(1,)](out, 3)
    except Exception:  # the interpreter's own error type differs between Triton versions
        return False
    return out.item() == 3


def default_splits(length: int, chunk: int) -> int:
    """How many programs share one reduction of ``length``: about one per ``chunk``, between 1 and 16."""
    return max(1, min(16, length // chunk))


_TUNED: dict[tuple, dict] = {}  # launch key -> the autotuner's choice, as launch keyword arguments


_NARROWEST = min(bi for _, bi, *_ in _CONFIGS)  # columns of the narrowest backward block the autotuner tries


def most_column_blocks(inter: int) -> int:
    """The most column blocks a backward launch over ``inter`` columns can have here (the interpreter's fixed
    block, or the narrowest the autotuner tries)."""
    return triton.cdiv(inter, _INTERPRETER_BLOCKS[1] if interpret_requested() else _NARROWEST)


def launch(backward: bool, grid, args: tuple, inter: int, **constexprs) -> int:
    """Runs the forward or backward kernel on ``args`` (``inter`` = I among them) with the given constexprs.

    In the interpreter the blocks are fixed and small. On the GPU the autotuner chooses once per key (n_inter,
    the constexprs, the tensors' dtypes; :func:`launch_autotuned`).

    Returns:
        The launch's columns per block (``BI``).
    """
    interpret = interpret_requested()
    kernel = _kernel(backward, interpret)
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    precision = dot_precision(tensors[0].dtype)
    if interpret:
        bt, bi = _INTERPRETER_BLOCKS
        kernel[grid](*args, **constexprs, PRECISION=precision, BT=bt, BI=bi)
        return bi
    key = (backward, inter, *constexprs.values(), *(t.dtype for t in tensors))
    return launch_autotuned(kernel, _TUNED, key, grid, *args, **constexprs, PRECISION=precision)["BI"]
