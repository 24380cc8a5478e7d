"""What ops take: one projection's tensors (:class:`LoRAWeights`) and the protocol of a quantized frozen base.

A quantized base (NF4, int4, FP8, bitsandbytes 4-bit; implementations in :mod:`loralei.modules.quantized`) is
a frozen weight that can dequantize itself, compute ``X Wᵀ`` and ``dY W`` into a buffer, and report its bytes.
The ops call :func:`base_mm_` / :func:`base_grad_mm_` and never ask which kind of weight they hold.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol, runtime_checkable

import torch
from torch import Tensor

from ..errors import LoraleiError


class _Packed(Protocol):
    """What every quantized frozen tensor reports about itself."""

    @property
    def shape(self) -> torch.Size:
        """Shape of the dense tensor: (out, in) for a weight, (E, d1, d2) for an expert bank."""

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype (the dense tensor's)."""

    @property
    def device(self) -> torch.device:
        """Where the packed tensor lives."""

    @property
    def nbytes(self) -> int:
        """Bytes of the packed tensor and its scales."""

    @property
    def backend(self) -> str:
        """How the products run, in words for the fusion report (e.g. "NF4, dequantize + dense GEMM")."""


@runtime_checkable
class QuantizedWeight(_Packed, Protocol):
    """A frozen (out, in) weight stored quantized; computes in ``dtype``.

    Implementations never modify their packed tensors, so ops keep a reference to them for the backward
    instead of saving tensors.
    """

    def dequantize(self, out: Tensor | None = None) -> Tensor:
        """The dense weight, written into ``out`` ((out, in), ``dtype``) when given, else a new tensor."""

    def mm(self, x: Tensor, out: Tensor | None = None) -> Tensor:
        """``X Wᵀ`` (T, out) for X (T, in): a new tensor, or accumulated into ``out`` (``out += X Wᵀ``)."""

    def grad_mm(self, dy: Tensor, out: Tensor | None = None) -> Tensor:
        """``dY W`` (T, in) for dY (T, out): a new tensor, or accumulated into ``out``."""

    @property
    def accumulates(self) -> bool:
        """Whether ``mm`` / ``grad_mm`` add into ``out`` for free (a dense GEMM's ``beta = 1``). When not (FP8
        GEMMs write a new product), the ops run the base product first and add the rank-r terms into it."""

    def joint_grad_mm(self, dys: Sequence[Tensor], others: Sequence[QuantizedWeight]) -> Tensor | None:
        """``dY_0 W + Σ_i dY_{i+1} W_i`` over this base and ``others`` (a shared-input group) as one product,
        a new (T, in) tensor; ``None`` when they cannot be multiplied jointly (then each member multiplies)."""

    def row_factors(self) -> Tensor | None:
        """Where the products quantize their activations to FP8 per row (:mod:`loralei.kernels.fp8_operands`):
        the (out,) FP32 column factors ``dY`` is multiplied by first (``X`` is quantized as it is); else
        ``None``. An op whose kernel writes such an activation can take its rows' maxima on the way
        (:func:`loralei.kernels.fp8_operands.offer_row_maxima`)."""


class LoRAWeights(NamedTuple):
    """Everything one adapted projection contributes to an op.

    Attributes:
        W: frozen dense base weight, out×in; ``None`` when the base is quantized.
        quant: the quantized base (:class:`QuantizedWeight`); ``None`` for a dense ``W``.
        A: LoRA down projection, r×in.
        B: LoRA up projection, out×r.
        scale: factor on ``B @ A`` (alpha/r or alpha/sqrt(r)).
        dropout_p: dropout probability on the LoRA branch input (0 disables it).
        bias: frozen base bias (out,) or ``None``.
    """

    W: Tensor | None
    quant: QuantizedWeight | None
    A: Tensor
    B: Tensor
    scale: float
    dropout_p: float
    bias: Tensor | None

    @property
    def base(self) -> Tensor | QuantizedWeight:
        """The frozen base weight: the dense tensor or the quantized one."""
        return self.W if self.quant is None else self.quant

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype (the base weight's)."""
        return self.base.dtype

    @property
    def shape(self) -> torch.Size:
        """(out, in) of the base weight."""
        return self.base.shape


def with_base(
    base: Tensor | QuantizedWeight, A: Tensor, B: Tensor, scale: float, bias: Tensor | None = None
) -> LoRAWeights:
    """A :class:`LoRAWeights` without dropout whose base is ``base``, dense or quantized."""
    if isinstance(base, Tensor):
        return LoRAWeights(base, None, A, B, scale, 0.0, bias)
    return LoRAWeights(None, base, A, B, scale, 0.0, bias)


@torch.compiler.disable
def run_eager(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` outside any ``torch.compile`` graph (a graph break around it).

    The ops with quantized bases that are not custom ops (the plain dequantizing linear, the expert banks) run
    this way: a traced op would treat the shared dequantization buffer, which every layer of a shape
    rewrites, as a value saved for backward.
    """
    return fn(*args)


# Quantized bases by handle (see quant_handle); it keeps none alive.
_BY_HANDLE: weakref.WeakValueDictionary[int, QuantizedWeight] = weakref.WeakValueDictionary()
_NEXT_HANDLE = itertools.count()


def register_quant(quant: QuantizedWeight) -> int:
    """Numbers ``quant`` (see :func:`quant_handle`); loralei's bases are numbered as they are made."""
    handle = next(_NEXT_HANDLE)
    _BY_HANDLE[handle] = quant
    quant._loralei_handle = handle  # type: ignore[attr-defined]
    return handle


# Where a traced function meets a base not numbered yet (made inside it): a graph break, once per base.
_register_outside_graphs = torch.compiler.disable(register_quant)


def quant_handle(quant: QuantizedWeight) -> int:
    """A number that stands for ``quant`` in a custom op's arguments, which take tensors and numbers but no
    objects; :func:`quant_of` gives the base back. It is an attribute of the base, so under ``torch.compile``
    it is a constant of the graph (a new base is traced again), and the ops that take quantized bases stay
    single custom ops there, as they are with dense ones."""
    handle = getattr(quant, "_loralei_handle", None)
    return handle if handle is not None else _register_outside_graphs(quant)


def quant_of(handle: int) -> QuantizedWeight:
    """The quantized base that :func:`quant_handle` numbered ``handle``."""
    return _BY_HANDLE[handle]


def base_of(W: Tensor | None, handle: int) -> Tensor | QuantizedWeight:
    """A custom op's frozen base: the dense ``W``, or (``W`` is ``None``) the quantized base of ``handle``."""
    return W if W is not None else quant_of(handle)


def base_args(w: LoRAWeights) -> tuple[Tensor | None, int]:
    """What a custom op takes for ``w``'s frozen base: the dense tensor and -1, or ``None`` and the quantized
    base's handle (see :func:`base_of`)."""
    return (w.W, -1) if w.quant is None else (None, quant_handle(w.quant))


def split_bases(bases: list) -> tuple[list[Tensor | None], list[QuantizedWeight | None]]:
    """Splits frozen bases into what ``save_for_backward`` takes (the dense tensors, ``None`` in place of the
    quantized ones) and the quantized ones (kept on ``ctx``: they are not tensors and never change)."""
    dense = [b if isinstance(b, Tensor) else None for b in bases]
    return dense, [None if isinstance(b, Tensor) else b for b in bases]


def join_bases(dense: list[Tensor | None], quants: list[QuantizedWeight | None]) -> list:
    """Undoes :func:`split_bases`."""
    return [t if q is None else q for t, q in zip(dense, quants, strict=True)]


def base_mm_(out: Tensor, x2: Tensor, w: LoRAWeights) -> Tensor:
    """``out += X Wᵀ`` (T, out) for X (T, in); the dense GEMM or the quantized base's own product."""
    if w.quant is None:
        return out.addmm_(x2, w.W.t())
    return w.quant.mm(x2, out)


def base_grad_mm_(out: Tensor, dy: Tensor, w: LoRAWeights) -> Tensor:
    """``out += dY W`` (T, in) for dY (T, out)."""
    if w.quant is None:
        return out.addmm_(dy, w.W)
    return w.quant.grad_mm(dy, out)


def accumulates(w: LoRAWeights) -> bool:
    """Whether the base's products accumulate into an existing tensor for free (see ``QuantizedWeight``)."""
    return w.quant is None or w.quant.accumulates


def base_grads(dys: Sequence[Tensor], ws: Sequence[LoRAWeights]) -> Tensor:
    """``Σ_i dY_i W_i`` (T, in) as a new tensor: one joint product where the bases offer it, else the first
    member's product with the others accumulated into it."""
    first = ws[0].quant
    if len(ws) > 1 and first is not None:
        joint = first.joint_grad_mm(dys, [w.quant for w in ws[1:]])
        if joint is not None:
            return joint
    dx = base_grad(dys[0], ws[0])
    for dy, w in zip(dys[1:], ws[1:], strict=True):
        base_grad_mm_(dx, dy, w)
    return dx


def row_factors(base: Tensor | QuantizedWeight) -> Tensor | None:
    """:meth:`QuantizedWeight.row_factors` of a quantized base; ``None`` for a dense one."""
    return None if isinstance(base, Tensor) else base.row_factors()


def base_linear(x2: Tensor, w: LoRAWeights) -> Tensor:
    """``X Wᵀ + bias`` (T, out) as a new tensor."""
    if w.quant is None:
        return torch.nn.functional.linear(x2, w.W, w.bias)
    if w.bias is None:
        return w.quant.mm(x2)
    return w.quant.mm(x2, w.bias.to(x2.dtype).expand(x2.shape[0], -1).clone())


def base_grad(dy: Tensor, w: LoRAWeights) -> Tensor:
    """``dY W`` (T, in) as a new tensor."""
    if w.quant is None:
        return dy.mm(w.W)
    return w.quant.grad_mm(dy)


# Whether the instances of a class are QuantizedWeights, by class (see _is_quantized_weight).
_QUANTIZED_KINDS: dict[type, bool] = {}


def _is_quantized_weight(quant: object) -> bool:
    """``isinstance(quant, QuantizedWeight)``, asked once per class: against a runtime protocol it looks up
    every member each time (tens of microseconds), and the ops ask for every projection of every step. (Traced,
    it is asked as it is: a compiled graph asks nothing.)"""
    if torch.compiler.is_compiling():
        return isinstance(quant, QuantizedWeight)
    known = _QUANTIZED_KINDS.get(type(quant))
    if known is None:
        known = _QUANTIZED_KINDS[type(quant)] = isinstance(quant, QuantizedWeight)
    return known


def check_fusable(w: LoRAWeights, what: str) -> None:
    """Refuses a projection that a fused op cannot compute exactly.

    Args:
        w: the projection.
        what: how the error names it, e.g. ``"lora_group member 1"``.

    Raises:
        LoraleiError: a base weight/bias that requires grad (fused ops give the frozen base no gradient), or a
            ``quant`` that is not a :class:`QuantizedWeight`.
    """
    if w.quant is not None and not _is_quantized_weight(w.quant):
        raise LoraleiError(
            f"{what}: quant is a {type(w.quant).__name__}, not a quantized weight (shape, dtype, device, nbytes, "
            "dequantize, mm, grad_mm); build it with loralei.modules.quantized.as_quantized"
        )
    if (w.W is not None and w.W.requires_grad) or (w.bias is not None and w.bias.requires_grad):
        raise LoraleiError(
            f"{what}: the base weight/bias requires grad, but fused ops give the frozen base no gradient; "
            "freeze it (inject_lora does) or use the plain path"
        )


# --- MoE expert banks ---


@runtime_checkable
class QuantizedBank(_Packed, Protocol):
    """A frozen (E, d1, d2) expert bank stored quantized, expert by expert; computes in ``dtype``."""

    def dequantize(self, experts: list[int] | None, out: Tensor | None = None) -> Tensor:
        """The dense matrices of ``experts`` (``None``: every expert, reading nothing on the host, so that a CUDA
        graph can record it) written into ``out`` ((E, d1, d2), ``dtype``), or into a buffer shared by every bank
        of this shape when ``out`` is ``None``; other experts' slices may be written too (with their own matrices:
        one launch for a whole bank is cheaper when most experts are asked for) or left as they are. Returns the
        (E, d1, d2) tensor written."""


class ExpertBank(NamedTuple):
    """One 3-D expert parameter of an MoE experts module and its per-expert LoRA factors.

    Attributes:
        W: the frozen dense bank, (E, out, in), or (E, in, out) when ``transposed``; ``None`` when quantized.
        quant: the quantized bank (:class:`QuantizedBank`); ``None`` for a dense ``W``.
        A: (E, r, in) down factors, or ``None`` when this parameter is not adapted.
        B: (E, out, r) up factors, or ``None``.
        scale: factor on ``B[e] @ A[e]``.
        bias: (E, out) frozen bias or ``None``.
        transposed: the bank stores each expert as (in, out) (Transformers' ``is_transposed``).
    """

    W: Tensor | None
    quant: QuantizedBank | None
    A: Tensor | None
    B: Tensor | None
    scale: float
    bias: Tensor | None
    transposed: bool

    @property
    def base(self) -> Tensor | QuantizedBank:
        """The frozen bank: the dense tensor or the quantized one."""
        return self.W if self.quant is None else self.quant

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype."""
        return self.base.dtype

    @property
    def adapted(self) -> bool:
        """Whether this parameter has LoRA factors."""
        return self.A is not None

    def in_out(self, dense: Tensor) -> Tensor:
        """``dense`` (the bank's storage layout) as (E, in, out): the right operand of ``x @ W[e]ᵀ``."""
        return dense if self.transposed else dense.transpose(-2, -1)

    def out_in(self, dense: Tensor) -> Tensor:
        """``dense`` as (E, out, in): the right operand of the input gradient ``dy @ W[e]``."""
        return dense.transpose(-2, -1) if self.transposed else dense
