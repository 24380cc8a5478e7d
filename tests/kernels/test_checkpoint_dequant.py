"""The GPTQ / AWQ / NVFP4 dequantization kernels vs the torch unpacking, bit for bit (Triton interpreter, fp32 and
fp16; bf16 on the GPU), reached through the checkpoint weight's protocol, and the torch path where Triton cannot
run."""

from __future__ import annotations

import pytest
import torch

from checkpoint_quant import awq_tensors, gptq_tensors, nvfp4_tensors
from loralei.kernels import checkpoint_dequant
from loralei.modules.quantized.checkpoint_formats import FORMATS, QuantSpec
from loralei.modules.quantized.checkpoint_tensor import CheckpointTensor
from loralei.modules.quantized.checkpoint_weight import CheckpointWeight

_BITS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}
_E4M3_NAN = (0x7F, 0xFF)


def _fails(*args, **kwargs):
    raise AssertionError("the torch unpacking ran where the kernel should have")


@pytest.fixture
def kernel_only(interpret, monkeypatch: pytest.MonkeyPatch) -> None:
    """The interpreter, failing the test if the checkpoint weight unpacks in torch instead."""
    monkeypatch.setattr(CheckpointTensor, "dense", _fails)


def _gptq(out: int, inp: int, group_size: int, act_order: bool, keep_g_idx: bool) -> dict:
    """GPTQ tensors; without ``keep_g_idx`` the checkpoint holds no ``g_idx`` (consecutive groups)."""
    t = gptq_tensors(out, inp, inp if group_size == -1 else group_size, act_order, seed=out + inp)
    return t if keep_g_idx else {k: v for k, v in t.items() if k != "g_idx"}


def _nvfp4(out: int, inp: int, global_scale: float) -> dict:
    """NVFP4 tensors whose block scales run through every e4m3 byte but NaN (zero, subnormals, 448, negatives)."""
    t = nvfp4_tensors(out, inp, seed=out + inp)
    every = torch.tensor([b for b in range(256) if b not in _E4M3_NAN], dtype=torch.uint8)
    blocks = every[torch.arange(out * inp // 16) % every.numel()]
    t["weight_scale"] = blocks.view(out, inp // 16).view(torch.float8_e4m3fn)
    t["weight_scale_2"] = torch.tensor(global_scale)
    return t


def _kernel_matches_torch(t: dict, spec: QuantSpec, shape: tuple[int, int], dtype: torch.dtype) -> None:
    """The protocol's dequantize into a NaN-filled buffer, and into a new tensor (a linear without LoRA: the
    kernel too, no torch unpacking, whose e2m1 table is a host-to-device copy a CUDA graph cannot record), holds
    the torch unpacking's bits."""
    expected = FORMATS[spec.method].dequantize(t, spec, dtype)
    weight = CheckpointWeight(CheckpointTensor(t, spec, torch.Size(shape), dtype))
    buffer = torch.full(shape, float("nan"), dtype=dtype)
    assert weight.dequantize(buffer) is buffer
    assert torch.equal(buffer.view(_BITS[dtype]), expected.view(_BITS[dtype]))
    assert torch.equal(weight.dequantize().view(_BITS[dtype]), expected.view(_BITS[dtype]))


DTYPES = [torch.float32, torch.float16]

# (out, in, group_size, act_order, the checkpoint holds g_idx): partial tiles along both axes (tiles are 32 x 128),
# a permuted group map, consecutive groups from g_idx and from group_size, one group per output (-1)
GPTQ_CASES = [
    (48, 256, 32, True, True),
    (40, 192, 64, True, True),
    (64, 384, 128, True, True),
    (48, 256, 128, False, True),
    (40, 192, 64, False, False),
    (24, 128, -1, False, False),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("zero_offset", [1, 0], ids=["gptq_v1", "gptq_v2"])
@pytest.mark.parametrize("case", GPTQ_CASES)
def test_gptq_kernel_is_bit_identical(kernel_only, case, zero_offset, dtype):
    out, inp, group_size, act_order, keep_g_idx = case
    t = _gptq(out, inp, group_size, act_order, keep_g_idx)
    _kernel_matches_torch(t, QuantSpec("gptq", group_size, act_order, zero_offset), (out, inp), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("out", "inp", "group_size"), [(48, 256, 32), (40, 192, 64), (64, 384, 128)])
def test_awq_kernel_is_bit_identical(kernel_only, out, inp, group_size, dtype):
    t = awq_tensors(out, inp, group_size, seed=out + inp)
    _kernel_matches_torch(t, QuantSpec("awq", group_size), (out, inp), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("global_scale", [0.37, 1.7e-3])  # the second makes fp16 subnormals
@pytest.mark.parametrize(("out", "inp"), [(48, 256), (40, 208)])
def test_nvfp4_kernel_is_bit_identical(kernel_only, out, inp, global_scale, dtype):
    _kernel_matches_torch(_nvfp4(out, inp, global_scale), QuantSpec("nvfp4", 16), (out, inp), dtype)


def test_without_the_interpreter_the_cpu_unpacks_in_torch(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(checkpoint_dequant, "_launcher", _fails)
    spec = QuantSpec("awq", 32)
    t = awq_tensors(48, 128, 32)
    weight = CheckpointWeight(CheckpointTensor(t, spec, torch.Size((48, 128)), torch.float32))
    assert torch.equal(
        weight.dequantize(torch.empty(48, 128)), FORMATS["awq"].dequantize(t, spec, torch.float32)
    )


def test_the_kernels_refuse_a_buffer_they_cannot_write(interpret):
    t = _nvfp4(16, 64, 1.0)
    with pytest.raises(ValueError, match="contiguous"):
        FORMATS["nvfp4"].write(t, QuantSpec("nvfp4", 16), torch.empty(64, 16).t())


def test_slot_table_inverts_the_nibble_order():
    assert checkpoint_dequant.slot_table(tuple(range(8))) == 0x76543210
    assert checkpoint_dequant.slot_table((0, 2, 4, 6, 1, 3, 5, 7)) == 0x73625140


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _on(t: dict, device: str) -> dict:
    return {k: v.to(device) for k, v in t.items()}


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(("out", "inp"), [(4096, 4096), (1024, 4096), (4096, 14336), (136, 384)])
def test_gpu_bf16_kernels_are_bit_identical(out, inp, monkeypatch):
    monkeypatch.setattr(CheckpointTensor, "dense", _fails)
    cases = [
        (_gptq(out, inp, 128, True, True), QuantSpec("gptq", 128, True, 1)),
        (_gptq(out, inp, 128, False, False), QuantSpec("gptq", 128, False, 0)),
        (awq_tensors(out, inp, 128), QuantSpec("awq", 128)),
        (_nvfp4(out, inp, 0.37), QuantSpec("nvfp4", 16)),
    ]
    for t, spec in cases:
        t = _on(t, "cuda")
        expected = FORMATS[spec.method].dequantize(t, spec, torch.bfloat16)
        weight = CheckpointWeight(CheckpointTensor(t, spec, torch.Size((out, inp)), torch.bfloat16))
        buffer = torch.full((out, inp), float("nan"), dtype=torch.bfloat16, device="cuda")
        assert weight.dequantize(buffer) is buffer
        assert torch.equal(buffer.view(torch.int16), expected.view(torch.int16)), spec
