r"""The operands of the FP8 GEMMs, made in Triton: activations quantized per row, weight codes transposed.

**Quantization.** For a (rows, cols) ``x``, optionally the column concatenation of up to three tensors (the
output gradients of a shared-input group, for one ``[dY_q dY_k dY_v] [W_q; W_k; W_v]`` product), each with an
optional FP32 column factor ``c`` (the weight's row scales, folded into ``dY`` for the input gradient), each row
``v = x[i] · c`` (in FP32) gets::

    scale_i = amax(|v|) / 448          (1 for an all-zero row)
    code_ij = e4m3(clamp(v_j · (1 / scale_i), ±448))     (round to nearest even)

the activation recipe of :func:`loralei.modules.quantized.fp8_gemm.quantize_rows` (``reciprocal=True``), bit for
bit: the two divisions per row are the correctly rounded ones (``div_rn``; plain ``/`` compiles to an approximate
division on NVIDIA GPUs), the elements are multiplied by the reciprocal (a division each costs twice the
kernel's time), and the
rounding to e4m3 is done in FP32 (:func:`round_e4m3`), so that the final conversion is exact on every backend
(Triton's interpreter truncates where the GPU rounds). The output has ``padded_rows >= rows`` rows: the extra
rows get zero codes and scale 1, the padding FP8 GEMMs need. One program per row: narrow rows stay in
registers between the maximum and the codes, wider ones are read twice, block by block (the second read
may come from L2); :func:`launch_for` picks the blocks and warps. No FP32 copy, absolute value or folded product
of a row is ever stored. Where the kernel that wrote the rows also took their maxima (``amax``: the gated MLP's
kernels do, for ``h`` and for ``[dG·c_g dU·c_u]``), the first read is skipped: each row is read once, for its
codes, from the same scale. Where the kernel that wrote the rows holds each row whole (loralei's RMSNorm), it
makes the codes itself with the helpers below (:func:`scale_and_inverse`, :func:`rounded_codes`) and offers them
(:func:`offer_codes`): the activation is not read again at all.

**Transposition.** ``dY W`` needs ``W``'s codes with the reduction dimension contiguous, the transpose of how
they are stored: :func:`transpose_into` writes the (out, in) codes into columns of an (in, ·) buffer, tile by
tile (torch's strided copy of one-byte elements runs at a tenth of the memory bandwidth).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Sequence
from typing import Generic, NamedTuple, TypeVar

import torch
from torch import Tensor

# tl: a kernel's annotations need it (activations supplies a stand-in where triton is missing)
from .activations import build_kernel, interpret_requested, jit_helper, tl, triton, triton_usable
from .cross_entropy import max_combine

E4M3 = torch.float8_e4m3fn


class Launch(NamedTuple):
    """How the quantization kernel walks a row."""

    one_pass: bool  # every segment in one block, kept in registers between the maximum and the codes
    block: int  # columns per step (a power of two; with one_pass, at least the widest segment)
    warps: int


def launch_for(widths: Sequence[int]) -> Launch:
    """The launch for rows made of segments this wide.

    From ``benchmarks/bench_fp8_quantize.py`` on an H200 (8192 rows; results 2026-12-01-h200-fp8-quantize.json),
    against the earlier fixed launch (two passes in blocks of 2048 by 4 warps past 2048 columns): a single
    segment up to 4096 wide stays in registers (8 warps; dY of o/down 46 us for 52); wider or several segments
    are read twice, in blocks of 1024 by 4 warps up to 4096 wide (q/k/v's 4096 + 1024 + 1024: 64 us for 81)
    and of 2048 by 8 warps beyond (gate/up's 2 x 14336: 280 us for 335). Every choice is within 4 % of the
    fastest launch measured for its case.
    """
    widest = max(widths)
    if widest <= 2048 or (len(widths) == 1 and widest <= 4096):
        block = max(16, 1 << (widest - 1).bit_length())
        return Launch(True, block, 8 if block > 2048 else 4)
    return Launch(False, 1024, 4) if widest <= 4096 else Launch(False, 2048, 8)


MAX_SEGMENTS = 3
ROW_ALIGN = 16  # FP8 GEMMs on the GPU take rows in multiples of this: the codes' rows are padded up to one
_TILE = 64  # transposition tiles are _TILE × _TILE bytes


@jit_helper
def round_e4m3(v):
    """FP32 ``v`` (|v| <= 448) rounded to the nearest e4m3 value, ties to even, still in FP32.

    Normal e4m3 values (|v| >= 2^-6) keep 3 of FP32's 23 mantissa bits: the 20 dropped bits are rounded off on
    the bit pattern (a carry moves into the exponent, as it should). Below 2^-6 the values are multiples of
    2^-9: ``|v|·512`` (exact) is rounded to an integer by adding and subtracting 2^23, the one FP32 rounding.
    """
    bits = v.to(tl.int32, bitcast=True)
    magnitude = bits & 0x7FFFFFFF
    normal = (magnitude + 0x7FFFF + ((magnitude >> 20) & 1)) & -0x100000
    small = ((tl.abs(v) * 512.0 + 8388608.0) - 8388608.0) * 0.001953125
    rounded = tl.where(magnitude >= 0x3C800000, normal.to(tl.float32, bitcast=True), small)  # 2^-6
    # v's sign bit on the rounded magnitude: a negative v that rounds to zero gives -0, as torch's cast does
    return (rounded.to(tl.int32, bitcast=True) | (bits & -0x80000000)).to(tl.float32, bitcast=True)


@jit_helper
def scale_and_inverse(top):
    """A row's scale ``amax / 448`` (1 for an all-zero row) and its reciprocal, both correctly rounded."""
    scale = tl.where(top > 0, tl.math.div_rn(top, 448.0), 1.0)
    return scale, tl.math.div_rn(1.0, scale)


@jit_helper
def rounded_codes(v, inverse):
    """The e4m3 values (still FP32) of the FP32 ``v`` times its row's ``inverse``: clamped to ±448, rounded."""
    return round_e4m3(tl.minimum(tl.maximum(v * inverse, -448.0), 448.0))


@jit_helper
def segment_values(x_row, f_ptr, offs, live_cols, HAS_FACTOR: tl.constexpr):
    """One block of a row segment in FP32, times its column factors; zeros past ``live_cols``."""
    ok = offs < live_cols
    v = tl.load(x_row + offs, mask=ok, other=0.0).to(tl.float32)
    if HAS_FACTOR:
        v = v * tl.load(f_ptr + offs, mask=ok, other=0.0)
    return v


@jit_helper
def segment_amax(
    amax, x_row, f_ptr, live_cols, HAS_FACTOR: tl.constexpr, STEPS: tl.constexpr, BLOCK: tl.constexpr
):
    for step in range(STEPS):
        v = segment_values(x_row, f_ptr, step * BLOCK + tl.arange(0, BLOCK), live_cols, HAS_FACTOR)
        amax = tl.maximum(amax, tl.abs(v))
    return amax


@jit_helper
def store_codes(codes_row, v, offs, cols, inverse):
    """The codes of the FP32 values ``v`` at ``offs`` of a row whose scale's reciprocal is ``inverse``."""
    tl.store(codes_row + offs, rounded_codes(v, inverse).to(codes_row.dtype.element_ty), mask=offs < cols)


@jit_helper
def segment_store(
    codes_row, x_row, f_ptr, cols, live_cols, inverse,
    HAS_FACTOR: tl.constexpr, STEPS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    for step in range(STEPS):
        offs = step * BLOCK + tl.arange(0, BLOCK)
        store_codes(codes_row, segment_values(x_row, f_ptr, offs, live_cols, HAS_FACTOR), offs, cols, inverse)


def _quantize_rows_kernel(
    x0, x1, x2, f0, f1, f2, cols0, cols1, cols2, stride0, stride1, stride2, codes_ptr, scales_ptr, amax_ptr, rows,
    SEGMENTS: tl.constexpr, HAS_FACTOR: tl.constexpr, ONE_PASS: tl.constexpr, GIVEN_AMAX: tl.constexpr,
    STEPS0: tl.constexpr, STEPS1: tl.constexpr, STEPS2: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    live = row < rows  # padding rows read nothing: zero codes, scale 1
    r64 = row.to(tl.int64)
    x0, x1, x2 = x0 + r64 * stride0, x1 + r64 * stride1, x2 + r64 * stride2
    live0, live1, live2 = tl.where(live, cols0, 0), tl.where(live, cols1, 0), tl.where(live, cols2, 0)
    codes0 = codes_ptr + r64 * (cols0 + cols1 + cols2)
    codes1 = codes0 + cols0
    codes2 = codes1 + cols1
    if GIVEN_AMAX:  # the producer of the row took its maximum: the row is read once, for the codes
        top = tl.load(amax_ptr + row, mask=live, other=0.0)
    elif ONE_PASS:  # every segment fits one block: its values stay in registers between the max and the codes
        offs = tl.arange(0, BLOCK)
        v0 = segment_values(x0, f0, offs, live0, HAS_FACTOR)
        amax = tl.abs(v0)
        if SEGMENTS > 1:
            v1 = segment_values(x1, f1, offs, live1, HAS_FACTOR)
            amax = tl.maximum(amax, tl.abs(v1))
        if SEGMENTS > 2:
            v2 = segment_values(x2, f2, offs, live2, HAS_FACTOR)
            amax = tl.maximum(amax, tl.abs(v2))
    else:  # wider rows: the maximum block by block, then the codes block by block (a second read)
        amax = segment_amax(tl.full([BLOCK], 0.0, tl.float32), x0, f0, live0, HAS_FACTOR, STEPS0, BLOCK)
        if SEGMENTS > 1:
            amax = segment_amax(amax, x1, f1, live1, HAS_FACTOR, STEPS1, BLOCK)
        if SEGMENTS > 2:
            amax = segment_amax(amax, x2, f2, live2, HAS_FACTOR, STEPS2, BLOCK)
    if not GIVEN_AMAX:
        top = tl.reduce(amax, 0, max_combine)
    scale, inverse = scale_and_inverse(top)
    if ONE_PASS and not GIVEN_AMAX:
        store_codes(codes0, v0, offs, cols0, inverse)
        if SEGMENTS > 1:
            store_codes(codes1, v1, offs, cols1, inverse)
        if SEGMENTS > 2:
            store_codes(codes2, v2, offs, cols2, inverse)
    else:
        segment_store(codes0, x0, f0, cols0, live0, inverse, HAS_FACTOR, STEPS0, BLOCK)
        if SEGMENTS > 1:
            segment_store(codes1, x1, f1, cols1, live1, inverse, HAS_FACTOR, STEPS1, BLOCK)
        if SEGMENTS > 2:
            segment_store(codes2, x2, f2, cols2, live2, inverse, HAS_FACTOR, STEPS2, BLOCK)
    tl.store(scales_ptr + row, scale)


def _transpose_kernel(src, dst, rows, cols, dst_stride, TILE: tl.constexpr):
    """``dst[j, i] = src[i, j]`` for the (rows, cols) ``src``, one TILE × TILE tile per program."""
    i = tl.program_id(0) * TILE + tl.arange(0, TILE)
    j = tl.program_id(1) * TILE + tl.arange(0, TILE)
    ok = (i[:, None] < rows) & (j[None, :] < cols)
    tile = tl.load(src + i[:, None].to(tl.int64) * cols + j[None, :], mask=ok)
    tl.store(dst + j[:, None].to(tl.int64) * dst_stride + i[None, :], tl.trans(tile), mask=tl.trans(ok))


@functools.cache
def _launchers(interpret: bool):
    """Both kernels compiled for the GPU or wrapped for the interpreter, built once per mode."""
    return build_kernel(_quantize_rows_kernel, interpret), build_kernel(_transpose_kernel, interpret)


def usable(x: Tensor) -> bool:
    """Whether the quantization kernel can read ``x`` (see :func:`loralei.kernels.activations.triton_usable`)."""
    return triton_usable(x)


def transposes_on(device: torch.device) -> bool:
    """Whether :func:`transpose_into` runs on ``device`` (it moves bytes, so any dtype)."""
    return triton is not None and (interpret_requested() or device.type == "cuda")


def quantize_rows(
    xs: Sequence[Tensor],
    padded_rows: int,
    factors: Sequence[Tensor] | None = None,
    launch: Launch | None = None,
    amax: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """e4m3 codes (padded_rows, Σcols) and FP32 scales (padded_rows, 1) of the column concatenation of ``xs``.

    Args:
        xs: 1 to 3 tensors (rows, cols_i) whose rows have unit stride, of one dtype (fp32, fp16 or bf16; see
            :func:`usable`) and device.
        padded_rows: rows of the output, at least ``xs``'s; the extra ones are zero codes with scale 1.
        factors: one (cols_i,) FP32 tensor per ``xs[i]``, multiplying its columns before quantizing, or ``None``.
        launch: how the kernel walks a row (default :func:`launch_for` the widths); the result is the same.
        amax: the (rows,) FP32 maxima ``max_j |v_ij|`` of the rows as quantized (factors applied), taken by the
            kernel that wrote ``xs``; the kernel then reads each row once, for its codes (same result).
    """
    rows = xs[0].shape[0]
    assert 1 <= len(xs) <= MAX_SEGMENTS and padded_rows >= rows
    assert all(x.shape[0] == rows and x.stride(1) == 1 for x in xs)
    widths = [x.shape[1] for x in xs]
    codes = torch.empty(padded_rows, sum(widths), dtype=E4M3, device=xs[0].device)
    scales = torch.empty(padded_rows, 1, dtype=torch.float32, device=xs[0].device)
    one_pass, block, warps = launch or launch_for(widths)
    assert not one_pass or block >= max(widths)
    assert amax is None or (amax.shape == (rows,) and amax.dtype == torch.float32)
    pad = MAX_SEGMENTS - len(xs)
    ptrs, fs = [*xs, *[xs[0]] * pad], [*(factors or xs), *[xs[0]] * pad]
    cols, strides = [*widths, *[0] * pad], [x.stride(0) for x in ptrs]
    steps = [-(-c // block) for c in cols]
    _launchers(interpret_requested())[0][(padded_rows,)](
        *ptrs, *fs, *cols, *strides, codes, scales, scales if amax is None else amax, rows,
        SEGMENTS=len(xs), HAS_FACTOR=factors is not None, ONE_PASS=one_pass, GIVEN_AMAX=amax is not None,
        STEPS0=steps[0], STEPS1=steps[1], STEPS2=steps[2], BLOCK=block, num_warps=warps,
    )  # fmt: skip
    return codes, scales


V = TypeVar("V")  # what an offer holds


class _Offer(Generic[V]):
    """What a producing kernel offered for the next use of some tensors (:func:`offer_row_maxima`,
    :func:`offer_codes`), matched by their memory: the same storage (a weak reference to it, alive exactly while
    the memory is: the tensor objects themselves may be gone where autograd hands a view of a gradient on; a new
    tensor at the same address has another storage), the same start and size, contiguous, not changed in place
    since (views share their base's version counter); and factors on the same memory."""

    def __init__(self) -> None:
        self.memory: tuple[tuple[weakref.ref, int, int, int], ...] = ()
        self.factors: tuple[tuple[int, int], ...] | None = None
        self.value: V | None = None

    def put(self, xs: Sequence[Tensor], factors: Sequence[Tensor] | None, value: V) -> None:
        """Offers ``value`` for contiguous ``xs`` (nothing is offered for others)."""
        if not all(x.is_contiguous() for x in xs):
            return
        self.memory = tuple(_memory(x) for x in xs)
        self.factors, self.value = _factor_keys(factors), value

    def take(self, xs: Sequence[Tensor], factors: Sequence[Tensor] | None) -> V | None:
        """The value offered for the memory of ``xs`` and these factors, once; else ``None``."""
        same = (
            len(xs) == len(self.memory)
            and all(_on(x, *held) for x, held in zip(xs, self.memory, strict=True))
            and _factor_keys(factors) == self.factors
        )
        value = self.value if same else None
        if same:
            self.memory, self.value = (), None
        return value


def _memory(x: Tensor) -> tuple[weakref.ref, int, int, int]:
    return weakref.ref(x.untyped_storage()), x.data_ptr(), x.numel(), x._version


def _on(x: Tensor, storage: weakref.ref, data_ptr: int, numel: int, version: int) -> bool:
    """Whether contiguous ``x`` covers exactly that memory, unchanged."""
    held = storage()
    return (
        held is not None
        and held is x.untyped_storage()
        and (x.data_ptr(), x.numel(), x._version) == (data_ptr, numel, version)
        and x.is_contiguous()
    )


def _factor_keys(factors: Sequence[Tensor] | None) -> tuple[tuple[int, int], ...] | None:
    return None if factors is None else tuple((f.data_ptr(), f.numel()) for f in factors)


_MAXIMA: _Offer[Tensor] = _Offer()
_CODES: _Offer[tuple[Tensor, Tensor]] = _Offer()


def offer_row_maxima(xs: Sequence[Tensor], factors: Sequence[Tensor] | None, amax: Tensor) -> None:
    """Offers the (rows,) FP32 maxima ``amax`` of the rows of ``xs``' column concatenation, each times its column
    ``factors``, to the next :func:`take_row_maxima` of these tensors' memory (:class:`_Offer`). The kernel that
    writes the activations takes their maxima on the way (the gated MLP's), so that quantizing them reads them
    once."""
    _MAXIMA.put(xs, factors, amax)


def take_row_maxima(xs: Sequence[Tensor], factors: Sequence[Tensor] | None) -> Tensor | None:
    """The maxima offered for these tensors and factors (:func:`offer_row_maxima`), once; else ``None``."""
    return _MAXIMA.take(xs, factors)


def padded(rows: int) -> int:
    """``rows`` rounded up to the rows FP8 GEMMs take."""
    return rows + -rows % ROW_ALIGN


def offer_codes(x: Tensor, codes: Tensor, scales: Tensor, factors: Sequence[Tensor] | None = None) -> None:
    """Offers the per-row codes (padded rows, features) and scales of ``x`` (times its column ``factors``, when
    given), made by the kernel that wrote ``x`` (loralei's RMSNorm), to the next :func:`take_codes` of ``x``'s
    memory (:class:`_Offer`: ``x``, or a view such as the flattened ``(T, features)`` a projection reads)."""
    _CODES.put([x], factors, (codes, scales))


def take_codes(x: Tensor, factors: Sequence[Tensor] | None = None) -> tuple[Tensor, Tensor] | None:
    """The codes and scales offered for ``x``'s memory and these factors (:func:`offer_codes`), once; else
    ``None``."""
    return _CODES.take([x], factors)


def transpose_into(src: Tensor, dst: Tensor) -> Tensor:
    """Writes the transpose of ``src`` (rows, cols), contiguous, into ``dst`` (cols, rows), a view whose rows
    have unit stride (e.g. a column slice of a wider buffer); returns ``dst``."""
    rows, cols = src.shape
    assert src.is_contiguous() and dst.shape == (cols, rows) and dst.stride(1) == 1
    grid = (-(-rows // _TILE), -(-cols // _TILE))
    _launchers(interpret_requested())[1][grid](
        src.view(torch.uint8), dst.view(torch.uint8), rows, cols, dst.stride(0), TILE=_TILE
    )
    return dst
