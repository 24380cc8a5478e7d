"""FP8 bases: each frozen weight as ``float8_e4m3fn`` codes with FP32 scales, held as TorchAO's ``Float8Tensor``;
the weight's dtype stays the compute dtype. The tensor's ``block_size`` says what each scale covers:

- one output row (``block_size`` [1, in], scales (out, 1)): what ``quantization_type="fp8"`` packs at injection.
  Packing, once: ``scale = amax(|W_row|) / 448`` in FP32 (448 is e4m3's largest value; an all-zero row gets scale
  1), and the codes are ``W / scale`` clamped to ±448 and rounded to the nearest e4m3 value by
  ``.to(torch.float8_e4m3fn)``.
- one 128x128 block (``block_size`` [128, 128], scales (⌈out/128⌉, ⌈in/128⌉)): the codes and ``weight_scale_inv``
  of a fine-grained FP8 checkpoint, adopted as loaded (:mod:`.fp8_checkpoint`). Where a dimension is not a
  multiple of 128 its last block is partial.

Dequantizing computes ``code · scale`` (the scale of the code's row or block) in FP32, then casts it to the
compute dtype: the values of TorchAO's ``Float8Tensor.dequantize``, which takes whole blocks only.

``fp8_kernel="auto"`` runs both products of the weight as FP8 GEMMs. Per-row weights run :mod:`.fp8_gemm`, which
needs a CUDA GPU of compute capability >= 8.9 and dimensions that are multiples of 16: anything else is refused,
at injection and at use. Block-scaled weights run :mod:`.fp8_blocks` where PyTorch has those GEMMs (compute
capability 9.x, whole 128x128 blocks) and the dequantize backend elsewhere, since a checkpoint's weights come in
FP8 whatever the machine; ``backend`` says which and why. ``fp8_kernel="emulated"`` runs both products on the
dequantize backend (:mod:`.buffers`) on any device.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from ...errors import InjectionError, LoraleiError
from ...kernels.fp8_operands import MAX_SEGMENTS
from ...ops.weights import QuantizedWeight
from ...quiet import import_quietly
from .buffers import dequantized_mm
from .fp8_blocks import BLOCK, block_gemm_problem, block_grad_mm, block_grid, block_mm
from .fp8_gemm import check_fp8_shape, fp8_grad_mm, fp8_mm, quantize_rows
from .tensor import PackedTensor

FP8_GEMM_CAPABILITY = (8, 9)  # sm_89 (Ada) and newer run FP8 GEMMs
BLOCKS = (BLOCK, BLOCK)  # the block_size of a fine-grained FP8 checkpoint's weights


def float8_tensor() -> type[Tensor]:
    """TorchAO's ``Float8Tensor`` class.

    Raises:
        InjectionError: TorchAO is not installed or has no ``Float8Tensor``.
    """
    try:
        return import_quietly("torchao.quantization").Float8Tensor
    except (ImportError, AttributeError):
        raise InjectionError(
            "FP8 bases (quantization_type='fp8', or a fine-grained FP8 checkpoint) need TorchAO's Float8Tensor: "
            "pip install 'torchao>=0.13' (or loralei[qlora])"
        ) from None


def _fp8_kernel_problem(device: torch.device, kernel: str) -> str | None:
    """The error for ``fp8_kernel=kernel`` with weights computing on ``device``; ``None`` when it runs there."""
    if kernel != "auto":
        return None
    where = str(device)
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if capability >= FP8_GEMM_CAPABILITY:
            return None
        where += f", of compute capability {capability[0]}.{capability[1]}"
    return (
        "fp8_kernel='auto' runs FP8 GEMMs, which need a CUDA GPU of compute capability >= 8.9 (sm_89 Ada, sm_90 "
        f"Hopper or newer), but the weight is on {where}: set fp8_kernel='emulated' (dequantize, then a dense "
        "matmul; for checking numerics) or compute on such a GPU (inject there, or pack there with "
        "quantization_device='cuda')"
    )


def check_fp8(name: str, shape: torch.Size, device: torch.device, kernel: str) -> None:
    """Refuses, before anything changes, ``fp8_kernel="auto"`` for a weight that will compute on ``device``
    without FP8 GEMMs, or whose shape they cannot take.

    Raises:
        InjectionError: ``kernel`` is ``"auto"`` and ``device`` cannot run FP8 GEMMs, or a dimension of module
            ``name``'s weight is not a multiple of 16.
    """
    problem = _fp8_kernel_problem(device, kernel)
    if problem is not None:
        raise InjectionError(problem)
    if kernel == "auto":
        check_fp8_shape(name, shape)


def quantize_fp8(weight: Tensor) -> Tensor:
    """``weight`` (out, in) as a per-row ``Float8Tensor`` on the same device (the recipe: module docstring)."""
    codes, scale = quantize_rows(weight.detach())
    return float8_tensor()(codes, scale, block_size=[1, weight.shape[1]], dtype=weight.dtype)


class _Gemms(NamedTuple):
    """The two FP8 GEMMs of one scale layout: ``(x, codes, scales, out)`` to ``X Wᵀ`` and ``dY W``."""

    mm: Callable[[Tensor, Tensor, Tensor, Tensor | None], Tensor]
    grad_mm: Callable[[Tensor, Tensor, Tensor, Tensor | None], Tensor]


def _row_grad_mm(dy: Tensor, codes: Tensor, scales: Tensor, out: Tensor | None = None) -> Tensor:
    """:func:`.fp8_gemm.fp8_grad_mm` of one weight."""
    return fp8_grad_mm([dy], [codes], [scales], out)


def _fast_mm(x: Tensor, codes: Tensor, scales: Tensor, out: Tensor | None = None) -> Tensor:
    """:func:`.fp8_gemm.fp8_mm` with fast accumulation."""
    return fp8_mm(x, codes, scales, out, fast_accum=True)


_ROW_GEMMS, _BLOCK_GEMMS = _Gemms(fp8_mm, _row_grad_mm), _Gemms(block_mm, block_grad_mm)
_FAST_ROW_GEMMS = _Gemms(_fast_mm, _row_grad_mm)


def _scale_block(tensor: Tensor) -> tuple[int, int]:
    """The (rows, columns) one scale of ``tensor`` covers: (1, in) or (128, 128).

    Raises:
        LoraleiError: another layout (per-tensor, other blocks), or scales of the wrong shape or dtype.
    """
    rows, cols = tensor.shape
    block = tuple(tensor.block_size or ())
    per_row, blocks = (rows, 1), block_grid(tensor.shape)
    scales = {(1, cols): per_row, BLOCKS: blocks}
    if scales.get(block) != tuple(tensor.scale.shape) or tensor.scale.dtype != torch.float32:
        raise LoraleiError(
            f"an FP8 base weight {tuple(tensor.shape)} with scales {tuple(tensor.scale.shape)}: loralei computes "
            f"with one scale per output row {per_row} or one per 128x128 block {blocks} only, in float32 (this "
            f"weight's block size is {list(block)}, its scales {tensor.scale.dtype}); per-tensor or other "
            "block-wise FP8 weights are not supported: load the model in bf16 and set quantization_type='fp8'"
        )
    return block


class FP8Weight(PackedTensor):
    """A ``Float8Tensor`` with per-row or 128x128 block scales seen through the quantized-base protocol
    (:class:`loralei.ops.weights.QuantizedWeight`).

    Args:
        tensor: the ``Float8Tensor`` (a frozen Parameter of the module).
        kernel: ``"auto"`` or ``"emulated"`` (``LoRAConfig.fp8_kernel``).
        fast_accum: the per-row forward GEMM with fast accumulation (``LoRAConfig.fp8_fast_accum``).

    Raises:
        LoraleiError: scales of another layout (see :func:`_scale_block`).
    """

    def __init__(self, tensor: Tensor, kernel: str = "auto", fast_accum: bool = True) -> None:
        super().__init__(tensor)
        self.kernel, self.fast_accum = kernel, fast_accum
        self.block = _scale_block(tensor)
        self._by_device: dict[torch.device, tuple[str | None, bool]] = {}

    @property
    def per_row(self) -> bool:
        """One scale per output row (else per 128x128 block)."""
        return self.block != BLOCKS

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.tensor.qdata, self.tensor.scale))

    @property
    def backend(self) -> str:
        kind = f"FP8 e4m3 ({'per-row' if self.per_row else '128x128 block'} scales)"
        if self.kernel == "emulated":
            return f"{kind}, emulated: dequantized into a shared buffer for dense GEMMs"
        if self.per_row:
            accumulation = "fast accumulation forward" if self.fast_accum else "FP32 accumulation"
            return f"{kind}: FP8 GEMMs (torch._scaled_mm) with per-token activation scales, {accumulation}"
        problem = block_gemm_problem(self.shape, self.device)
        if problem is None:
            return f"{kind}: FP8 GEMMs (torch.nn.functional.scaled_mm) with 1x128 activation scales"
        return f"{kind}, dequantized into a shared buffer for dense GEMMs (fp8_kernel='auto', but {problem})"

    def dequantize(self, out: Tensor | None = None) -> Tensor:
        if out is None:
            out = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        # e4m3 values are exact in every compute dtype; each product is taken in FP32, then cast
        out.copy_(self.tensor.qdata)
        block_rows, block_cols = self.block
        # a scale per row and block of columns: (out, ⌈in / block_cols⌉)
        by_row = self.tensor.scale.repeat_interleave(block_rows, dim=0)[: self.shape[0]]
        whole, rest = divmod(self.shape[1], block_cols)
        out[:, : whole * block_cols].unflatten(1, (whole, block_cols)).mul_(by_row[:, :whole, None])
        if rest:  # a partial last block
            out[:, whole * block_cols :].mul_(by_row[:, whole:])
        return out

    # Asked for every product: each is worked out once per wrapper and device (a module that moves makes a new
    # wrapper; the codes of a streamed layer go from host memory to the device and back).
    def _on_device(self) -> tuple[str | None, bool]:
        """On the codes' device now: why FP8 products cannot run there (or None), and whether they are FP8
        GEMMs (else the dequantize backend's)."""
        device = self.device
        if (found := self._by_device.get(device)) is None:
            gemms = self.kernel != "emulated" and (
                self.per_row or block_gemm_problem(self.shape, device) is None
            )
            found = self._by_device[device] = (_fp8_kernel_problem(device, self.kernel), gemms)
        return found

    def _check_device(self) -> None:
        problem = self._on_device()[0]
        if problem is not None:  # e.g. a model injected on a GPU, then moved to the CPU
            raise LoraleiError(problem)

    @property
    def _runs_gemms(self) -> bool:
        return self._on_device()[1]

    def _gemms(self) -> _Gemms | None:
        """The FP8 GEMMs that compute this weight's products here, or ``None`` for the dequantize backend.

        Raises:
            LoraleiError: per-row scales with ``fp8_kernel="auto"`` on a device without FP8 GEMMs.
        """
        if not self._runs_gemms:
            return None
        if self.per_row:
            self._check_device()
            return _FAST_ROW_GEMMS if self.fast_accum else _ROW_GEMMS
        return _BLOCK_GEMMS

    def _product(self, x: Tensor, out: Tensor | None, transpose: bool) -> Tensor:
        gemms = self._gemms()
        if gemms is None:
            return dequantized_mm(self, x, out, transpose)
        gemm = gemms.grad_mm if transpose else gemms.mm
        return gemm(x, self.tensor.qdata, self.tensor.scale, out)

    def mm(self, x: Tensor, out: Tensor | None = None) -> Tensor:
        return self._product(x, out, transpose=False)

    def grad_mm(self, dy: Tensor, out: Tensor | None = None) -> Tensor:
        return self._product(dy, out, transpose=True)

    @property
    def accumulates(self) -> bool:
        return not self._runs_gemms  # FP8 GEMMs write a new product

    def row_factors(self) -> Tensor | None:
        """The row scales, for per-row ``fp8_kernel="auto"`` weights (their GEMMs quantize activations per row)."""
        return self.tensor.scale.view(-1) if self.kernel == "auto" and self.per_row else None

    def joint_grad_mm(self, dys: Sequence[Tensor], others: Sequence[QuantizedWeight]) -> Tensor | None:
        """One per-row FP8 GEMM for a shared-input group of per-row ``fp8_kernel="auto"`` bases (block-scaled
        members multiply one by one)."""
        members = [self, *others]
        if (
            len(members) > MAX_SEGMENTS
            or any(not isinstance(q, FP8Weight) or q.kernel != "auto" or not q.per_row for q in members)
            or len({q.shape[1] for q in members}) > 1
        ):
            return None
        self._check_device()
        return fp8_grad_mm(dys, [q.tensor.qdata for q in members], [q.tensor.scale for q in members])
