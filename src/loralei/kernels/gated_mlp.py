r"""Backward of the gated activation fused with the gated MLP's rank-r reductions (fewer T×I passes).

Shapes: T tokens, I intermediate features, rank r (per projection); ``G``, ``U`` the gate/up outputs (T×I),
``h = act(G) ⊙ U``, ``dh`` its gradient, ``P_d = dY B_d`` (T×r), ``Z_g``/``Z_u`` the forward's ``(x⊙m) Aᵀ`` (T×r).
Unfused, the MLP backward (:mod:`loralei.ops.lora_mlp`) runs the elementwise backward (reads dh, G, U; writes h,
dG, dU), then GEMMs that read ``h`` again (``dA_d = s_d P_dᵀ h``) and ``dG``/``dU`` again (``dB_g = s_g dGᵀ Z_g``,
``dB_u = s_u dUᵀ Z_u``). Here one program per block of columns loops over the rows and takes those three
products from the tiles while they are in registers: it writes ``dG = dh ⊙ U ⊙ act'(G)`` over ``G`` and
``dU = dh ⊙ act(G)`` over ``U`` and never stores ``h``. Per T×I element that is 3 reads and 2 writes instead of
3 reads, 3 writes and 3 more reads.

The rows are split among ``splits`` programs per column block so the grid fills the GPU; their fp32 partial
sums are added afterwards (deterministic, no atomics). Ranks are padded to ``R`` (a power of two ≥ 16,
``tl.dot``'s minimum) by masked loads. Products use the compute dtype's values (``h``, ``dG``, ``dU`` rounded as
stored) with fp32 accumulation, like the GEMMs they replace.

Launch only where :func:`usable` says so; the caller keeps the unfused path for the rest.
"""

from __future__ import annotations

import functools

import torch

# act_and_slope: a global the kernel calls (build_kernel replaces it for the interpreter)
from .activations import (
    ACTIVATIONS,
    act_and_slope,
    build_kernel,
    eager_call,
    interpret_requested,
    tl,
    triton,
    triton_usable,
)

MAX_RANK = 64  # larger ranks would spill the (R × block) accumulators out of registers
# (rows, columns, warps, stages) per program, tried once per (n_inter, R) by triton.autotune on the GPU
# (on an H200, 32×64 with 4 warps and 3 stages won at both benchmark shapes; the others stay as candidates)
_CONFIGS = [(32, 64, 4, 3), (32, 64, 4, 4), (64, 64, 4, 3), (32, 128, 4, 3), (16, 64, 2, 3)]
_INTERPRETER_BLOCKS = (16, 32)  # (rows, columns) per program in the interpreter: small and still tl.dot-sized


def _gated_mlp_backward_kernel(
    dh_ptr, g_ptr, u_ptr, pd_ptr, zg_ptr, zu_ptr, da_ptr, dbg_ptr, dbu_ptr,
    n_tokens, n_inter, RD, RG, RU, stride_pd, stride_zg, stride_zu,
    ACT: tl.constexpr, R: tl.constexpr, BT: tl.constexpr, BI: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """Columns ``pid(0)``, row split ``pid(1)``: writes dG, dU over G, U and the split's partial dA_d, dB_g, dB_u."""
    split, n_split = tl.program_id(1), tl.num_programs(1)
    per_split = ((n_tokens + n_split - 1) // n_split + BT - 1) // BT * BT  # no tl.cdiv: see build_kernel
    t_begin = split * per_split
    t_end = tl.minimum(n_tokens, t_begin + per_split)
    cols = tl.program_id(0) * BI + tl.arange(0, BI)
    col_ok = cols < n_inter
    rk = tl.arange(0, R)
    acc_da = tl.full((R, BI), 0.0, tl.float32)
    acc_dbg = tl.full((BI, R), 0.0, tl.float32)
    acc_dbu = tl.full((BI, R), 0.0, tl.float32)
    for t0 in range(t_begin, t_end, BT):
        rows = t0 + tl.arange(0, BT)
        row_ok = rows < t_end
        ok = row_ok[:, None] & col_ok[None, :]
        offs = rows.to(tl.int64)[:, None] * n_inter + cols[None, :]
        g = tl.load(g_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        dh = tl.load(dh_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        act, slope = act_and_slope(g, ACT)
        dg = (dh * u * slope).to(g_ptr.dtype.element_ty)
        du = (dh * act).to(u_ptr.dtype.element_ty)
        h = (act * u).to(g_ptr.dtype.element_ty)
        tl.store(g_ptr + offs, dg, mask=ok)  # each program reads its tiles before writing them
        tl.store(u_ptr + offs, du, mask=ok)
        r64 = rows.to(tl.int64)[:, None]
        pd = tl.load(
            pd_ptr + r64 * stride_pd + rk[None, :], mask=row_ok[:, None] & (rk < RD)[None, :], other=0.0
        )
        zg = tl.load(
            zg_ptr + r64 * stride_zg + rk[None, :], mask=row_ok[:, None] & (rk < RG)[None, :], other=0.0
        )
        zu = tl.load(
            zu_ptr + r64 * stride_zu + rk[None, :], mask=row_ok[:, None] & (rk < RU)[None, :], other=0.0
        )
        acc_da = tl.dot(tl.trans(pd), h, acc_da, input_precision=PRECISION)
        acc_dbg = tl.dot(tl.trans(dg), zg, acc_dbg, input_precision=PRECISION)
        acc_dbu = tl.dot(tl.trans(du), zu, acc_dbu, input_precision=PRECISION)
    base = split.to(tl.int64) * R * n_inter
    tl.store(da_ptr + base + rk[:, None] * n_inter + cols[None, :], acc_da, mask=col_ok[None, :])
    tl.store(dbg_ptr + base + cols[:, None] * R + rk[None, :], acc_dbg, mask=col_ok[:, None])
    tl.store(dbu_ptr + base + cols[:, None] * R + rk[None, :], acc_dbu, mask=col_ok[:, None])


def _autotuned(kernel):
    """``triton.autotune`` over :data:`_CONFIGS`, keyed by n_inter and R; G and U (written in place) restored per trial."""
    return triton.autotune(
        [triton.Config({"BT": bt, "BI": bi}, num_warps=w, num_stages=s) for bt, bi, w, s in _CONFIGS],
        key=["n_inter", "R"],
        restore_value=["g_ptr", "u_ptr"],
    )(kernel)


@functools.cache
def _kernel(interpret: bool):
    """The kernel for the GPU (autotuned) or the interpreter, built once per mode."""
    return build_kernel(_gated_mlp_backward_kernel, interpret, _autotuned)


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


def _launch_args(interpret: bool, dtype: torch.dtype) -> dict:
    """Constexprs besides the autotuned ones: fp32 products in full fp32 (not TF32); fixed blocks in the interpreter."""
    args = {"PRECISION": "ieee" if dtype == torch.float32 else "tf32"}
    if interpret:
        args["BT"], args["BI"] = _INTERPRETER_BLOCKS
    return args


def _check_layout(full: dict[str, torch.Tensor], narrow: dict[str, torch.Tensor]) -> None:
    """The kernels index ``full`` tensors as contiguous rows and ``narrow`` (r-wide) ones by row stride only."""
    for name, t in full.items():
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous (strides {t.stride()}); call .contiguous() first")
    for name, t in narrow.items():
        if t.stride(1) != 1:
            raise ValueError(
                f"{name} must have contiguous columns (strides {t.stride()}); call .contiguous() first"
            )


def default_splits(length: int, chunk: int) -> int:
    """How many programs share one reduction of ``length``: about one per ``chunk``, between 1 and 16."""
    return max(1, min(16, length // chunk))


def _backward_impl(
    dh: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    p_down: torch.Tensor,
    z_gate: torch.Tensor,
    z_up: torch.Tensor,
    activation: str,
    splits: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    tokens, inter = gate.shape
    r_d, r_g, r_u = p_down.shape[1], z_gate.shape[1], z_up.shape[1]
    rank = _padded_rank(r_d, r_g, r_u)
    parts = torch.empty(3, splits, inter * rank, device=gate.device, dtype=torch.float32)
    interpret = interpret_requested()

    def grid(meta: dict) -> tuple[int, int]:
        return (triton.cdiv(inter, meta["BI"]), splits)

    _kernel(interpret)[grid](
        dh, gate, up, p_down, z_gate, z_up, parts[0], parts[1], parts[2],
        tokens, inter, r_d, r_g, r_u, p_down.stride(0), z_gate.stride(0), z_up.stride(0),
        ACT=ACTIVATIONS[activation], R=rank, **_launch_args(interpret, gate.dtype),
    )  # fmt: skip
    torch.autograd.graph.increment_version([gate, up])  # written through raw pointers
    # each output from its own sum: custom-op outputs may not alias one another
    return (
        parts[0].sum(0).view(rank, inter)[:r_d],
        parts[1].sum(0).view(inter, rank)[:, :r_g].contiguous(),
        parts[2].sum(0).view(inter, rank)[:, :r_u].contiguous(),
    )


# A custom op hides the launch from torch.compile (Dynamo would otherwise trace into the launcher).
_backward_op = torch.library.custom_op("loralei::gated_mlp_bwd_", _backward_impl, mutates_args=("gate", "up"))


@_backward_op.register_fake
def _(dh, gate, up, p_down, z_gate, z_up, activation, splits):
    inter = gate.shape[1]
    f32 = torch.float32
    return (
        gate.new_empty(p_down.shape[1], inter, dtype=f32),
        gate.new_empty(inter, z_gate.shape[1], dtype=f32),
        gate.new_empty(inter, z_up.shape[1], dtype=f32),
    )


def gated_mlp_backward_(
    dh: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    p_down: torch.Tensor,
    z_gate: torch.Tensor,
    z_up: torch.Tensor,
    activation: str,
    splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Writes ``dG`` over ``gate`` and ``dU`` over ``up``; returns the unscaled ``(P_dᵀ h, dGᵀ Z_g, dUᵀ Z_u)``.

    Args:
        dh: (T, I) contiguous gradient w.r.t. ``h``.
        gate: (T, I) contiguous gate output; destroyed (holds dG afterwards); :func:`usable` must hold.
        up: (T, I) contiguous up output; destroyed (holds dU afterwards).
        p_down: (T, r_d) ``dY B_d``; rows may be strided, columns contiguous (as for the ``z``'s).
        z_gate: (T, r_g) ``(x⊙m_g) A_gᵀ`` from the forward.
        z_up: (T, r_u) ``(x⊙m_u) A_uᵀ``.
        activation: "silu", "gelu" or "gelu_tanh".
        splits: programs sharing one column's reduction over T (default: about one per 512 rows, at most 16).

    Returns:
        fp32 ``(r_d, I)``, ``(I, r_g)``, ``(I, r_u)`` products, to be scaled by ``s_d``, ``s_g``, ``s_u``.
    """
    _check_layout({"dh": dh, "gate": gate, "up": up}, {"p_down": p_down, "z_gate": z_gate, "z_up": z_up})
    splits = splits or default_splits(gate.shape[0], 512)
    op = _backward_impl if eager_call() else _backward_op
    return op(dh, gate, up, p_down, z_gate, z_up, activation, splits)
