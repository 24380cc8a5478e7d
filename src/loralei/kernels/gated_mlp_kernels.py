r"""The gated MLP's elementwise passes as two Triton kernels that also carry its rank-r LoRA work (shapes and
terms as in :mod:`loralei.kernels.gated_mlp`, which calls them through :mod:`loralei.kernels.gated_mlp_launch`).

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
forward's columns among ``I / per_split`` programs per row block (:mod:`loralei.kernels.gated_mlp_launch`);
their fp32 partial sums are added afterwards (deterministic, no atomics), scaled and rounded to the gradients'
dtypes in the same small launches (:mod:`loralei.kernels.partial_sums`). Ranks are padded to ``R`` (a power of
two ≥ 16, ``tl.dot``'s minimum) by masked loads. Products use the compute dtype's values (``h``, ``dG``, ``dU``
rounded as stored; the ``M`` factors cast to it) with fp32 accumulation, like the GEMMs they replace; ``G``,
``U``, ``dh`` stay in fp32 between the dot and the activation.

Row maxima (for an FP8 quantization of ``h`` or of ``[dG·c_g dU·c_u]`` per row, which then need not read the
rows twice): asked for, each program reduces its tile's ``|h|`` (or ``max(|dG·c_g|, |dU·c_u|)``, the values as
stored times the FP32 column factors) over its columns. The forward, whose program covers a split of ~1024
columns, raises the row's entry of a zeroed (T,) FP32 tensor with an atomic maximum (exact, so the order of the
programs does not matter; 14 a row at 8B). The backward, whose program covers one column block and whose
concurrent programs are the column blocks of the same rows, stores its block's maxima into its own row of a
(column blocks, T) FP32 tensor instead, reduced afterwards: atomics there would be ~224 a row, all at once on
the same addresses (an H200's profiled 8B step: that kernel 13.2 -> 23.0 ms with them). With DoRA's scaling
below, the maxima are of the values as stored too: ``h`` of the scaled sums, and ``f_g ⊙ dG``, ``f_u ⊙ dU``.

DoRA (``columns``, constexpr ``SCALED``): per-column fp32 factors ``f`` and biases ``b`` for gate and up, applied
as ``G = f_g ⊙ (G₀ + s_g Z_g M_g) + b_g`` (likewise U) in both kernels; the backward then writes ``f_g ⊙ dG`` and
``f_u ⊙ dU`` (the gradients of the unscaled sums; dB_g and dB_u are taken from them) and sums ``dG ⊙ (G₀ + s_g
Z_g M_g)`` and ``dU ⊙ (U₀ + s_u Z_u M_u)`` per column into fp32 partials (the magnitudes' gradients up to the
norms), from the tiles already in registers. Compiled for sm_90 (ptxas, no GPU run yet), the scaled backward
takes about 250 registers a thread at 16×64 / 4 warps against 161 without (the per-column vectors' broadcasts;
the dots alone add about 15), so fewer programs share an SM; the forward stays at its cap either way.
"""

from __future__ import annotations

# act_and_slope: a jit helper the kernels call (build_kernel swaps in its plain function for the interpreter)
from .activations import act_and_slope, add_combine, jit_helper, tl
from .cross_entropy import max_combine


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
    with ``ROW_MAX`` also stores the block's ``max(|dG·c_g|, |dU·c_u|)`` of each row t (dG, dU as stored, with
    ``SCALED`` thus ``f_g ⊙ dG`` and ``f_u ⊙ dU``, times the FP32 column factors ``cg_ptr``, ``cu_ptr``) at
    ``rowmax_ptr[pid(0) · n_tokens + t]``.

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
            block_max = rowmax_ptr + tl.program_id(0).to(tl.int64) * n_tokens + rows
            tl.store(block_max, tl.reduce(top, 1, max_combine), mask=rows < t_end)
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
