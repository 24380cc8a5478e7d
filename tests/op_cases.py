"""Helpers of the op tests: random projections, dropout masks, gradients of a fixed weighted loss."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch.profiler import ProfilerActivity, profile

from loralei.ops.dropout import draw_keep_mask, scaled_mask
from loralei.ops.weights import LoRAWeights


def projection(
    inp: int,
    out: int,
    r: int,
    bias: bool,
    dtype: torch.dtype = torch.float32,
    lora_dtype: torch.dtype | None = None,
    scale: float = 0.75,
    seed: int = 0,
) -> LoRAWeights:
    """A random frozen projection with trainable (leaf) A and B."""
    g = torch.Generator().manual_seed(seed)
    lora_dtype = lora_dtype or dtype
    a = (torch.randn(r, inp, generator=g) / inp**0.5).to(lora_dtype).requires_grad_()
    b = (torch.randn(out, r, generator=g) / r**0.5).to(lora_dtype).requires_grad_()
    w = (torch.randn(out, inp, generator=g) / inp**0.5).to(dtype)
    bias_t = torch.randn(out, generator=g).to(dtype) if bias else None
    return LoRAWeights(W=w, quant=None, A=a, B=b, scale=scale, dropout_p=0.0, bias=bias_t)


def as_dtype(w: LoRAWeights, dtype: torch.dtype) -> LoRAWeights:
    """A detached copy of ``w`` with every tensor in ``dtype`` (for fp64 references)."""
    cast = [t.detach().to(dtype) if t is not None else None for t in (w.W, w.A, w.B, w.bias)]
    return w._replace(W=cast[0], A=cast[1].requires_grad_(), B=cast[2].requires_grad_(), bias=cast[3])


def keep_mask(shape: Sequence[int], p: float, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """A float dropout mask already divided by the keep probability (ops.reference's convention)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(*shape, generator=g) >= p).to(dtype) / (1 - p)


def plain_path_mask(x: torch.Tensor, p: float) -> torch.Tensor | None:
    """The mask LoRALinear's plain path draws from the global RNG (the draw the fused ops make), scaled."""
    return scaled_mask(draw_keep_mask(x.shape, x.device, p), p, x.dtype)


def outputs_and_grads(
    fn: Callable[[torch.Tensor], Sequence[torch.Tensor]], x: torch.Tensor, params: Sequence[torch.Tensor]
) -> list[torch.Tensor]:
    """Outputs of ``fn(x)`` and the gradients of a fixed random weighting of them w.r.t. x and ``params``."""
    x = x.detach().requires_grad_()
    outs = list(fn(x))
    g = torch.Generator().manual_seed(123)
    loss = sum(
        (o.double() * torch.randn(o.shape, generator=g, dtype=torch.float64).to(o.device)).sum() for o in outs
    )
    grads = torch.autograd.grad(loss, [x, *params], allow_unused=True)
    return outs + [
        gr if gr is not None else torch.zeros_like(p) for gr, p in zip(grads, [x, *params], strict=True)
    ]


def gemm_shapes(fn: Callable[[], object]) -> list[tuple[int, int]]:
    """The (rows, cols) output of every GEMM (``mm``/``addmm``/``addmm_``) that ``fn()`` runs, in call order.

    The profiler sees the GEMMs inside custom ops too (a dispatch mode stops at the custom op itself).
    """
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    shapes = []
    for event in prof.events():
        first = {"aten::mm": 0, "aten::addmm": 1, "aten::addmm_": 1}.get(event.name)
        if first is not None:
            a, b = event.input_shapes[first : first + 2]
            shapes.append((a[0], b[1]))
    return shapes


def nf4_projection(
    inp: int,
    out: int,
    r: int,
    bias: bool,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    block: int = 16,
    kernel: str = "dequantize",
) -> LoRAWeights:
    """:func:`projection` with its base stored as NF4 (TorchAO), blocks small enough for tiny shapes."""
    from loralei.modules.quantized.nf4 import NF4Weight, quantize_nf4

    w = projection(inp, out, r, bias, dtype=dtype, seed=seed)
    return w._replace(W=None, quant=NF4Weight(quantize_nf4(w.W, block, 2), kernel, autotune=False))


def fp8_projection(
    inp: int, out: int, r: int, bias: bool, dtype: torch.dtype = torch.float32, seed: int = 0
) -> LoRAWeights:
    """:func:`projection` with its base stored as FP8 (per-row scales), computing on the emulated backend."""
    from loralei.modules.quantized.fp8 import FP8Weight, quantize_fp8

    w = projection(inp, out, r, bias, dtype=dtype, seed=seed)
    return w._replace(W=None, quant=FP8Weight(quantize_fp8(w.W), "emulated"))


def dequantized(w: LoRAWeights) -> LoRAWeights:
    """``w`` with its quantized base replaced by the dense weight it stands for (the plain-twin semantics)."""
    return w._replace(W=w.quant.dequantize(), quant=None)
