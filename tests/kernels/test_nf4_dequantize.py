"""The Triton NF4 dequantization (interpreter on the CPU) against TorchAO's own, bit for bit."""

from __future__ import annotations

import pytest
import torch

from loralei.kernels import nf4
from loralei.modules.quantized.nf4 import quantize_nf4

pytest.importorskip("torchao")


def _packed(shape: tuple[int, int], dtype: torch.dtype, block: int, sblock: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    t = quantize_nf4((torch.randn(*shape, generator=g) * 0.02).to(dtype), block, sblock)
    p = nf4.NF4Packed(
        t.quantized_data, t.quantized_scalers, t.quantization_factor, t.scaler_mean, t.nf4,
        tuple(t.shape), block, sblock,
    )  # fmt: skip
    return t, p


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    ("shape", "block", "sblock"),
    [((48, 96), 32, 3), ((64, 256), 64, 4), ((33, 64), 16, 2), ((40, 4160), 64, 5)],
)
def test_kernel_equals_torchao_bit_for_bit(interpret, monkeypatch, dtype, shape, block, sblock) -> None:
    monkeypatch.setattr(nf4, "dequantize_torch", lambda *a: pytest.fail("the torch fallback ran"))
    t, p = _packed(shape, dtype, block, sblock)
    out = torch.full(shape, float("nan"), dtype=dtype)  # every element must be written
    assert nf4.dequantize(p, out) is out
    assert torch.equal(out, t.get_original_weight())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_path_equals_torchao_and_serves_cpu_tensors_without_the_interpreter(monkeypatch, dtype) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    t, p = _packed((64, 128), dtype, 64, 2)
    assert torch.equal(nf4.dequantize_torch(p), t.get_original_weight())
    out = torch.empty(64, 128, dtype=dtype)
    assert torch.equal(nf4.dequantize(p, out), t.get_original_weight())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_kernel_equals_torchao_on_gpu(dtype) -> None:
    t, p = _packed((14336, 4096), dtype, 64, 256)
    p = nf4.NF4Packed(*(x.cuda() for x in p[:5]), *p[5:])
    out = torch.full((14336, 4096), float("nan"), dtype=dtype, device="cuda")
    assert torch.equal(nf4.dequantize(p, out).cpu(), t.get_original_weight())
