r"""The gated MLP's elementwise passes with its rank-r LoRA work in two Triton kernels: the tensor-level API.

Shapes: T tokens, I intermediate features, rank r (per projection). ``G₀``, ``U₀`` are the base gate/up outputs
(T×I) and each LoRA term is a :class:`LowRank` ``s · Z M`` with ``Z`` (T×r) and ``M`` (r×I): the gate's
``s_g Z_g B_gᵀ``, the up projection's ``s_u Z_u B_uᵀ`` and, in the backward, the down projection's
input-gradient term ``s_d P_d A_d`` (``Z_p = (x⊙m_p) A_pᵀ`` from the forward, ``P_d = dY B_d``).

:func:`gated_mlp_forward` gives ``h = act(G₀ + s_g Z_g M_g) ⊙ (U₀ + s_u Z_u M_u)`` and ``h A_dᵀ``;
:func:`gated_mlp_backward_` writes ``dG``, ``dU`` over ``G₀``, ``U₀`` and returns the MLP's rank-r products. Each
checks its tensors, packs the kernels' arguments, launches them (:mod:`loralei.kernels.gated_mlp_launch`) and
adds the programs' fp32 partial sums; under torch.compile it runs as a torch.library custom op
(``loralei::gated_mlp_fwd``, ``loralei::gated_mlp_bwd_``). How the kernels work, DoRA's column factors and the
FP8 row maxima included: :mod:`loralei.kernels.gated_mlp_kernels`.

Launch only where :func:`usable` says so; the caller keeps the unfused path for the rest.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .activations import ACTIVATIONS, eager_call, interpret_requested, triton, triton_usable
from .gated_mlp_launch import (
    MAX_RANK,
    SPLIT_COLUMNS,
    default_splits,
    interpreter_runs_loops,
    launch,
    most_column_blocks,
)
from .partial_sums import Partials, sum_partials


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


class RowMaxima(NamedTuple):
    """Where the backward takes the rows' maxima of ``[dG · c_g  dU · c_u]`` (for its FP8 quantization)."""

    out: torch.Tensor  # (T,) FP32; overwritten with each row's maximum
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
    launch(False, grid, args, inter, ACT=ACTIVATIONS[activation], R=t.R, FULL=t.full, **constexprs)
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

    maxima = [parts] * 3
    if row_max is not None:  # (column blocks, T): reduced below over the blocks the launch had
        block_max = torch.empty(most_column_blocks(inter), tokens, device=gate.device, dtype=torch.float32)
        maxima = [gate_factors, up_factors, block_max]
    args = (
        dh, gate, up, *t.pointers, *parts, columns, dots, *maxima, tokens, inter, *t.ranks, *t.strides,
        *t.scales,
    )  # fmt: skip
    constexprs = {"ROW_MAX": row_max is not None, "SCALED": scaled}
    bi = launch(True, grid, args, inter, ACT=ACTIVATIONS[activation], R=rank, FULL=t.full, **constexprs)
    if row_max is not None:
        torch.amax(block_max[: triton.cdiv(inter, bi)], 0, out=row_max)
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
