"""GPU (bf16) numerics of the fused ops at real shapes: fused error vs fp64 <= 2x the plain bf16 error.

Run on a CUDA machine with ``pytest -m gpu tests/ops/test_ops_gpu.py``; CPU CI deselects these.
"""

from __future__ import annotations

import pytest
import torch

from loralei.ops import reference
from loralei.ops.lora_w import lora_w
from loralei.ops.shared_input import lora_group
from op_cases import as_dtype, outputs_and_grads, projection
from tolerances import assert_low_precision_close

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")


def _on_gpu(w):
    moved = [t.detach().to(CUDA) if t is not None else None for t in (w.W, w.A, w.B, w.bias)]
    return w._replace(W=moved[0], A=moved[1].requires_grad_(), B=moved[2].requires_grad_(), bias=moved[3])


def _check(fused_fn, plain_fn, ws, x: torch.Tensor) -> None:
    params = [t for w in ws for t in (w.A, w.B)]
    w64 = [as_dtype(w, torch.float64) for w in ws]
    params64 = [t for w in w64 for t in (w.A, w.B)]
    exact = outputs_and_grads(lambda t: plain_fn(t, w64), x.double(), params64)
    fused = outputs_and_grads(lambda t: fused_fn(t, ws), x, params)
    plain = outputs_and_grads(lambda t: plain_fn(t, ws), x, params)
    for i, (f, p, e) in enumerate(zip(fused, plain, exact, strict=True)):
        assert_low_precision_close(f, p, e, torch.bfloat16, what=f"output/grad {i}")


@pytest.mark.parametrize("lora_dtype", [torch.bfloat16, torch.float32])
def test_lora_w_bf16(lora_dtype: torch.dtype) -> None:
    w = _on_gpu(projection(4096, 1024, 16, bias=True, dtype=torch.bfloat16, lora_dtype=lora_dtype))
    x = torch.randn(2, 2048, 4096, device=CUDA)  # fp32 input, as from an fp32 RMSNorm
    _check(lambda t, ws: [lora_w(t, ws[0])], lambda t, ws: [reference.lora_linear(t, ws[0])], [w], x)


@pytest.mark.parametrize("lora_dtype", [torch.bfloat16, torch.float32])
def test_lora_group_bf16(lora_dtype: torch.dtype) -> None:
    ws = [
        _on_gpu(projection(2048, out, 16, bias=False, dtype=torch.bfloat16, lora_dtype=lora_dtype, seed=i))
        for i, out in enumerate([2048, 512, 512])
    ]
    x = torch.randn(2, 1024, 2048, device=CUDA, dtype=torch.bfloat16)
    _check(lambda t, ws: list(lora_group(t, ws)), lambda t, ws: list(reference.lora_group(t, ws)), ws, x)
