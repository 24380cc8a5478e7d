r"""The gated MLP's elementwise passes as two Triton kernels that also carry its rank-r LoRA work.

Shapes: T tokens, I intermediate features, rank r (per projection). ``G₀``, ``U₀`` are the base gate/up outputs
(T×I) and each LoRA term is a :class:`LowRank` ``s · Z M`` with ``Z`` (T×r) and ``M`` (r×I): the gate's
``s_g Z_g B_gᵀ``, the up projection's ``s_u Z_u B_uᵀ`` and, in the backward, the down projection's
input-gradient term ``s_d P_d A_d`` (``Z_p = (x⊙m_p) A_pᵀ`` from the forward, ``P_d = dY B_d``).

Forward, one program per block of rows looping over a share of the columns:
``h = act(G₀ + s_g Z_g M_g) ⊙ (U₀ + s_u Z_u M_u)``. The LoRA terms are formed in registers by a rank-r dot, so
they never exist as T×I tensors, and G, U are never stored (only G₀, U₀). The same tiles give the down
projection's ``h A_dᵀ`` (T×r_d, its LoRA input), which a GEMM would otherwise read all of ``h`` again for.

Backward, one program per block of columns looping over a share of the rows: forms ``G``, ``U`` and
``dh = dh₀ + s_d P_d M_d`` the same way, writes ``dG = dh ⊙ U ⊙ act'(G)`` over ``G₀`` and ``dU = dh ⊙ act(G)``
over ``U₀``, recomputes ``h`` and takes the MLP's rank-r reductions ``P_dᵀ h`` (dA_d), ``dGᵀ Z_g`` (dB_g) and
``dUᵀ Z_u`` (dB_u) from the tiles while they are in registers. All three accumulate as (R × columns) blocks,
``Z_gᵀ dG`` and ``Z_uᵀ dU`` for the transposed products, so all three are R-row products of the same form
(the last two stored transposed at the end). Per T×I element that is 3 reads and 2 writes;
unfused it is the LoRA terms' writes and reads, the elementwise pass (3 reads, 3 writes) and the GEMMs that read
``h``, ``dG`` and ``dU`` again.

The backward's rows are split among ``splits`` programs per column block so the grid fills the GPU, and the
forward's columns among ``I / SPLIT_COLUMNS`` programs per row block; their fp32 partial sums are added
afterwards (deterministic, no atomics), scaled and rounded to the gradients' dtypes in the same small launches
(:mod:`loralei.kernels.partial_sums`). Ranks are padded to ``R`` (a power of two ≥ 16, ``tl.dot``'s minimum)
by masked loads. Products use the compute dtype's values (``h``, ``dG``, ``dU`` rounded as
stored; the ``M`` factors cast to it) with fp32 accumulation, like the GEMMs they replace; ``G``, ``U``, ``dh``
stay in fp32 between the dot and the activation.

Row maxima (for an FP8 quantization of ``h`` or of ``[dG·c_g dU·c_u]`` per row, which then need not read the
rows twice): asked for, each program reduces its tile's ``|h|`` (or ``max(|dG·c_g|, |dU·c_u|)``, the values as
stored times the FP32 column factors) over its columns and raises the row's entry of a zeroed (T,) FP32 tensor
with an atomic maximum (exact, so the order of the programs does not matter). With DoRA's scaling below, the
maxima are of the values as stored too: ``h`` of the scaled sums, and ``f_g ⊙ dG``, ``f_u ⊙ dU``.

DoRA (``columns``, constexpr ``SCALED``): per-column fp32 factors ``f`` and biases ``b`` for gate and up, applied
as ``G = f_g ⊙ (G₀ + s_g Z_g M_g) + b_g`` (likewise U) in both kernels; the backward then writes ``f_g ⊙ dG`` and
``f_u ⊙ dU`` (the gradients of the unscaled sums; dB_g and dB_u are taken from them) and sums ``dG ⊙ (G₀ + s_g
Z_g M_g)`` and ``dU ⊙ (U₀ + s_u Z_u M_u)`` per column into fp32 partials (the magnitudes' gradients up to the
norms), from the tiles already in registers. Compiled for sm_90 (ptxas, no GPU run yet), the scaled backward
takes about 250 registers a thread at 16×64 / 4 warps against 161 without (the per-column vectors' broadcasts;
the dots alone add about 15), so fewer programs share an SM; the forward stays at its cap either way.

Launch only where :func:`usable` says so; the caller keeps the unfused path for the rest.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

# act_and_slope: a jit helper the kernels call (build_kernel swaps in its plain function for the interpreter)
from .activations import (
    ACTIVATIONS,
    act_and_slope,
    add_combine,
    build_kernel,
    dot_precision,
    eager_call,
    interpret_requested,
    jit_helper,
    launch_autotuned,
    tl,
    triton,
    triton_usable,
)
from .cross_entropy import max_combine
from .partial_sums import Partials, sum_partials

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


@jit_helper
def _load_narrow(ptr, stride, rows, row_ok, rk, RANK, FULL: tl.constexpr):
    """The (rows × R) tile of a (T, RANK) matrix with contiguous columns, zero past its rank.

    ``FULL`` (RANK == R) drops the mask along the rank, which lets the rows load as vectors.
    """
    mask = row_ok[:, None]
    if not FULL:
        mask = mask & (rk < RANK)[None, :]
    return tl.load(ptr + rows.to(tl.int64)[:, None] * stride + rk[None, :], mask=mask, other=0.0)


@jit_helper
def _load_factor(ptr, stride_k, stride_c, rk, RANK, cols, col_ok, dtype):
    """The (R × columns) tile of a (RANK, I) factor with any strides, zero past its rank, in ``dtype``."""
    tile = tl.load(
        ptr + rk[:, None] * stride_k + cols[None, :] * stride_c,
        mask=(rk < RANK)[:, None] & col_ok[None, :],
        other=0.0,
    )
    return tile.to(dtype)


@jit_helper
def _column_affine(col_ptr, n_inter, cols, col_ok):
    """The (4, I) fp32 rows ``f_g, b_g, f_u, b_u`` at ``cols``: DoRA's per-column factors and biases, applied as
    ``G = f_g ⊙ (G₀ + s_g Z_g M_g) + b_g`` (likewise U)."""
    return (
        tl.load(col_ptr + cols, mask=col_ok, other=0.0),
        tl.load(col_ptr + n_inter + cols, mask=col_ok, other=0.0),
        tl.load(col_ptr + 2 * n_inter + cols, mask=col_ok, other=0.0),
        tl.load(col_ptr + 3 * n_inter + cols, mask=col_ok, other=0.0),
    )


def _gated_mlp_forward_kernel(
    g_ptr, u_ptr, h_ptr, zg_ptr, zu_ptr, mg_ptr, mu_ptr, ad_ptr, zd_ptr, col_ptr, rowmax_ptr,
    n_tokens, n_inter, RG, RU, RD, stride_zg, stride_zu, stride_mgk, stride_mgc, stride_muk, stride_muc,
    stride_adk, stride_adc, s_g, s_u, per_split,
    ACT: tl.constexpr, R: tl.constexpr, FULL: tl.constexpr, ROW_MAX: tl.constexpr, BT: tl.constexpr,
    BI: tl.constexpr, PRECISION: tl.constexpr, SCALED: tl.constexpr,
):  # fmt: skip
    """Rows ``pid(0)``, column split ``pid(1)``: ``h = act(G₀ + s_g Z_g M_g) ⊙ (U₀ + s_u Z_u M_u)`` over the
    split's columns (with ``SCALED`` each sum first scaled and shifted per column: :func:`_column_affine`), and
    the split's partial ``h A_dᵀ`` (fp32, one (BT, R) block per program); with ``ROW_MAX`` also the split's
    ``max |h|`` per row (as stored), raised into ``rowmax_ptr`` atomically."""
    split = tl.program_id(1)
    c_begin = split * per_split
    c_end = tl.minimum(n_inter, c_begin + per_split)
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    row_ok = rows < n_tokens
    rk = tl.arange(0, R)
    dtype = g_ptr.dtype.element_ty
    zg = _load_narrow(zg_ptr, stride_zg, rows, row_ok, rk, RG, FULL)
    zu = _load_narrow(zu_ptr, stride_zu, rows, row_ok, rk, RU, FULL)
    acc = tl.full((BT, R), 0.0, tl.float32)
    top = tl.full((BT,), 0.0, tl.float32)
    for c0 in range(c_begin, c_end, BI):
        cols = c0 + tl.arange(0, BI)
        col_ok = cols < c_end
        ok = row_ok[:, None] & col_ok[None, :]
        offs = rows.to(tl.int64)[:, None] * n_inter + cols[None, :]
        mg = _load_factor(mg_ptr, stride_mgk, stride_mgc, rk, RG, cols, col_ok, dtype)
        mu = _load_factor(mu_ptr, stride_muk, stride_muc, rk, RU, cols, col_ok, dtype)
        g = tl.load(g_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        g += s_g * tl.dot(zg, mg, input_precision=PRECISION)
        u += s_u * tl.dot(zu, mu, input_precision=PRECISION)
        if SCALED:
            fg, bg, fu, bu = _column_affine(col_ptr, n_inter, cols, col_ok)
            g = g * fg[None, :] + bg[None, :]
            u = u * fu[None, :] + bu[None, :]
        act, _ = act_and_slope(g, ACT)
        h = (act * u).to(dtype)  # zero outside the tile's rows and columns (G, U load as zero there)
        tl.store(h_ptr + offs, h, mask=ok)
        if ROW_MAX:
            top = tl.maximum(top, tl.reduce(tl.abs(h.to(tl.float32)), 1, max_combine))
        ad = _load_factor(ad_ptr, stride_adk, stride_adc, rk, RD, cols, col_ok, dtype)
        acc = tl.dot(h, tl.trans(ad), acc, input_precision=PRECISION)
    out = zd_ptr + split.to(tl.int64) * n_tokens * R + rows.to(tl.int64)[:, None] * R + rk[None, :]
    tl.store(out, acc, mask=row_ok[:, None])
    if ROW_MAX:
        tl.atomic_max(rowmax_ptr + rows, top, mask=row_ok)


@jit_helper
def _backward_tiles(
    dh_ptr, g_ptr, u_ptr, pd_ptr, zg_ptr, zu_ptr, t0, t_end, cols, col_ok, rk, n_inter, RD, RG, RU,
    stride_pd, stride_zg, stride_zu, FULL: tl.constexpr, BT: tl.constexpr,
):  # fmt: skip
    """The backward's operands for rows ``t0 .. t0 + BT`` as stored (zero past ``t_end``): P_d, Z_g, Z_u, G₀, U₀
    and dh₀ tiles."""
    rows = t0 + tl.arange(0, BT)
    row_ok = rows < t_end
    ok = row_ok[:, None] & col_ok[None, :]
    offs = rows.to(tl.int64)[:, None] * n_inter + cols[None, :]
    return (
        _load_narrow(pd_ptr, stride_pd, rows, row_ok, rk, RD, FULL),
        _load_narrow(zg_ptr, stride_zg, rows, row_ok, rk, RG, FULL),
        _load_narrow(zu_ptr, stride_zu, rows, row_ok, rk, RU, FULL),
        tl.load(g_ptr + offs, mask=ok, other=0.0),
        tl.load(u_ptr + offs, mask=ok, other=0.0),
        tl.load(dh_ptr + offs, mask=ok, other=0.0),
    )


def _gated_mlp_backward_kernel(
    dh_ptr, g_ptr, u_ptr, pd_ptr, zg_ptr, zu_ptr, md_ptr, mg_ptr, mu_ptr, da_ptr, dbg_ptr, dbu_ptr, col_ptr,
    dots_ptr, cg_ptr, cu_ptr, rowmax_ptr, n_tokens, n_inter, RD, RG, RU, stride_pd, stride_zg, stride_zu,
    stride_mdk, stride_mdc, stride_mgk, stride_mgc, stride_muk, stride_muc, s_d, s_g, s_u,
    ACT: tl.constexpr, R: tl.constexpr, FULL: tl.constexpr, ROW_MAX: tl.constexpr, BT: tl.constexpr,
    BI: tl.constexpr, PRECISION: tl.constexpr, SCALED: tl.constexpr,
):  # fmt: skip
    """Columns ``pid(0)``, row split ``pid(1)``: writes dG, dU over G₀, U₀ and the split's partial dA_d, dB_g, dB_u;
    with ``ROW_MAX`` also raises ``rowmax_ptr[t]`` to the block's ``max(|dG·c_g|, |dU·c_u|)`` of each row t
    (dG, dU as stored, with ``SCALED`` thus ``f_g ⊙ dG`` and ``f_u ⊙ dU``, times the FP32 column factors
    ``cg_ptr``, ``cu_ptr``), atomically.

    With ``SCALED`` (DoRA, :func:`_column_affine`) the values written are ``f_g ⊙ dG`` and ``f_u ⊙ dU`` (the
    gradients of the unscaled sums ``Z``, which dB_g and dB_u are then taken from too), and the split's partial
    column dots ``Σ dG ⊙ Z_G`` and ``Σ dU ⊙ Z_U`` (the magnitudes' gradients up to the norms) go to ``dots_ptr``.

    Each iteration first issues the loads of the next row block, then computes on the tiles the previous one
    loaded, so the memory requests of one block are in flight while the last is computed."""
    split, n_split = tl.program_id(1), tl.num_programs(1)
    per_split = ((n_tokens + n_split - 1) // n_split + BT - 1) // BT * BT  # no tl.cdiv: see build_kernel
    t_begin = split * per_split
    t_end = tl.minimum(n_tokens, t_begin + per_split)
    cols = tl.program_id(0) * BI + tl.arange(0, BI)
    col_ok = cols < n_inter
    rk = tl.arange(0, R)
    dtype = g_ptr.dtype.element_ty
    md = _load_factor(md_ptr, stride_mdk, stride_mdc, rk, RD, cols, col_ok, dtype)
    mg = _load_factor(mg_ptr, stride_mgk, stride_mgc, rk, RG, cols, col_ok, dtype)
    mu = _load_factor(mu_ptr, stride_muk, stride_muc, rk, RU, cols, col_ok, dtype)
    acc_da = tl.full((R, BI), 0.0, tl.float32)
    acc_dbg = tl.full((R, BI), 0.0, tl.float32)
    acc_dbu = tl.full((R, BI), 0.0, tl.float32)
    dot_g = tl.full((BI,), 0.0, tl.float32)
    dot_u = tl.full((BI,), 0.0, tl.float32)
    fg, bg, fu, bu = dot_g, dot_g, dot_u, dot_u  # unused unless SCALED
    if SCALED:
        fg, bg, fu, bu = _column_affine(col_ptr, n_inter, cols, col_ok)
    if ROW_MAX:
        cg = tl.load(cg_ptr + cols, mask=col_ok, other=0.0)
        cu = tl.load(cu_ptr + cols, mask=col_ok, other=0.0)
    nxt = _backward_tiles(
        dh_ptr, g_ptr, u_ptr, pd_ptr, zg_ptr, zu_ptr, t_begin, t_end, cols, col_ok, rk, n_inter, RD, RG, RU,
        stride_pd, stride_zg, stride_zu, FULL, BT,
    )  # fmt: skip
    for t0 in range(t_begin, t_end, BT):
        pd, zg, zu, g0, u0, dh0 = nxt
        nxt = _backward_tiles(
            dh_ptr, g_ptr, u_ptr, pd_ptr, zg_ptr, zu_ptr, t0 + BT, t_end, cols, col_ok, rk, n_inter, RD, RG, RU,
            stride_pd, stride_zg, stride_zu, FULL, BT,
        )  # fmt: skip
        # formed again, not carried over from the prefetch: fewer registers live across the iteration
        rows = t0 + tl.arange(0, BT)
        ok = (rows < t_end)[:, None] & col_ok[None, :]
        offs = rows.to(tl.int64)[:, None] * n_inter + cols[None, :]
        g = g0.to(tl.float32) + s_g * tl.dot(zg, mg, input_precision=PRECISION)
        u = u0.to(tl.float32) + s_u * tl.dot(zu, mu, input_precision=PRECISION)
        dh = dh0.to(tl.float32) + s_d * tl.dot(pd, md, input_precision=PRECISION)
        if SCALED:
            z_g, z_u = g, u
            g = z_g * fg[None, :] + bg[None, :]
            u = z_u * fu[None, :] + bu[None, :]
        act, slope = act_and_slope(g, ACT)
        dg = dh * u * slope
        du = dh * act
        if SCALED:
            dot_g += tl.reduce(dg * z_g, 0, add_combine)
            dot_u += tl.reduce(du * z_u, 0, add_combine)
            dg = dg * fg[None, :]
            du = du * fu[None, :]
        dg = dg.to(dtype)
        du = du.to(dtype)
        h = (act * u).to(dtype)
        tl.store(g_ptr + offs, dg, mask=ok)  # each program reads its tiles before writing them
        tl.store(u_ptr + offs, du, mask=ok)
        if ROW_MAX:
            top = tl.maximum(tl.abs(dg.to(tl.float32) * cg[None, :]), tl.abs(du.to(tl.float32) * cu[None, :]))
            tl.atomic_max(rowmax_ptr + rows, tl.reduce(top, 1, max_combine), mask=rows < t_end)
        acc_da = tl.dot(tl.trans(pd), h, acc_da, input_precision=PRECISION)
        acc_dbg = tl.dot(tl.trans(zg), dg, acc_dbg, input_precision=PRECISION)
        acc_dbu = tl.dot(tl.trans(zu), du, acc_dbu, input_precision=PRECISION)
    base = split.to(tl.int64) * R * n_inter
    tl.store(da_ptr + base + rk[:, None] * n_inter + cols[None, :], acc_da, mask=col_ok[None, :])
    tl.store(dbg_ptr + base + cols[None, :] * R + rk[:, None], acc_dbg, mask=col_ok[None, :])
    tl.store(dbu_ptr + base + cols[None, :] * R + rk[:, None], acc_dbu, mask=col_ok[None, :])
    if SCALED:
        dots = dots_ptr + split.to(tl.int64) * n_inter + cols
        tl.store(dots, dot_g, mask=col_ok)
        tl.store(dots + n_split * n_inter, dot_u, mask=col_ok)


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


def _padded_rank(*ranks: int) -> int:
    return max(16, triton.next_power_of_2(max(ranks)))


def usable(gate: torch.Tensor, ranks: tuple[int, ...]) -> bool:
    """Whether the kernels can run for gate/up outputs like ``gate`` and these LoRA ranks.

    Args:
        gate: the (T, I) gate output.
        ranks: the ranks of gate, up and down.

    Returns:
        True where Triton runs on ``gate`` (see :func:`triton_usable`; in the interpreter, one that runs loops)
        and every rank is at most ``MAX_RANK``.
    """
    if not triton_usable(gate) or max(ranks) > MAX_RANK:
        return False
    return not interpret_requested() or interpreter_runs_loops()


_TUNED: dict[tuple, dict] = {}  # launch key -> the autotuner's choice, as launch keyword arguments


def _launch(backward: bool, grid, args: tuple, inter: int, **constexprs) -> None:
    """Runs the forward or backward kernel on ``args`` (``inter`` = I among them) with the given constexprs.

    In the interpreter the blocks are fixed and small. On the GPU the autotuner chooses once per key (n_inter,
    the constexprs, the tensors' dtypes; :func:`launch_autotuned`).
    """
    interpret = interpret_requested()
    kernel = _kernel(backward, interpret)
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    precision = dot_precision(tensors[0].dtype)
    if interpret:
        bt, bi = _INTERPRETER_BLOCKS
        kernel[grid](*args, **constexprs, PRECISION=precision, BT=bt, BI=bi)
        return
    key = (backward, inter, *constexprs.values(), *(t.dtype for t in tensors))
    launch_autotuned(kernel, _TUNED, key, grid, *args, **constexprs, PRECISION=precision)


class RowMaxima(NamedTuple):
    """Where the backward takes the rows' maxima of ``[dG · c_g  dU · c_u]`` (for its FP8 quantization)."""

    out: torch.Tensor  # (T,) FP32 zeros; raised to each row's maximum
    gate_factors: torch.Tensor  # (I,) FP32 column factors c_g, contiguous
    up_factors: torch.Tensor  # (I,) FP32 column factors c_u, contiguous


def _check_row_max(row_max: torch.Tensor | None, gate: torch.Tensor) -> None:
    """A row-maxima output must be a contiguous (T,) FP32 tensor on ``gate``'s device."""
    if row_max is not None and (
        row_max.shape != (gate.shape[0],) or row_max.dtype != torch.float32 or row_max.device != gate.device
    ):
        raise ValueError(
            f"row_max must be ({gate.shape[0]},) float32 on {gate.device}, got {tuple(row_max.shape)} "
            f"{row_max.dtype} on {row_max.device}"
        )


class LowRank(NamedTuple):
    """A rank-r term ``scale · z @ m`` (T×I) that the kernels add to a T×I operand as they load it."""

    z: torch.Tensor  # (T, r), columns contiguous, rows any stride
    m: torch.Tensor  # (r, I), any strides (e.g. ``B.t()`` or ``A``), any floating dtype
    scale: float


def _check_layout(full: dict[str, torch.Tensor], terms: dict[str, LowRank]) -> None:
    """The kernels index ``full`` tensors as contiguous rows and each term's ``z`` by row stride only."""
    for name, t in full.items():
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous (strides {t.stride()}); call .contiguous() first")
    for name, term in terms.items():
        if term.z.stride(1) != 1:
            raise ValueError(
                f"{name}.z must have contiguous columns (strides {term.z.stride()}); call .contiguous() first"
            )
        if term.m.shape != (term.z.shape[1], full["gate"].shape[1]):
            raise ValueError(
                f"{name}.m is {tuple(term.m.shape)}, expected (rank, I) = {(term.z.shape[1], full['gate'].shape[1])}"
            )


def default_splits(length: int, chunk: int) -> int:
    """How many programs share one reduction of ``length``: about one per ``chunk``, between 1 and 16."""
    return max(1, min(16, length // chunk))


class _TermArgs(NamedTuple):
    """Kernel arguments of rank-r terms, in the kernels' order within each group."""

    pointers: list[torch.Tensor]  # the z's, then the m's
    ranks: list[int]
    strides: list[int]  # each z's row stride, then each m's two strides
    scales: list[float]
    R: int  # the ranks padded to a power of two >= 16 (tl.dot's minimum)
    full: bool  # every rank equals R: no mask along the rank


def _term_args(*terms: tuple[torch.Tensor, torch.Tensor, float], other_rank: int = 0) -> _TermArgs:
    """The kernels' arguments for ``(z, m, scale)`` terms; ``R`` also covers ``other_rank`` (a factor the kernel
    reads beside the terms)."""
    ranks = [z.shape[1] for z, _, _ in terms]
    rank = _padded_rank(*ranks, other_rank)
    return _TermArgs(
        pointers=[z for z, _, _ in terms] + [m for _, m, _ in terms],
        ranks=ranks,
        strides=[z.stride(0) for z, _, _ in terms] + [st for _, m, _ in terms for st in m.stride()],
        scales=[float(s) for _, _, s in terms],
        R=rank,
        full=all(r == rank for r in ranks),
    )


def _forward_impl(
    gate: torch.Tensor,
    up: torch.Tensor,
    z_gate: torch.Tensor,
    m_gate: torch.Tensor,
    s_gate: float,
    z_up: torch.Tensor,
    m_up: torch.Tensor,
    s_up: float,
    a_down: torch.Tensor,
    activation: str,
    per_split: int,
    row_max: torch.Tensor | None,
    columns: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    tokens, inter = gate.shape
    r_d = a_down.shape[0]
    t = _term_args((z_gate, m_gate, s_gate), (z_up, m_up, s_up), other_rank=r_d)
    splits = triton.cdiv(inter, per_split)
    h = torch.empty_like(gate)
    parts = torch.empty(splits, tokens, t.R, device=gate.device, dtype=torch.float32)

    def grid(meta: dict) -> tuple[int, int]:
        return (triton.cdiv(tokens, meta["BT"]), splits)

    args = (
        gate, up, h, *t.pointers, a_down, parts, columns, parts if row_max is None else row_max, tokens, inter,
        *t.ranks, r_d, *t.strides, *a_down.stride(), *t.scales, per_split,
    )  # fmt: skip
    scaled = columns.dim() == 2
    constexprs = {"ROW_MAX": row_max is not None, "SCALED": scaled}
    _launch(False, grid, args, inter, ACT=ACTIVATIONS[activation], R=t.R, FULL=t.full, **constexprs)
    z_down = gate.new_empty(tokens, r_d)
    sum_partials(Partials(parts, z_down, 1.0))
    return h, z_down


def _backward_impl(
    dh: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    p_down: torch.Tensor,
    m_down: torch.Tensor,
    s_down: float,
    z_gate: torch.Tensor,
    m_gate: torch.Tensor,
    s_gate: float,
    z_up: torch.Tensor,
    m_up: torch.Tensor,
    s_up: float,
    activation: str,
    splits: int,
    da_dtype: torch.dtype,
    dbg_dtype: torch.dtype,
    dbu_dtype: torch.dtype,
    row_max: torch.Tensor | None,
    gate_factors: torch.Tensor | None,
    up_factors: torch.Tensor | None,
    columns: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    tokens, inter = gate.shape
    t = _term_args((p_down, m_down, s_down), (z_gate, m_gate, s_gate), (z_up, m_up, s_up))
    (r_d, r_g, r_u), rank = t.ranks, t.R
    parts = torch.empty(3, splits, inter * rank, device=gate.device, dtype=torch.float32)
    scaled = columns.dim() == 2
    dots = torch.empty(
        2 if scaled else 1, splits, inter if scaled else 1, device=gate.device, dtype=torch.float32
    )

    def grid(meta: dict) -> tuple[int, int]:
        return (triton.cdiv(inter, meta["BI"]), splits)

    maxima = [parts] * 3 if row_max is None else [gate_factors, up_factors, row_max]
    args = (
        dh, gate, up, *t.pointers, *parts, columns, dots, *maxima, tokens, inter, *t.ranks, *t.strides,
        *t.scales,
    )  # fmt: skip
    constexprs = {"ROW_MAX": row_max is not None, "SCALED": scaled}
    _launch(True, grid, args, inter, ACT=ACTIVATIONS[activation], R=rank, FULL=t.full, **constexprs)
    torch.autograd.graph.increment_version([gate, up])  # written through raw pointers
    outs = (
        gate.new_empty(r_d, inter, dtype=da_dtype),
        gate.new_empty(inter, r_g, dtype=dbg_dtype),
        gate.new_empty(inter, r_u, dtype=dbu_dtype),
    )
    sum_partials(
        Partials(parts[0].view(splits, rank, inter), outs[0], s_down),
        Partials(parts[1].view(splits, inter, rank), outs[1], s_gate),
    )
    sum_partials(Partials(parts[2].view(splits, inter, rank), outs[2], s_up))
    return (*outs, dots.sum(1) if scaled else dots.new_empty(0, inter))


# Custom ops hide the launches from torch.compile (Dynamo would otherwise trace into the launchers).
_forward_op = torch.library.custom_op("loralei::gated_mlp_fwd", _forward_impl, mutates_args=("row_max",))
_backward_op = torch.library.custom_op(
    "loralei::gated_mlp_bwd_", _backward_impl, mutates_args=("gate", "up", "row_max")
)


@_forward_op.register_fake
def _(gate, up, z_gate, m_gate, s_gate, z_up, m_up, s_up, a_down, *_):
    return torch.empty_like(gate), gate.new_empty(gate.shape[0], a_down.shape[0])


@_backward_op.register_fake
def _(dh, gate, up, p_down, m_down, s_down, z_gate, m_gate, s_gate, z_up, *rest):
    inter = gate.shape[1]
    *_, da_dtype, dbg_dtype, dbu_dtype, _row_max, _gate_factors, _up_factors, columns = rest
    return (
        gate.new_empty(p_down.shape[1], inter, dtype=da_dtype),
        gate.new_empty(inter, z_gate.shape[1], dtype=dbg_dtype),
        gate.new_empty(inter, z_up.shape[1], dtype=dbu_dtype),
        gate.new_empty(2 if columns.dim() == 2 else 0, inter, dtype=torch.float32),
    )


def gated_mlp_forward(
    gate: torch.Tensor,
    up: torch.Tensor,
    gate_term: LowRank,
    up_term: LowRank,
    down_a: torch.Tensor,
    activation: str,
    per_split: int = SPLIT_COLUMNS,
    row_max: torch.Tensor | None = None,
    columns: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = act(G₀ + gate_term) ⊙ (U₀ + up_term)`` without storing the sums, and ``h A_dᵀ`` from the same
    tiles (no autograd; the MLP op has it). With ``columns`` (DoRA) the sums are first scaled and shifted per
    column: ``h = act(f_g ⊙ (G₀ + gate_term) + b_g) ⊙ (f_u ⊙ (U₀ + up_term) + b_u)``.

    Args:
        gate: (T, I) contiguous base gate output ``G₀`` (``x W_gᵀ + b_g``).
        up: (T, I) contiguous base up output ``U₀``.
        gate_term: the gate's LoRA term ``s_g Z_g B_gᵀ`` as ``LowRank(Z_g, B_gᵀ, s_g)``.
        up_term: the up projection's LoRA term.
        down_a: the down projection's (r_d, I) ``A_d``, any strides and floating dtype.
        activation: "silu", "gelu" or "gelu_tanh".
        per_split: columns per program (a multiple of every column block); the splits' partial ``h A_dᵀ``
            are added afterwards.
        row_max: a (T,) FP32 tensor of zeros, or ``None``; given, it ends up holding each row's ``max |h|`` (of
            ``h`` as stored), the maxima the FP8 quantization of ``h`` needs
            (:func:`loralei.kernels.fp8_operands.quantize_rows`' ``amax``).
        columns: None, or (4, I) contiguous fp32 rows ``f_g, b_g, f_u, b_u`` (a member without DoRA: ones and
            its bias, with its ``G₀`` then computed without the bias).

    Returns:
        (T, I) ``h`` and (T, r_d) ``h A_dᵀ`` (the products of ``h`` as stored, accumulated in fp32), both in
        ``gate``'s dtype.
    """
    _check_layout({"gate": gate, "up": up}, {"gate_term": gate_term, "up_term": up_term})
    if down_a.shape[1] != gate.shape[1]:
        raise ValueError(f"down_a is {tuple(down_a.shape)}, expected (rank, I) with I = {gate.shape[1]}")
    _check_row_max(row_max, gate)
    op = _forward_impl if eager_call() else _forward_op
    return op(gate, up, *gate_term, *up_term, down_a, activation, per_split, row_max, _columns(gate, columns))


def gated_mlp_backward_(
    dh: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    dh_term: LowRank,
    gate_term: LowRank,
    up_term: LowRank,
    activation: str,
    dtypes: tuple[torch.dtype, torch.dtype, torch.dtype],
    splits: int | None = None,
    row_max: RowMaxima | None = None,
    columns: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """Writes ``dG`` over ``gate`` and ``dU`` over ``up``; returns ``(s_d P_dᵀ h, s_g dGᵀ Z_g, s_u dUᵀ Z_u)``.

    With ``columns`` (as in :func:`gated_mlp_forward`) the values written are the gradients of the unscaled sums,
    ``f_g ⊙ dG`` and ``f_u ⊙ dU``, the products are taken from them, and a fourth result (2, I) fp32 holds the
    column dots ``Σ_t dG ⊙ (G₀ + gate_term)`` and ``Σ_t dU ⊙ (U₀ + up_term)``.

    The full operands are ``G = G₀ + gate_term``, ``U = U₀ + up_term``, ``dh = dh₀ + dh_term`` (as in
    :func:`gated_mlp_forward`), formed tile by tile; ``P_d``, ``Z_g``, ``Z_u`` are the terms' ``z``.

    Args:
        dh: (T, I) contiguous base gradient ``dh₀ = dY W_d``.
        gate: (T, I) contiguous ``G₀``; destroyed (holds dG afterwards); :func:`usable` must hold.
        up: (T, I) contiguous ``U₀``; destroyed (holds dU afterwards).
        dh_term: the down projection's LoRA input-gradient ``LowRank(P_d = dY B_d, A_d, s_d)``.
        gate_term: ``LowRank(Z_g = (x⊙m_g) A_gᵀ, B_gᵀ, s_g)``, as in the forward.
        up_term: ``LowRank(Z_u, B_uᵀ, s_u)``.
        activation: "silu", "gelu" or "gelu_tanh".
        dtypes: the three results' dtypes (``A_d``'s, ``B_g``'s and ``B_u``'s: they are those gradients).
        splits: programs sharing one column's reduction over T (default: about one per 512 rows, at most 16).
        row_max: where to take each row's ``max(|dG · c_g|, |dU · c_u|)`` (dG, dU as stored: with ``columns``,
            ``f_g ⊙ dG`` and ``f_u ⊙ dU``), the maxima the FP8 quantization of ``[dG dU]`` with those column
            factors needs, or ``None``.
        columns: None, or the forward's (4, I) per-column factors and biases.

    Returns:
        ``(r_d, I)``, ``(I, r_g)``, ``(I, r_u)`` products (summed in fp32, scaled, rounded once to ``dtypes``),
        and with ``columns`` the (2, I) column dots.
    """
    terms = {"dh_term": dh_term, "gate_term": gate_term, "up_term": up_term}
    _check_layout({"dh": dh, "gate": gate, "up": up}, terms)
    splits = splits or default_splits(gate.shape[0], 512)
    maxima = (None, None, None) if row_max is None else row_max
    if row_max is not None:
        _check_row_max(row_max.out, gate)
        for factors in (row_max.gate_factors, row_max.up_factors):
            if factors.shape != (gate.shape[1],) or factors.dtype != torch.float32 or factors.stride(0) != 1:
                raise ValueError(
                    f"row_max factors must be contiguous ({gate.shape[1]},) float32, got {tuple(factors.shape)} "
                    f"{factors.dtype} with strides {factors.stride()}"
                )
    op = _backward_impl if eager_call() else _backward_op
    outs = op(
        dh,
        gate,
        up,
        *dh_term,
        *gate_term,
        *up_term,
        activation,
        splits,
        *dtypes,
        *maxima,
        _columns(gate, columns),
    )
    return tuple(outs) if columns is not None else tuple(outs[:3])


def _columns(gate: torch.Tensor, columns: torch.Tensor | None) -> torch.Tensor:
    """The kernels' per-column rows: ``columns`` checked, or a one-element placeholder (no scaling; a pointer
    argument must point somewhere)."""
    if columns is None:
        return gate.new_empty(1, dtype=torch.float32)
    if columns.shape != (4, gate.shape[1]) or columns.dtype != torch.float32 or not columns.is_contiguous():
        raise ValueError(f"columns must be contiguous fp32 (4, {gate.shape[1]}), got {tuple(columns.shape)}")
    return columns
