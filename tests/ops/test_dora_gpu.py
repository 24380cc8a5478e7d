"""The DoRA op on the GPU in bf16 (the output-gradient kernel, FP32-output GEMMs for the row norms) against the
fp64 twin: within the tolerance table of plain DoRA's bf16 error. GPU only."""

from __future__ import annotations

import pytest
import torch

from loralei.ops import reference
from loralei.ops.dora import dora_w, row_norms, squared_row_norms
from op_cases import as_dtype, outputs_and_grads, projection
from tolerances import assert_low_precision_close

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")


@pytest.mark.parametrize(("inp", "out", "r"), [(512, 768, 16), (1024, 256, 8)])
@pytest.mark.parametrize("lora_dtype", [torch.bfloat16, torch.float32])
def test_bf16_within_the_table(inp: int, out: int, r: int, lora_dtype: torch.dtype) -> None:
    w = projection(inp, out, r, True, dtype=torch.bfloat16, lora_dtype=lora_dtype)
    w = w._replace(
        W=w.W.to(CUDA),
        A=w.A.detach().to(CUDA).requires_grad_(),
        B=w.B.detach().to(CUDA).requires_grad_(),
        bias=w.bias.to(CUDA),
    )
    norms = row_norms(w, squared_row_norms(w))
    m = (norms * (1 + 0.2 * torch.randn(norms.shape, device=CUDA))).to(lora_dtype).requires_grad_()
    w64 = as_dtype(w, torch.float64)
    m64 = m.detach().double().requires_grad_()
    x = torch.randn(4, 300, inp, device=CUDA, dtype=torch.bfloat16)
    params = [w.A, w.B, m]
    fused = outputs_and_grads(lambda t: [dora_w(t, w, m, squared_row_norms(w))], x, params)
    plain = outputs_and_grads(lambda t: [reference.dora_linear(t, w, m)], x, params)
    expected = outputs_and_grads(
        lambda t: [reference.dora_linear(t, w64, m64)], x.double(), [w64.A, w64.B, m64]
    )
    for name, f, p, e in zip(["Y", "dX", "dA", "dB", "dm"], fused, plain, expected, strict=True):
        assert_low_precision_close(f, p, e, torch.bfloat16, name)
