"""A linear's weight as a pre-quantized checkpoint stores it (GPTQ, AWQ, NVFP4): a tensor subclass that reports
the dense weight's shape and compute dtype and holds the stored tensors (codes, zero points, scales) as they
are, so that a module keeps it as its ``weight`` Parameter.

It does three things: it lists its inner tensors (``__tensor_flatten__``), so that it moves between devices
(``Module.to``), streams with ``training.layer_offloading`` and is kept in host memory as layers are read like
TorchAO's packed tensors; it runs ``F.linear`` by dequantizing on the fly, so that a quantized linear the adapter
does not target still computes its frozen forward and input gradient (:func:`loralei.ops.reference.frozen_linear`:
no dense copy kept for the backward); and it refuses every other operation, naming it, rather than computing with
the codes as if they were the weight. Adapted linears compute through :class:`.checkpoint_weight.CheckpointWeight`.
An NVFP4 expert bank is one too, of a 3-D shape (E, d1, d2), its stored tensors with a leading expert axis; it
computes through :class:`.checkpoint_bank.CheckpointBank` only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ...errors import LoraleiError
from ...ops.reference import frozen_linear
from .checkpoint_formats import FORMATS, QuantSpec
from .checkpoint_weight import CheckpointWeight

_aten = torch.ops.aten


class CheckpointTensor(Tensor):
    """A frozen (out, in) weight held as a checkpoint's quantized tensors.

    Args:
        parts: the stored tensors by part name (``qweight``, ``qzeros``, ``scales``, ``g_idx``; or ``weight``,
            ``weight_scale``, ``weight_scale_2``), on one device.
        spec: the checkpoint's quantization settings.
        shape: the dense (out, in).
        dtype: the dtype it dequantizes to and computes in.
    """

    @staticmethod
    def __new__(cls, parts: dict[str, Tensor], spec: QuantSpec, shape: torch.Size, dtype: torch.dtype):
        device = next(iter(parts.values())).device
        return Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device, requires_grad=False)

    def __init__(
        self, parts: dict[str, Tensor], spec: QuantSpec, shape: torch.Size, dtype: torch.dtype
    ) -> None:
        self.spec = spec
        self.part_names = tuple(parts)
        for name, tensor in parts.items():
            setattr(self, name, tensor)

    @property
    def parts(self) -> dict[str, Tensor]:
        """The stored tensors by part name."""
        return {name: getattr(self, name) for name in self.part_names}

    @property
    def stored_bytes(self) -> int:
        """Bytes of the stored tensors (codes, scales, zero points, group map)."""
        return sum(t.numel() * t.element_size() for t in self.parts.values())

    def dense(self) -> Tensor:
        """The dequantized (out, in) weight, a new tensor of ``dtype``."""
        return FORMATS[self.spec.method].dequantize(self.parts, self.spec, self.dtype)

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        title = FORMATS[self.spec.method].title
        return (
            f"CheckpointTensor({title}, shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device})"
        )

    def __tensor_flatten__(self) -> tuple[list[str], tuple[QuantSpec, torch.dtype]]:
        return list(self.part_names), (self.spec, self.dtype)

    @staticmethod
    def __tensor_unflatten__(
        inner: dict[str, Tensor], context: tuple[QuantSpec, torch.dtype], outer_size: torch.Size, _stride: Any
    ) -> CheckpointTensor:
        spec, dtype = context
        return CheckpointTensor(inner, spec, outer_size, dtype)

    def _mapped(self, fn: Callable[[Tensor], Tensor], dtype: torch.dtype | None = None) -> CheckpointTensor:
        """The same weight with ``fn`` applied to each stored tensor, computing in ``dtype`` when given."""
        parts = {name: fn(t) for name, t in self.parts.items()}
        return CheckpointTensor(parts, self.spec, self.shape, dtype or self.dtype)

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.linear:
            x, weight, *rest = args
            return frozen_linear(x, CheckpointWeight(weight), rest[0] if rest else kwargs.get("bias"))
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        self = args[0]
        if func in (_aten.detach.default, _aten.alias.default):
            return self._mapped(lambda t: t)
        if func is _aten.clone.default:
            return self._mapped(torch.clone)
        if (
            func is _aten._to_copy.default
        ):  # .to(device) moves the stored tensors; .to(dtype) changes the compute dtype
            device, blocking = kwargs.get("device") or self.device, kwargs.get("non_blocking", False)
            return self._mapped(lambda t: t.to(device, non_blocking=blocking), kwargs.get("dtype"))
        title = FORMATS[self.spec.method].title
        raise LoraleiError(
            f"{func} on a {title} checkpoint weight: it holds codes and scales, not the dense weight; use it as a "
            "linear's weight (F.linear), or call .dense() for the dequantized tensor"
        )
