r"""RMSNorm as two Triton kernels: ``y = x̂ · (offset + w)`` with ``x̂ = x · r``, ``r = (mean(x²) + ε)^-½``.

The forms Transformers' RMSNorm classes compute (``NormForm``): the weight either multiplies ``x̂`` after it is
rounded to the input dtype (Llama, Qwen, Mistral, Phi-3: ``w · x̂.to(dtype)``) or multiplies it in fp32 before
the one rounding (Gemma's ``(1 + w)``, OLMo 2); the offset is 0 or 1.

Forward, one program per block of rows (a row whole in registers): writes ``y`` and the fp32 ``r`` per row, which
with ``x`` is all the backward keeps. Backward, the same tiling: ``g = dy · (offset + w)``,
``dx = r · (g - x̂ · mean(g · x̂))`` and, only when the weight trains, each program's fp32 partial of
``dw = Σ_rows dy · x̂`` (``x̂`` rounded as the forward rounded it), summed afterwards (deterministic, no atomics).
In LoRA training the norms are frozen, so the usual backward reads ``x`` and ``dy`` and writes ``dx``: no
reduction over the rows at all. Math in fp32; ``x̂`` is recomputed from ``x`` and ``r``.

Residual adds (:func:`residual_rms_norm`): in a pre-norm decoder layer the norm's input is the residual stream,
``h = residual + branch``, which the forward can form as it loads (writing ``h``, rounded as torch's add rounds
it, beside ``y``), and whose gradient is the norm's ``dx`` plus the gradient that reaches ``h`` along the
residual path, which the backward can add before its store. Each saves a separate elementwise pass over the
(tokens × hidden) stream; the results are the same bits as the add and the norm apart.

FP8 codes (``quantize``): where the norm's output is the input of projections whose FP8 GEMMs quantize it per row
(an FP8 base's q/k/v or gate/up), the forward also rounds each row of ``y``, as stored and still in registers, to
e4m3 codes with its scale (:mod:`.fp8_operands`' recipe and helpers, the same bits) and offers them to those
products (:func:`.fp8_operands.offer_codes`), which then do not read ``y`` again to quantize it. Likewise the
backward, given ``grad_factors`` (the row scales of the projection whose output is the residual ``branch``, the
attention's output projection), makes the codes of ``dx·c`` for that projection's input-gradient product.

Where Triton cannot run, :func:`rms_norm` computes the same form in torch (:func:`rms_norm_reference`).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from . import fp8_operands
from .activations import (
    add_combine,
    build_kernel,
    eager_call,
    interpret_requested,
    jit_helper,
    launch_autotuned,
    tl,
    triton,
    triton_usable,
)
from .cross_entropy import max_combine
from .fp8_operands import rounded_codes, scale_and_inverse

# rows per program = max(1, _TILE // next_pow2(n_cols)) · ROWS, tried once per width by triton.autotune on the GPU
_TILE = 2048
_CONFIGS = [(1, 4), (2, 4), (1, 8), (2, 8), (4, 8)]  # (ROWS, warps)
MAX_COLS = 16384  # a row lives in registers: wider rows take the torch path


class NormForm(NamedTuple):
    """How an RMSNorm class applies its weight: ``offset + w``, rounding ``x̂`` to the input dtype first or not."""

    offset: float
    cast_first: bool


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, form: NormForm) -> torch.Tensor:
    """The form in torch, as Transformers writes it (the probe's candidates and the fallback)."""
    xf = x.float()
    xhat = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if form.cast_first:
        return (weight + form.offset if form.offset else weight) * xhat.to(x.dtype)
    return (xhat * (weight.float() + form.offset)).to(x.dtype)


@jit_helper
def _row_block(n_rows, n_cols, BM: tl.constexpr, BN: tl.constexpr):
    """This program's ``BM`` whole rows: row and column indices, their masks, the tile's mask and offsets."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.arange(0, BN)
    row_ok, col_ok = rows < n_rows, cols < n_cols
    return (
        rows,
        cols,
        row_ok,
        col_ok,
        row_ok[:, None] & col_ok[None, :],
        rows.to(tl.int64)[:, None] * n_cols + cols[None, :],
    )


def _forward_kernel(
    x_ptr, b_ptr, h_ptr, w_ptr, y_ptr, r_ptr, codes_ptr, scales_ptr, n_rows, n_cols, eps, offset,
    CAST_FIRST: tl.constexpr, ADD: tl.constexpr, QUANTIZE: tl.constexpr,
    BN: tl.constexpr, BM0: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip
    """``y`` and ``r`` of ``x`` (``ADD``: of ``h = x + b``, rounded to the input dtype and written to ``h``);
    ``QUANTIZE``: also ``y``'s per-row e4m3 codes and FP32 scales."""
    rows, cols, row_ok, col_ok, ok, offs = _row_block(n_rows, n_cols, BM0 * ROWS, BN)
    x = tl.load(x_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    if ADD:
        h = (x + tl.load(b_ptr + offs, mask=ok, other=0.0).to(tl.float32)).to(h_ptr.dtype.element_ty)
        tl.store(h_ptr + offs, h, mask=ok)
        x = h.to(tl.float32)
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32) + offset
    r = 1.0 / tl.sqrt(tl.reduce(x * x, 1, add_combine) / n_cols + eps)
    xhat = x * r[:, None]
    if CAST_FIRST:
        xhat = xhat.to(x_ptr.dtype.element_ty).to(tl.float32)
    y = (xhat * w[None, :]).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + offs, y, mask=ok)
    tl.store(r_ptr + rows, r, mask=row_ok)
    if QUANTIZE:  # y as stored (zero outside the tile), one scale per row
        v = y.to(tl.float32)
        scale, inverse = scale_and_inverse(tl.reduce(tl.abs(v), 1, max_combine))
        codes = rounded_codes(v, inverse[:, None])
        tl.store(codes_ptr + offs, codes.to(codes_ptr.dtype.element_ty), mask=ok)
        tl.store(scales_ptr + rows, scale, mask=row_ok)


def _backward_kernel(
    dy_ptr, x_ptr, w_ptr, r_ptr, dh_ptr, dx_ptr, dw_ptr, f_ptr, codes_ptr, scales_ptr, n_rows, n_cols, offset,
    CAST_FIRST: tl.constexpr, W_GRAD: tl.constexpr, ADD: tl.constexpr, QUANTIZE: tl.constexpr,
    BN: tl.constexpr, BM0: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip
    """``dx`` (``ADD``: ``dx + dh``, each rounded as torch rounds the two ops) and the ``dw`` partials;
    ``QUANTIZE``: also the per-row e4m3 codes and FP32 scales of ``dx`` times the column factors ``f``."""
    rows, cols, row_ok, col_ok, ok, offs = _row_block(n_rows, n_cols, BM0 * ROWS, BN)
    x = tl.load(x_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    r = tl.load(r_ptr + rows, mask=row_ok, other=0.0)
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32) + offset
    xhat = x * r[:, None]
    g = dy * w[None, :]
    mean = tl.reduce(g * xhat, 1, add_combine) / n_cols
    dx = (r[:, None] * (g - xhat * mean[:, None])).to(dx_ptr.dtype.element_ty)
    if ADD:
        dh = tl.load(dh_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        dx = (dx.to(tl.float32) + dh).to(dx_ptr.dtype.element_ty)
    tl.store(dx_ptr + offs, dx, mask=ok)
    if QUANTIZE:  # dx as stored (zero outside the tile) times the factors, one scale per row
        v = dx.to(tl.float32) * tl.load(f_ptr + cols, mask=col_ok, other=0.0)[None, :]
        scale, inverse = scale_and_inverse(tl.reduce(tl.abs(v), 1, max_combine))
        tl.store(codes_ptr + offs, rounded_codes(v, inverse[:, None]).to(codes_ptr.dtype.element_ty), mask=ok)
        tl.store(scales_ptr + rows, scale, mask=row_ok)
    if W_GRAD:
        if CAST_FIRST:
            xhat = xhat.to(x_ptr.dtype.element_ty).to(tl.float32)
        tl.store(
            dw_ptr + tl.program_id(0).to(tl.int64) * n_cols + cols,
            tl.reduce(dy * xhat, 0, add_combine),
            mask=col_ok,
        )


@functools.cache
def _kernel(backward: bool, interpret: bool):
    fn = _backward_kernel if backward else _forward_kernel
    if interpret:
        return build_kernel(fn, True)
    configs = [triton.Config({"ROWS": rows}, num_warps=warps) for rows, warps in _CONFIGS]
    return build_kernel(fn, False, triton.autotune(configs, key=["n_cols"]))


def _blocks(n_cols: int) -> dict[str, int]:
    bn = triton.next_power_of_2(n_cols)
    return {"BN": bn, "BM0": max(1, _TILE // bn)}


_TUNED: dict[tuple, dict] = {}  # launch key -> the autotuner's choice, as launch keyword arguments


def _launch(backward: bool, n_rows: int, n_cols: int, args: tuple, **constexprs) -> int:
    """Runs a kernel over ``n_rows``; returns the number of programs (the dw partials' count). On the GPU the
    autotuner chooses the rows per program once per key (width, constexprs, dtypes; ``launch_autotuned``)."""
    blocks = _blocks(n_cols)
    if interpret_requested():
        programs = triton.cdiv(n_rows, blocks["BM0"])
        _kernel(backward, True)[(programs,)](*args, **constexprs, **blocks, ROWS=1)
        return programs
    key = (backward, n_cols, *constexprs.values(), *(a.dtype for a in args if isinstance(a, torch.Tensor)))

    def grid(meta: dict) -> tuple[int]:
        return (triton.cdiv(n_rows, meta["BM0"] * meta["ROWS"]),)

    config = launch_autotuned(_kernel(backward, False), _TUNED, key, grid, *args, **constexprs, **blocks)
    return grid(blocks | config)[0]


def usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the kernels run for this input and weight (Triton on their device and dtypes, a row in registers)."""
    return (
        triton_usable(x)
        and triton_usable(weight)
        and x.shape[-1] <= MAX_COLS
        and weight.shape == x.shape[-1:]
    )


def _forward_impl(
    x: torch.Tensor,
    branch: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    offset: float,
    cast_first: bool,
    quantize: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(y, r, h, codes, scales)`` for a contiguous ``x`` (and ``branch``): the norm of ``h = x + branch``, or of
    ``x`` when ``branch`` is None (then ``h`` is empty: a custom op's output may not be its input); with
    ``quantize`` the per-row e4m3 codes of ``y`` (rows padded with zero codes to the rows FP8 GEMMs take) and
    their (rows, 1) FP32 scales (1 for the padding), else two empty tensors."""
    n_cols = x.shape[-1]
    x2 = x.view(-1, n_cols)
    n_rows = x2.shape[0]
    dtype = torch.promote_types(x.dtype, weight.dtype) if cast_first else x.dtype
    y = torch.empty(x2.shape, dtype=dtype, device=x.device)
    r = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    h = x.new_empty(0) if branch is None else torch.empty_like(x)
    codes, scales = _codes_for(n_rows if quantize else 0, n_cols, x.device)
    if n_rows:
        b2, h2 = (x2, x2) if branch is None else (branch.view(-1, n_cols), h.view(-1, n_cols))
        args = (x2, b2, h2, weight, y, r, codes if quantize else y, scales if quantize else r, n_rows, n_cols)
        constexprs = {"CAST_FIRST": cast_first, "ADD": branch is not None, "QUANTIZE": quantize}
        _launch(False, n_rows, n_cols, (*args, eps, offset), **constexprs)
    return y.view(x.shape), r, h, codes, scales


def _codes_for(n_rows: int, n_cols: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The codes and scales of ``n_rows`` rows (none: empty), the padding rows already zero codes and scale 1."""
    rows = fp8_operands.padded(n_rows)
    codes = torch.empty(rows, n_cols if n_rows else 0, dtype=fp8_operands.E4M3, device=device)
    scales = torch.empty(rows, 1, dtype=torch.float32, device=device)
    if rows > n_rows:
        codes[n_rows:].view(torch.uint8).zero_()  # fills of float8 tensors are not on every backend
        scales[n_rows:] = 1.0
    return codes, scales


def _backward_impl(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, r: torch.Tensor, offset: float, cast_first: bool,
    weight_grad: bool, grad_factors: torch.Tensor | None, dh: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(dx, dw, codes, scales)``, ``dh`` (the gradient along the residual path, if any) added to ``dx``; ``dw``
    is empty unless ``weight_grad``; with ``grad_factors`` ((N,) FP32) the per-row e4m3 codes of ``dx`` times
    them and their scales (as the forward's ``quantize``), else two empty tensors."""
    n_cols = x.shape[-1]
    x2, dy2 = x.view(-1, n_cols), dy.reshape(-1, n_cols).contiguous()
    dh2 = dy2 if dh is None else dh.reshape(-1, n_cols).contiguous()
    n_rows = x2.shape[0]
    dx = torch.empty_like(x2)
    # at most one fp32 partial per program (the smallest row block), written only with weight_grad
    most = triton.cdiv(n_rows, _blocks(n_cols)["BM0"]) if weight_grad else 0
    parts = torch.empty(most, n_cols, dtype=torch.float32, device=x.device)
    quantize = grad_factors is not None
    codes, scales = _codes_for(n_rows if quantize else 0, n_cols, x.device)
    programs = 0
    if n_rows:
        coded = (grad_factors, codes, scales) if quantize else (r, dx, r)
        args = (dy2, x2, weight, r, dh2, dx, parts if weight_grad else dx, *coded, n_rows, n_cols, offset)
        constexprs = {
            "CAST_FIRST": cast_first,
            "W_GRAD": weight_grad,
            "ADD": dh is not None,
            "QUANTIZE": quantize,
        }
        programs = _launch(True, n_rows, n_cols, args, **constexprs)
    dw = parts[:programs].sum(0).to(weight.dtype) if weight_grad else weight.new_empty(0)
    return dx.view(x.shape), dw, codes, scales


# Custom ops hide the launches from torch.compile (Dynamo would otherwise trace into the launchers).
_forward_op = torch.library.custom_op("loralei::rms_norm_fwd", _forward_impl, mutates_args=())
_backward_op = torch.library.custom_op("loralei::rms_norm_bwd", _backward_impl, mutates_args=())


@_forward_op.register_fake
def _(x, branch, weight, eps, offset, cast_first, quantize):
    dtype = torch.promote_types(x.dtype, weight.dtype) if cast_first else x.dtype
    h = x.new_empty(0) if branch is None else torch.empty_like(x)
    rows = x.numel() // x.shape[-1]
    codes_rows = fp8_operands.padded(rows if quantize else 0)
    return (
        x.new_empty(x.shape, dtype=dtype),
        x.new_empty(rows, dtype=torch.float32),
        h,
        x.new_empty(codes_rows, x.shape[-1] if quantize else 0, dtype=fp8_operands.E4M3),
        x.new_empty(codes_rows, 1, dtype=torch.float32),
    )


@_backward_op.register_fake
def _(dy, x, weight, r, offset, cast_first, weight_grad, grad_factors, dh):
    rows = fp8_operands.padded(x.numel() // x.shape[-1] if grad_factors is not None else 0)
    return (
        torch.empty_like(x),
        weight.new_empty(weight.shape if weight_grad else (0,)),
        x.new_empty(rows, x.shape[-1] if grad_factors is not None else 0, dtype=fp8_operands.E4M3),
        x.new_empty(rows, 1, dtype=torch.float32),
    )


class _RMSNorm(torch.autograd.Function):
    """``y = RMSNorm(h)`` with ``h = x + branch`` (``x`` when ``branch`` is None); returns ``y``, or ``(h, y)``
    with ``keep_h``, when ``h`` also goes on along the residual path (then its gradient joins ``dx`` in-kernel);
    with ``quantize``, ``y``'s FP8 codes are offered to its products (:func:`_offered`); with ``grad_factors``,
    the codes of ``dx`` times them (the input gradient's, for the projection whose output ``branch`` is)."""

    @staticmethod
    def forward(
        ctx, x, branch, weight, eps: float, offset: float, cast_first: bool, keep_h: bool, quantize: bool,
        grad_factors: torch.Tensor | None,
    ):  # fmt: skip
        x = x.contiguous()
        branch = None if branch is None else branch.contiguous()
        op = _forward_impl if eager_call() else _forward_op
        y, r, h = _offered(*op(x, branch, weight, eps, offset, cast_first, quantize), quantize)
        h = x if branch is None else h
        ctx.save_for_backward(h, weight, r)
        ctx.form, ctx.keep_h, ctx.added = (offset, cast_first), keep_h, branch is not None
        ctx.grad_factors = grad_factors  # a frozen weight's scales
        return (h, y) if keep_h else y

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        dh, dy = grads if ctx.keep_h else (None, grads[0])
        h, weight, r = ctx.saved_tensors
        weight_grad = ctx.needs_input_grad[2]
        op = _backward_impl if eager_call() else _backward_op
        dx, dw, codes, scales = op(dy, h, weight, r, *ctx.form, weight_grad, ctx.grad_factors, dh)
        if ctx.grad_factors is not None:
            fp8_operands.offer_codes(dx, codes, scales, [ctx.grad_factors])
        return dx, dx if ctx.added else None, dw if weight_grad else None, None, None, None, None, None, None


def _offered(
    y: torch.Tensor,
    r: torch.Tensor,
    h: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    quantize: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(y, r, h)`` of the forward's results, ``y``'s codes offered to its FP8 products when made."""
    if quantize:
        fp8_operands.offer_codes(y, codes, scales)
    return y, r, h


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, form: NormForm) -> torch.Tensor:
    """RMSNorm over the last dimension of ``x`` in ``form``, with autograd (the kernels, or torch where they
    cannot run).

    Args:
        x: (..., N) input.
        weight: (N,) weight; it gets a gradient only when it requires one.
        eps: the ε added to the mean square.
        form: the class's ``NormForm``.

    Returns:
        ``y`` like ``x``, in the dtype Transformers' class returns (``x``'s, or promoted with the weight's when
        the weight multiplies after the rounding).
    """
    if not usable(x, weight):
        return rms_norm_reference(x, weight, eps, form)
    if eager_call(x, weight):
        return _forward_impl(x.contiguous(), None, weight, eps, *form, False)[0]
    return _RMSNorm.apply(x, None, weight, eps, *form, False, False, None)


def residual_rms_norm(
    x: torch.Tensor,
    branch: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    form: NormForm,
    quantize: bool = False,
    grad_factors: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(h, RMSNorm(h))`` with ``h = x + branch`` (``x`` itself when ``branch`` is None), for a norm whose input
    also goes on along a residual path: the add happens as the kernel loads, and in the backward the gradient
    reaching ``h`` from that path is added to the norm's own ``dx`` before the store (the module docstring).

    Args:
        x: (..., N) residual stream.
        branch: what the layer adds to it (``x``'s shape and dtype), or None.
        weight, eps, form: as for :func:`rms_norm`.
        quantize: ``y`` feeds FP8 GEMMs that quantize it per row: the kernel also makes its codes and offers
            them (:func:`.fp8_operands.offer_codes`; not under ``torch.compile``, nor where the kernel does not
            run).
        grad_factors: ``branch`` is the output of a projection whose FP8 GEMMs quantize its output gradient per
            row times these (N,) FP32 factors (its row scales): the backward also makes those codes of ``dx``
            and offers them (not under ``torch.compile``).

    Returns:
        ``h`` and ``y``, the same values as ``x + branch`` and :func:`rms_norm` of it.
    """
    if torch.compiler.is_compiling():
        quantize, grad_factors = False, None
    fits = branch is None or (branch.shape == x.shape and branch.dtype == x.dtype and triton_usable(branch))
    if not (fits and usable(x, weight)):
        h = x if branch is None else x + branch
        return h, rms_norm(h, weight, eps, form)
    inputs = (x, weight) if branch is None else (x, branch, weight)
    if eager_call(*inputs):
        y, _, h = _offered(
            *_forward_impl(
                x.contiguous(),
                branch if branch is None else branch.contiguous(),
                weight,
                eps,
                *form,
                quantize,
            ),
            quantize,
        )
        return (x if branch is None else h), y
    return _RMSNorm.apply(x, branch, weight, eps, *form, True, quantize, grad_factors)
