"""Expert banks of a pre-quantized checkpoint (NVFP4), through :class:`loralei.ops.weights.QuantizedBank`.

A bank is held as a 3-D :class:`.checkpoint_tensor.CheckpointTensor` (E, d1, d2) whose stored tensors carry a
leading expert axis: the checkpoint's per-expert tensors stacked as they are, still 4-bit packed (NVFP4:
``weight`` uint8 (E, d1, d2/2), ``weight_scale`` e4m3 (E, d1, d2/16), ``weight_scale_2`` float32 (E, S), one
global scale for each of the S per-expert projections fused into the bank's rows, e.g. gate then up). Expert
``e``'s tensors are the ``[e]`` slices, a 2-D weight of the format with S runs of rows: the experts asked for
(every one for a training batch, the routed ones otherwise: :func:`loralei.ops.lora_experts._dense`) are
dequantized into the buffer shared by every bank of that shape, all of them in one launch of the format's Triton
kernel where it runs on the buffer, one by one by its torch formula elsewhere (the same bits), and the other
experts never are.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor

from ...kernels import checkpoint_dequant
from .buffers import shared_buffer
from .checkpoint_formats import FORMATS
from .tensor import PackedTensor

if TYPE_CHECKING:
    from .checkpoint_tensor import CheckpointTensor


class CheckpointBank(PackedTensor):
    """A 3-D :class:`.checkpoint_tensor.CheckpointTensor` (a frozen bank Parameter of an experts module) seen
    through :class:`loralei.ops.weights.QuantizedBank`."""

    tensor: CheckpointTensor

    @property
    def nbytes(self) -> int:
        return self.tensor.stored_bytes

    @property
    def backend(self) -> str:
        title = FORMATS[self.tensor.spec.method].title
        return (
            f"{title} checkpoint expert bank, unpacked into a shared buffer for grouped GEMMs (whole for a "
            "training batch)"
        )

    def expert(self, e: int) -> dict[str, Tensor]:
        """Expert ``e``'s stored tensors (views), a 2-D weight of the format."""
        return {name: t[e] for name, t in self.tensor.parts.items()}

    def dequantize(self, experts: list[int] | None, out: Tensor | None = None) -> Tensor:
        spec = self.tensor.spec
        fmt = FORMATS[spec.method]
        if out is None:
            out = shared_buffer(self.shape, self.dtype, self.device)
        if fmt.write_experts is not None and checkpoint_dequant.usable(out) and out.is_contiguous():
            return fmt.write_experts(self.tensor.parts, spec, out, experts)  # one launch for every expert
        for e in range(self.shape[0]) if experts is None else experts:
            out[e].copy_(fmt.dequantize(self.expert(e), spec, self.dtype))
        return out
