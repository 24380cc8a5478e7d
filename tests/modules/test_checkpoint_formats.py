"""GPTQ, AWQ and NVFP4 checkpoint weights: unpacked bit for bit as each format defines its value, carried as a
tensor subclass that moves, streams and runs F.linear, and refused with a clear error when config and tensors
disagree."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from checkpoint_quant import (
    awq_reference,
    awq_tensors,
    gptq_reference,
    gptq_tensors,
    nvfp4_reference,
    nvfp4_tensors,
)
from loralei.errors import ConfigError, LoraleiError
from loralei.modules.quantized import as_quantized
from loralei.modules.quantized.checkpoint_checks import TensorMeta, check_linear, spec_of
from loralei.modules.quantized.checkpoint_formats import Dims, QuantSpec
from loralei.modules.quantized.checkpoint_tensor import CheckpointTensor

OUT, IN = 48, 64
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def weight(parts: dict, spec: QuantSpec, dtype: torch.dtype = torch.float32) -> CheckpointTensor:
    return CheckpointTensor(parts, spec, torch.Size((OUT, IN)), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group_size", [16, 32, 64])
@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("zero_offset", [1, 0], ids=["gptq_v1", "gptq_v2"])
def test_gptq_unpacks_to_its_definition_bit_for_bit(dtype, group_size, act_order, zero_offset):
    t = gptq_tensors(OUT, IN, group_size, act_order)
    spec = QuantSpec("gptq", group_size, act_order, zero_offset)
    dense = weight(t, spec, dtype).dense()
    assert dense.dtype == dtype and dense.shape == (OUT, IN) and dense.is_contiguous()
    assert torch.equal(dense, gptq_reference(t, zero_offset, dtype))


def test_gptq_one_group_per_output():
    """group_size -1: one zero point and scale per output for all inputs."""
    t = gptq_tensors(OUT, IN, IN)
    assert torch.equal(
        weight(t, QuantSpec("gptq", -1, False, 1)).dense(), gptq_reference(t, 1, torch.float32)
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group_size", [16, 32, 64])
def test_awq_unpacks_to_its_definition_bit_for_bit(dtype, group_size):
    t = awq_tensors(OUT, IN, group_size)
    assert torch.equal(
        weight(t, QuantSpec("awq", group_size), dtype).dense(), awq_reference(t, group_size, dtype)
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_nvfp4_unpacks_to_its_definition_bit_for_bit(dtype):
    t = nvfp4_tensors(OUT, IN)
    assert torch.equal(weight(t, QuantSpec("nvfp4", 16), dtype).dense(), nvfp4_reference(t, dtype))


def test_nvfp4_codes_read_as_torchao_reads_e2m1():
    """TorchAO's own e2m1 unpacking (low nibble first, its fp4 decoder) gives the same codes' values."""
    kernels = pytest.importorskip("torchao.prototype.mx_formats.kernels")
    t = nvfp4_tensors(OUT, IN)
    values = kernels.f4_unpacked_to_f32(kernels.unpack_uint4(t["weight"].contiguous()))
    blocks = t["weight_scale"].float().repeat_interleave(16, dim=1)
    expected = values * blocks * t["weight_scale_2"]
    assert torch.equal(weight(t, QuantSpec("nvfp4", 16)).dense(), expected)


SPECS = {
    "gptq": (lambda: gptq_tensors(OUT, IN, 32, act_order=True), QuantSpec("gptq", 32, True, 1)),
    "awq": (lambda: awq_tensors(OUT, IN, 32), QuantSpec("awq", 32)),
    "nvfp4": (lambda: nvfp4_tensors(OUT, IN), QuantSpec("nvfp4", 16)),
}


@pytest.mark.parametrize("method", SPECS)
def test_a_checkpoint_weight_is_a_frozen_parameter_that_moves_and_lists_its_tensors(method):
    make, spec = SPECS[method]
    w = weight(make(), spec)
    param = nn.Parameter(w, requires_grad=False)
    assert isinstance(param, CheckpointTensor) and param.shape == (OUT, IN) and param.dtype == torch.float32
    names, context = param.__tensor_flatten__()
    rebuilt = CheckpointTensor.__tensor_unflatten__(
        {n: getattr(param, n) for n in names}, context, param.shape, None
    )
    assert torch.equal(rebuilt.dense(), w.dense())
    linear = nn.Linear(IN, OUT, bias=False, device="meta")
    linear.weight = param
    linear.to("cpu")  # through Module._apply: a wrapper of the same tensors
    assert isinstance(linear.weight, CheckpointTensor) and torch.equal(linear.weight.dense(), w.dense())
    quant = as_quantized(linear.weight)
    assert quant is not None and quant.nbytes == sum(t.numel() * t.element_size() for t in w.parts.values())
    assert torch.equal(quant.dequantize(torch.empty(OUT, IN)), w.dense())


@pytest.mark.parametrize("method", SPECS)
def test_a_linear_holding_one_computes_the_dense_forward_and_input_gradient(method):
    make, spec = SPECS[method]
    w = weight(make(), spec)
    bias = torch.randn(OUT)
    x = torch.randn(5, IN, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    y = F.linear(x, w, bias)
    y_ref = F.linear(x_ref, w.dense(), bias)
    assert torch.equal(y, y_ref)
    dy = torch.randn_like(y)
    y.backward(dy)
    y_ref.backward(dy)
    assert torch.equal(x.grad, x_ref.grad)


def test_other_operations_on_the_codes_are_refused():
    make, spec = SPECS["gptq"]
    with pytest.raises(LoraleiError, match=r"GPTQ checkpoint weight: it holds codes and scales"):
        weight(make(), spec) + 1


# --- bad input ---

SOURCE = "model.name_or_path 'ckpt'"


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ({"quant_method": "gptq", "bits": 8, "group_size": 128}, r"quantization_config.bits=8.*4-bit"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 0}, r"group_size=0.*positive group size or -1"),
        ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, r"checkpoint_format='marlin'"),
        ({"quant_method": "awq", "bits": 4, "version": "gemv"}, r"version='gemv'.*GEMM"),
        ({"quant_method": "awq", "bits": 4, "group_size": -1}, r"group_size=-1.*positive group size;"),
        ({"quant_method": "awq", "bits": 3}, r"bits=3"),
        ({"quant_method": "modelopt", "quant_algo": "FP8"}, r"quant_algo='FP8'.*NVFP4"),
        (
            {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 32},
            r"group_size=32.*blocks of 16",
        ),
    ],
)
def test_a_config_loralei_cannot_read_is_refused_naming_the_field(config, match):
    with pytest.raises(ConfigError, match=match) as err:
        spec_of(config, SOURCE)
    assert str(err.value).startswith(SOURCE)


def test_configs_read_into_specs():
    gptq = {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": 128,
        "desc_act": True,
        "checkpoint_format": "gptq_v2",
    }
    assert spec_of(gptq, SOURCE) == QuantSpec("gptq", 128, True, 0)
    assert spec_of({"quant_method": "gptq", "bits": 4, "format": "gptq"}, SOURCE) == QuantSpec(
        "gptq", 128, False, 1
    )
    assert spec_of({"quant_method": "awq", "bits": 4, "group_size": 64}, SOURCE) == QuantSpec("awq", 64)
    assert spec_of({"quant_method": "modelopt", "quant_algo": "NVFP4"}, SOURCE) == QuantSpec("nvfp4", 16)
    assert spec_of({"quant_method": "bitsandbytes"}, SOURCE) is None and spec_of(None, SOURCE) is None


def metas(t: dict) -> dict[str, TensorMeta]:
    return {name: TensorMeta(tuple(x.shape), x.dtype) for name, x in t.items()}


def test_tensors_that_follow_the_config_pass():
    check_linear(
        SOURCE, "q", QuantSpec("gptq", 32, True, 1), Dims(OUT, IN, 2), metas(gptq_tensors(OUT, IN, 32, True))
    )
    check_linear(SOURCE, "q", QuantSpec("awq", 32), Dims(OUT, IN, 2), metas(awq_tensors(OUT, IN, 32)))
    check_linear(SOURCE, "q", QuantSpec("nvfp4", 16), Dims(OUT, IN, 4), metas(nvfp4_tensors(OUT, IN)))


def test_act_order_without_g_idx_is_refused():
    t = gptq_tensors(OUT, IN, 32)
    del t["g_idx"]
    check_linear(
        SOURCE, "q", QuantSpec("gptq", 32, False, 1), Dims(OUT, IN, 2), metas(t)
    )  # consecutive groups
    with pytest.raises(ConfigError, match=r"GPTQ linear 'q' has no tensor 'g_idx' \(desc_act=true"):
        check_linear(SOURCE, "q", QuantSpec("gptq", 32, True, 1), Dims(OUT, IN, 2), metas(t))


def test_a_group_size_that_does_not_divide_the_inputs_is_refused():
    with pytest.raises(ConfigError, match=r"group_size=24 does not divide its 64 input features"):
        check_linear(SOURCE, "q", QuantSpec("awq", 24), Dims(OUT, IN, 2), metas(awq_tensors(OUT, IN, 32)))


def test_a_config_that_does_not_match_the_tensors_is_refused():
    """The config says groups of 16, the tensors were packed with groups of 32: scales has half the rows."""
    with pytest.raises(
        ConfigError,
        match=r"qzeros is \(2, 6\) torch.int32, but quantization_config \(group_size=16\) makes it \(4, 6\)",
    ):
        check_linear(
            SOURCE, "q", QuantSpec("gptq", 16, False, 1), Dims(OUT, IN, 4), metas(gptq_tensors(OUT, IN, 32))
        )


def test_a_weight_of_the_wrong_dtype_is_refused():
    t = nvfp4_tensors(OUT, IN)
    t["weight_scale"] = t["weight_scale"].float()
    with pytest.raises(ConfigError, match=r"weight_scale is \(48, 4\) torch.float32.*float8_e4m3fn"):
        check_linear(SOURCE, "q", QuantSpec("nvfp4", 16), Dims(OUT, IN, 4), metas(t))


def test_dims_the_packing_cannot_split_are_refused():
    with pytest.raises(ConfigError, match=r"\(44, 64\) weight does not split into AWQ's packed codes"):
        check_linear(SOURCE, "q", QuantSpec("awq", 32), Dims(44, IN, 2), metas(awq_tensors(OUT, IN, 32)))
