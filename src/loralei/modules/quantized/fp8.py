"""FP8 bases: each frozen weight as ``float8_e4m3fn`` codes with one FP32 scale per output row, held as TorchAO's
``Float8Tensor`` in its per-row layout (codes (out, in), scales (out, 1)); the weight's dtype stays the compute
dtype.

Packing, once at injection: ``scale = amax(|W_row|) / 448`` in FP32 (448 is e4m3's largest value; an all-zero
row gets scale 1), and the codes are ``W / scale`` clamped to ±448 and rounded to the nearest e4m3 value by
``.to(torch.float8_e4m3fn)``. Dequantizing computes ``code · scale`` in FP32, then casts it to the compute dtype
(the values of TorchAO's ``Float8Tensor.dequantize``).

``fp8_kernel="auto"`` runs both products of the weight as FP8 GEMMs (:mod:`.fp8_gemm`), which need a CUDA GPU of
compute capability >= 8.9 and dimensions that are multiples of 16: anything else is refused, at injection and
at use. ``fp8_kernel="emulated"`` runs them on the dequantize backend (:mod:`.buffers`) on any device.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ...errors import InjectionError, LoraleiError
from ...kernels.fp8_operands import MAX_SEGMENTS
from ...ops.weights import QuantizedWeight
from .buffers import dequantized_mm
from .fp8_gemm import check_fp8_shape, fp8_grad_mm, fp8_mm, quantize_rows
from .tensor import PackedTensor

FP8_GEMM_CAPABILITY = (8, 9)  # sm_89 (Ada) and newer run FP8 GEMMs


def _float8_tensor() -> type[Tensor]:
    """TorchAO's ``Float8Tensor`` class.

    Raises:
        InjectionError: TorchAO is not installed or has no ``Float8Tensor``.
    """
    try:
        from torchao.quantization import Float8Tensor
    except ImportError:
        raise InjectionError(
            "quantize_base=True with quantization_type='fp8' needs TorchAO's Float8Tensor: pip install "
            "'torchao>=0.13' (or loralei[qlora])"
        ) from None
    return Float8Tensor


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
    return _float8_tensor()(codes, scale, block_size=[1, weight.shape[1]], dtype=weight.dtype)


class FP8Weight(PackedTensor):
    """A per-row ``Float8Tensor`` seen through the quantized-base protocol
    (:class:`loralei.ops.weights.QuantizedWeight`).

    Args:
        tensor: the ``Float8Tensor`` (a frozen Parameter of the module).
        kernel: ``"auto"`` or ``"emulated"`` (``LoRAConfig.fp8_kernel``).
    """

    def __init__(self, tensor: Tensor, kernel: str = "auto") -> None:
        super().__init__(tensor)
        self.kernel = kernel
        rows = tensor.shape[0]
        if tuple(tensor.scale.shape) != (rows, 1):
            raise LoraleiError(
                f"an FP8 base weight {tuple(tensor.shape)} with scales {tuple(tensor.scale.shape)}: loralei "
                f"computes with one scale per output row ({rows}, 1) only; block-wise or per-tensor FP8 weights "
                "are not supported yet: load the model in bf16 and set quantization_type='fp8'"
            )

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.tensor.qdata, self.tensor.scale))

    @property
    def backend(self) -> str:
        if self.kernel == "emulated":
            return "FP8 e4m3 (per-row scales), emulated: dequantized into a shared buffer for dense GEMMs"
        return "FP8 e4m3 (per-row scales): FP8 GEMMs (torch._scaled_mm) with per-token activation scales"

    def dequantize(self, out: Tensor | None = None) -> Tensor:
        if out is None:
            out = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        # e4m3 values are exact in every compute dtype; the product is taken in FP32, then cast
        return out.copy_(self.tensor.qdata).mul_(self.tensor.scale)

    def _check_device(self) -> None:
        problem = _fp8_kernel_problem(self.device, self.kernel)
        if problem is not None:  # e.g. a model injected on a GPU, then moved to the CPU
            raise LoraleiError(problem)

    def mm(self, x: Tensor, out: Tensor | None = None) -> Tensor:
        if self.kernel == "emulated":
            return dequantized_mm(self, x, out, transpose=False)
        self._check_device()
        return fp8_mm(x, self.tensor.qdata, self.tensor.scale, out)

    def grad_mm(self, dy: Tensor, out: Tensor | None = None) -> Tensor:
        if self.kernel == "emulated":
            return dequantized_mm(self, dy, out, transpose=True)
        self._check_device()
        return fp8_grad_mm([dy], [self.tensor.qdata], [self.tensor.scale], out)

    @property
    def accumulates(self) -> bool:
        return self.kernel == "emulated"  # FP8 GEMMs write a new product

    def joint_grad_mm(self, dys: Sequence[Tensor], others: Sequence[QuantizedWeight]) -> Tensor | None:
        members = [self, *others]
        if (
            self.kernel == "emulated"
            or len(members) > MAX_SEGMENTS
            or any(not isinstance(q, FP8Weight) or q.kernel != "auto" for q in others)
            or len({q.shape[1] for q in members}) > 1
        ):
            return None
        self._check_device()
        return fp8_grad_mm(dys, [q.tensor.qdata for q in members], [q.tensor.scale for q in members])
