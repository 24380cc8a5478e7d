"""NVFP4 expert banks stacked from ModelOpt's per-expert tensors: each routed expert unpacks to the format's
definition of its projections (tests/checkpoint_quant.py) bit for bit, in torch and through the Triton kernel
(interpreter, fp32 and fp16), with a different global scale for each projection of each expert; the bank stays
4-bit packed."""

from __future__ import annotations

import pytest
import torch

from checkpoint_quant import nvfp4_reference, nvfp4_tensors
from loralei.modules.quantized import as_quantized_bank
from loralei.modules.quantized.checkpoint_bank import CheckpointBank
from loralei.modules.quantized.checkpoint_formats import QuantSpec
from loralei.modules.quantized.checkpoint_tensor import CheckpointTensor
from loralei.train.quantized_banks import BankPlan, stack_bank

SPEC = QuantSpec("nvfp4", 16)
EXPERTS = 3
_BITS = {torch.float32: torch.int32, torch.float16: torch.int16}


def _per_expert(rows: int, inp: int, projections: tuple[str, ...]) -> dict[str, dict[str, torch.Tensor]]:
    """ModelOpt's tensors of each expert projection (``experts.<e>.<proj>``), each with its own global scale."""
    return {
        f"experts.{e}.{proj}": nvfp4_tensors(rows, inp, seed=10 * e + k)
        for e in range(EXPERTS)
        for k, proj in enumerate(projections)
    }


def _bank(
    linears: dict, projections: tuple[str, ...], rows: int, inp: int, dtype: torch.dtype
) -> CheckpointTensor:
    read = {
        f"{name}.{part}": t
        for name, parts in linears.items()
        for part, t in parts.items()
        if part != "input_scale"
    }
    shape = torch.Size((EXPERTS, rows * len(projections), inp))
    return stack_bank(read, "experts.bank", BankPlan(EXPERTS, projections), shape, SPEC, dtype)


def _expected(linears: dict, projections: tuple[str, ...], dtype: torch.dtype) -> torch.Tensor:
    """Each expert's projections by the format's definition, concatenated along the rows."""
    per_expert = [
        torch.cat([nvfp4_reference(linears[f"experts.{e}.{p}"], dtype) for p in projections])
        for e in range(EXPERTS)
    ]
    return torch.stack(per_expert)


CASES = [(("gate_proj", "up_proj"), 40, 64), (("down_proj",), 64, 48)]  # rows per projection, inputs


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("projections", "rows", "inp"), CASES)
def test_bank_unpacks_to_the_per_expert_definition_bit_for_bit(projections, rows, inp, dtype):
    linears = _per_expert(rows, inp, projections)
    bank = as_quantized_bank(_bank(linears, projections, rows, inp, dtype), EXPERTS)
    assert isinstance(bank, CheckpointBank)
    for experts in (list(range(EXPERTS)), None):  # None: every expert
        out = torch.full(bank.shape, float("nan"), dtype=dtype)
        assert bank.dequantize(experts, out) is out
        assert torch.equal(out, _expected(linears, projections, dtype))


def test_the_bank_stays_packed_and_only_routed_experts_are_written():
    projections, rows, inp = CASES[0]
    tensor = _bank(_per_expert(rows, inp, projections), projections, rows, inp, torch.float32)
    assert tensor.weight.dtype == torch.uint8 and tensor.weight.shape == (EXPERTS, 2 * rows, inp // 2)
    assert tensor.weight_scale_2.shape == (EXPERTS, 2)  # one global scale per projection of each expert
    bank = CheckpointBank(tensor)
    assert bank.nbytes < tensor.shape.numel() * 0.6  # half a byte per code, a byte per 16 codes, the globals
    out = torch.full(bank.shape, float("nan"))
    bank.dequantize([1], out)
    assert out[[0, 2]].isnan().all() and not out[1].isnan().any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("projections", "rows", "inp"), CASES)
def test_the_kernel_writes_the_torch_bits(monkeypatch, projections, rows, inp, dtype):
    def fails(*args, **kwargs):
        raise AssertionError("the torch unpacking ran where the kernel should have")

    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    linears = _per_expert(rows, inp, projections)
    bank = CheckpointBank(_bank(linears, projections, rows, inp, dtype))
    monkeypatch.setattr("loralei.modules.quantized.unpack.nvfp4", fails)
    out = torch.full(bank.shape, float("nan"), dtype=dtype)
    bank.dequantize([0, 2], out)
    expected = _expected(linears, projections, dtype)
    assert torch.equal(out[[0, 2]].view(_BITS[dtype]), expected[[0, 2]].view(_BITS[dtype]))
    assert out[1].isnan().all()
    bank.dequantize(None, out)  # every expert, their indices made on the device
    assert torch.equal(out.view(_BITS[dtype]), expected.view(_BITS[dtype]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(
    ("projections", "rows", "inp"), [(("gate_proj", "up_proj"), 768, 2048), (("down_proj",), 2048, 768)]
)
def test_gpu_bf16_bank_kernel_is_bit_identical(monkeypatch, projections, rows, inp):
    """Qwen3-30B-A3B's per-expert shapes, eight experts, five of them routed, in bf16 on the GPU."""
    linears = _per_expert(rows, inp, projections) | {
        f"experts.{e}.{p}": nvfp4_tensors(rows, inp, seed=100 + 10 * e + k)
        for e in range(EXPERTS, 8)
        for k, p in enumerate(projections)
    }
    read = {
        f"{n}.{part}": t.cuda()
        for n, parts in linears.items()
        for part, t in parts.items()
        if part != "input_scale"
    }
    shape = torch.Size((8, rows * len(projections), inp))
    tensor = stack_bank(read, "experts.bank", BankPlan(8, projections), shape, SPEC, torch.bfloat16)
    expected = tensor.dense()
    monkeypatch.setattr(
        "loralei.modules.quantized.unpack.nvfp4", lambda *a: pytest.fail("the torch path ran")
    )
    out = torch.full(shape, float("nan"), dtype=torch.bfloat16, device="cuda")
    routed = [0, 2, 3, 6, 7]
    CheckpointBank(tensor).dequantize(routed, out)
    assert torch.equal(out[routed].view(torch.int16), expected[routed].view(torch.int16))
    assert out[[1, 4, 5]].isnan().all()
