"""The quantized-base implementations (NF4 via TorchAO, bitsandbytes 4-bit) through their common protocol."""

from __future__ import annotations

import pytest
import torch

from loralei.modules.quantized import as_quantized, quantize_weight
from loralei.modules.quantized.buffers import release_buffers, shared_buffer
from loralei.modules.quantized.nf4 import NF4Weight, quantize_nf4
from loralei.ops.weights import QuantizedWeight
from tolerances import assert_fp32_close, rel_err

torchao = pytest.importorskip("torchao")


def _nf4(out: int = 48, inp: int = 64, dtype: torch.dtype = torch.float32, block: int = 16) -> NF4Weight:
    g = torch.Generator().manual_seed(0)
    return NF4Weight(quantize_nf4(torch.randn(out, inp, generator=g).to(dtype), block, 4))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_nf4_dequantize_is_torchaos_and_round_trip_error_is_bounded(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(3)
    dense = torch.randn(128, 256, generator=g).to(dtype)
    q = NF4Weight(quantize_nf4(dense, 64, 4))
    assert isinstance(q, QuantizedWeight) and q.dtype == dtype and q.shape == dense.shape
    got = q.dequantize()
    assert torch.equal(got, q.tensor.get_original_weight())
    # 4-bit NormalFloat on Gaussian weights with 64-element blocks: about 9-10 % relative error
    assert 0.05 < rel_err(got, dense) < 0.11
    # 4 bits per element, an int8 scale per 64-element block, a factor per 4 blocks, the mean and the table
    size = dense.element_size()
    assert q.nbytes == dense.numel() // 2 + dense.numel() // 64 + (dense.numel() // 256 + 1 + 16) * size


def test_nf4_products_equal_dense_products_and_accumulate() -> None:
    q = _nf4()
    w = q.dequantize()
    x, dy = torch.randn(5, 64), torch.randn(5, 48)
    assert_fp32_close(q.mm(x), x @ w.t(), "X Wᵀ")
    assert_fp32_close(q.grad_mm(dy), dy @ w, "dY W")
    out, before = torch.randn(5, 48), None
    before = out.clone()
    assert q.mm(x, out) is out
    assert_fp32_close(out, before + x @ w.t(), "out += X Wᵀ")


def test_shared_buffer_is_reused_per_shape_dtype_and_device() -> None:
    release_buffers()
    a = shared_buffer(torch.Size((4, 8)), torch.float32, torch.device("cpu"))
    assert shared_buffer(torch.Size((4, 8)), torch.float32, torch.device("cpu")) is a
    assert shared_buffer(torch.Size((8, 4)), torch.float32, torch.device("cpu")) is not a
    assert shared_buffer(torch.Size((4, 8)), torch.float16, torch.device("cpu")) is not a


def test_as_quantized_tells_packed_from_dense() -> None:
    from loralei import LoRAConfig

    config = LoRAConfig(quantize_base=True, nf4_block_size=16, nf4_scaler_block_size=4)
    param = quantize_weight(torch.randn(16, 32), config)
    assert not param.requires_grad
    assert isinstance(as_quantized(param, config), NF4Weight)
    assert as_quantized(torch.nn.Parameter(torch.randn(4, 4))) is None


def test_bitsandbytes_4bit_weight_through_the_protocol() -> None:
    bnb = pytest.importorskip("bitsandbytes")
    dense = torch.randn(128, 256, dtype=torch.bfloat16)
    layer = bnb.nn.Linear4bit(256, 128, bias=False, compute_dtype=torch.bfloat16, quant_type="nf4")
    layer.weight = bnb.nn.Params4bit(dense, requires_grad=False, quant_type="nf4", compress_statistics=True)
    layer = layer.to("cpu")  # bitsandbytes quantizes when the Params4bit moves to a device
    q = as_quantized(layer.weight)
    assert q is not None and q.shape == (128, 256) and q.dtype == torch.bfloat16
    assert q.nbytes < dense.numel() * 0.6
    w = q.dequantize()
    assert 0.05 < rel_err(w, dense) < 0.11
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    assert torch.equal(q.mm(x), x @ w.t())
    assert torch.allclose(layer(x).float(), (x @ w.t()).float(), rtol=2e-2, atol=2e-2)
