"""The quantized-base implementations (NF4 and FP8 via TorchAO, bitsandbytes 4-bit) through their common
protocol."""

from __future__ import annotations

import pytest
import torch

from loralei import LoRAConfig, LoraleiError
from loralei.errors import InjectionError
from loralei.modules.quantized import as_quantized, fp8, quantize_weight
from loralei.modules.quantized.buffers import release_buffers, shared_buffer
from loralei.modules.quantized.fp8 import FP8Weight, quantize_fp8
from loralei.modules.quantized.fp8_gemm import check_fp8_shape, fp8_grad_mm, fp8_mm, quantize_rows
from loralei.modules.quantized.nf4 import NF4Weight, quantize_nf4
from loralei.ops.weights import QuantizedWeight
from tolerances import E4M3_REL, E4M3_SUBNORMAL_ABS, assert_fp32_close, rel_err

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


def _fp8(out: int = 48, inp: int = 64, dtype: torch.dtype = torch.float32) -> FP8Weight:
    g = torch.Generator().manual_seed(0)
    return FP8Weight(quantize_fp8(torch.randn(out, inp, generator=g).to(dtype)), "emulated")


@pytest.mark.parametrize("quantized", [_nf4, _fp8], ids=["nf4", "fp8"])
def test_products_equal_dense_products_and_accumulate(quantized) -> None:
    q = quantized()
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


def _fp8_test_weight(out: int, inp: int, dtype: torch.dtype) -> torch.Tensor:
    """Gaussian rows whose magnitudes span 2^-12 to 2^12 (2^-4 to 2^4 in fp16; each row gets its own scale), one
    all-zero row, and in each row a column 2^-14 times smaller: e4m3 subnormals next to the row's maximum."""
    g = torch.Generator().manual_seed(out * inp)
    span = 4 if dtype == torch.float16 else 12
    w = torch.randn(out, inp, generator=g) * 2.0 ** torch.linspace(-span, span, out).unsqueeze(1)
    w[1] = 0
    w[:, 0] *= 2.0**-14  # far below amax/448 · 2^-6: e4m3 subnormals
    return w.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("out", "inp"), [(48, 64), (33, 70), (7, 1000)])
def test_fp8_per_row_scales_and_round_trip_error_bound(out: int, inp: int, dtype: torch.dtype) -> None:
    dense = _fp8_test_weight(out, inp, dtype)
    q = FP8Weight(quantize_fp8(dense), "emulated")
    assert isinstance(q, QuantizedWeight) and q.dtype == dtype and q.shape == dense.shape
    codes, scale = q.tensor.qdata, q.tensor.scale
    assert codes.dtype == torch.float8_e4m3fn and codes.shape == dense.shape
    assert scale.dtype == torch.float32 and scale.shape == (out, 1)
    amax = dense.float().abs().amax(dim=1, keepdim=True)
    assert torch.equal(scale, torch.where(amax > 0, amax / 448, 1.0))  # all-zero row: scale 1, codes 0
    assert q.nbytes == out * inp + 4 * out
    got = q.dequantize()
    assert got.dtype == dtype and torch.equal(got, q.tensor.dequantize())  # TorchAO's own dequantization
    err = (got.double() - dense.double()).abs()
    # the issue's per-row bound: e4m3's relative rounding error 2^-4 at the row's full range (448 · scale)
    assert (err <= scale.double() * 448 * E4M3_REL).all()
    # element-wise: the e4m3 rounding (relative where normal, absolute below), then the cast to ``dtype``
    bound = E4M3_REL * dense.double().abs() + E4M3_SUBNORMAL_ABS * scale.double()
    bound += torch.finfo(dtype).eps * got.double().abs() + 2.0**-20 * scale.double()
    assert (err <= bound).all(), float((err - bound).max())
    assert torch.equal(got[1], torch.zeros(inp, dtype=dtype))


def test_fp8_codes_are_torchaos_per_row_float8_codes() -> None:
    """For an FP32 weight without zero rows loralei's recipe is TorchAO's ``Float8Tensor.from_hp(PerRow())``."""
    from torchao.quantization import Float8Tensor, PerRow

    dense = _fp8_test_weight(32, 48, torch.float32)[2:]
    ours, theirs = quantize_fp8(dense), Float8Tensor.from_hp(dense, granularity=PerRow())
    assert torch.equal(ours.scale, theirs.scale)
    assert torch.equal(ours.qdata.view(torch.uint8), theirs.qdata.view(torch.uint8))


def test_fp8_auto_kernel_off_an_fp8_gpu_is_a_clear_error_at_use() -> None:
    """A model injected on an FP8-capable GPU and then moved to the CPU: the products say what to do;
    dequantizing (merging) still works."""
    if torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9):
        pytest.skip("this machine has an FP8-capable GPU")
    q = FP8Weight(quantize_fp8(torch.randn(16, 32)), "auto")
    for product in (lambda: q.mm(torch.randn(2, 32)), lambda: q.grad_mm(torch.randn(2, 16))):
        with pytest.raises(LoraleiError) as err:
            product()
        message = str(err.value)
        assert message.startswith(
            "fp8_kernel='auto' runs FP8 GEMMs, which need a CUDA GPU of compute capability >= 8.9"
        )
        assert "the weight is on cpu: set fp8_kernel='emulated'" in message
    assert q.dequantize().shape == (16, 32)


def test_as_quantized_sees_fp8_with_its_kernel() -> None:
    config = LoRAConfig(quantize_base=True, quantization_type="fp8", fp8_kernel="emulated")
    param = quantize_weight(torch.randn(16, 32, dtype=torch.bfloat16), config)
    assert not param.requires_grad and param.dtype == torch.bfloat16
    q = as_quantized(param, config)
    assert isinstance(q, FP8Weight) and q.kernel == "emulated" and "emulated" in q.backend
    assert as_quantized(param).kernel == "auto"


@pytest.mark.parametrize(
    ("capability", "refused"), [((8, 0), True), ((8, 6), True), ((8, 9), False), ((9, 0), False)]
)
def test_fp8_auto_kernel_needs_compute_capability_8_9(monkeypatch, capability, refused: bool) -> None:
    from loralei.modules.quantized import fp8

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    problem = fp8._fp8_kernel_problem(torch.device("cuda:0"), "auto")
    if refused:
        assert (
            f"but the weight is on cuda:0, of compute capability {capability[0]}.{capability[1]}" in problem
        )
    else:
        assert problem is None
    assert fp8._fp8_kernel_problem(torch.device("cuda:0"), "emulated") is None


def test_an_fp8_weight_with_block_scales_is_refused() -> None:
    """Only per-row scales are computed with: a block-wise Float8Tensor (as some FP8 checkpoints hold) is named,
    not dequantized wrong."""
    per_row = quantize_fp8(torch.randn(16, 32))
    blocks = type(per_row)(per_row.qdata, torch.ones(2, 2), block_size=[8, 16], dtype=per_row.dtype)
    with pytest.raises(
        LoraleiError, match=r"scales \(2, 2\): loralei computes with one scale per output row"
    ):
        FP8Weight(blocks)


def _exact(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """What e4m3 codes and their row scales stand for, in fp64."""
    return codes.double() * scales.double()


def _multiply_the_quantized_operands(rows: int, dtype: torch.dtype, device: torch.device) -> None:
    g = torch.Generator().manual_seed(rows)
    codes, scales = (t.to(device) for t in quantize_rows(torch.randn(48, 64, generator=g)))
    x, dy = (torch.randn(rows, n, generator=g).to(device, dtype) for n in (64, 48))
    y, dx = fp8_mm(x, codes, scales), fp8_grad_mm([dy], [codes], [scales])
    assert y.dtype == dx.dtype == dtype and y.shape == (rows, 48) and dx.shape == (rows, 64)
    want_y = _exact(*quantize_rows(x)) @ _exact(codes, scales).t()
    want_dx = _exact(*quantize_rows(dy.float() * scales.t())) @ codes.double()
    # the CUDA GEMM writes bf16 (row-wise scaling takes no other output type)
    exact = dtype == torch.float32 and device.type == "cpu"
    tol = {"rtol": 1e-5, "atol": 1e-5} if exact else {"rtol": 2**-8, "atol": 1e-2}
    torch.testing.assert_close(y.double(), want_y, **tol)
    torch.testing.assert_close(dx.double(), want_dx, **tol)
    y, dx, x, dy = (t.cpu() for t in (y, dx, x, dy))
    codes, scales = codes.cpu(), scales.cpu()
    dense = _exact(codes, scales)
    assert 0 < rel_err(y, x.double() @ dense.t()) <= E4M3_REL
    assert 0 < rel_err(dx, dy.double() @ dense) <= E4M3_REL


@pytest.mark.parametrize("rows", [5, 16, 37])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_gemms_multiply_the_quantized_operands(rows: int, dtype: torch.dtype) -> None:
    """torch._scaled_mm's products equal the fp64 products of the e4m3 operands they are given (activation rows
    quantized per token, W's codes and scales; for dY W, W's scales folded into dY), whatever the row count
    (padded to 16); and they sit within e4m3's rounding of the activations from the dense products."""
    _multiply_the_quantized_operands(rows, dtype, torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [5, 8192])
def test_fp8_gemms_multiply_the_quantized_operands_on_an_fp8_gpu(rows: int) -> None:
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 GEMMs need compute capability >= 8.9")
    _multiply_the_quantized_operands(rows, torch.bfloat16, torch.device("cuda"))


def test_fp8_gemms_accumulate_into_out() -> None:
    codes, scales = quantize_rows(torch.randn(32, 16))
    x, dy = torch.randn(7, 16), torch.randn(7, 32)
    out_y, out_dx = torch.ones(7, 32), torch.ones(7, 16)
    assert fp8_mm(x, codes, scales, out_y) is out_y and fp8_grad_mm([dy], [codes], [scales], out_dx) is out_dx
    torch.testing.assert_close(out_y, 1 + fp8_mm(x, codes, scales))
    torch.testing.assert_close(out_dx, 1 + fp8_grad_mm([dy], [codes], [scales]))


def test_fp8_auto_kernel_runs_the_fp8_gemms(monkeypatch) -> None:
    """On an FP8 GPU (faked here: torch._scaled_mm also runs on the CPU) the products are the FP8 GEMMs."""
    monkeypatch.setattr(fp8, "_fp8_kernel_problem", lambda device, kernel: None)
    q = FP8Weight(quantize_fp8(torch.randn(48, 64)), "auto")
    x, dy = torch.randn(5, 64), torch.randn(5, 48)
    assert torch.equal(q.mm(x), fp8_mm(x, q.tensor.qdata, q.tensor.scale))
    assert torch.equal(q.grad_mm(dy), fp8_grad_mm([dy], [q.tensor.qdata], [q.tensor.scale]))
    assert "FP8 GEMMs (torch._scaled_mm)" in q.backend


def test_fp8_gemms_need_dimensions_divisible_by_16() -> None:
    check_fp8_shape("m", torch.Size((48, 64)))
    with pytest.raises(
        InjectionError, match=r"module 'm': weight \(48, 40\) has a dimension that is not a multiple"
    ):
        check_fp8_shape("m", torch.Size((48, 40)))


def test_fp8_gemms_quantize_a_shared_input_once(monkeypatch) -> None:
    """q/k/v (or gate/up) read one X: the second and third products reuse its e4m3 codes; an X changed in place,
    or another tensor, is quantized again."""
    from loralei.modules.quantized import fp8_gemm

    calls = []
    quantize = fp8_gemm.quantize_rows
    monkeypatch.setattr(fp8_gemm, "quantize_rows", lambda t: calls.append(t.shape) or quantize(t))
    weights = [quantize(torch.randn(out, 32)) for out in (32, 16, 16)]
    x = torch.randn(8, 32)
    first = [fp8_mm(x, *w) for w in weights]
    assert len(calls) == 1
    x.mul_(2.0)  # changed in place: its codes are stale
    second = [fp8_mm(x, *w) for w in weights]
    assert len(calls) == 2 and all(
        torch.allclose(b, 2 * a, rtol=0.1) for a, b in zip(first, second, strict=True)
    )
    fp8_mm(x.clone(), *weights[0])
    assert len(calls) == 3


def test_fp8_joint_input_gradient_is_one_product_of_the_concatenation(monkeypatch) -> None:
    """A shared-input group's ``Σ dY_i W_i`` is one FP8 GEMM of ``[dY_i]`` (one row scale over all members)
    and ``[W_i]``, within e4m3's rounding of the dense sum; FP8 bases write fresh products (no accumulation),
    emulated ones accumulate; groups that cannot be one product are declined."""
    monkeypatch.setattr(fp8, "_fp8_kernel_problem", lambda device, kernel: None)
    g = torch.Generator().manual_seed(3)
    ws = [FP8Weight(quantize_fp8(torch.randn(out, 64, generator=g)), "auto") for out in (48, 16, 32)]
    dys = [torch.randn(21, w.shape[0], generator=g) for w in ws]
    joint = ws[0].joint_grad_mm(dys, ws[1:])
    codes = torch.cat([w.tensor.qdata.view(torch.uint8) for w in ws]).view(torch.float8_e4m3fn)
    scales = torch.cat([w.tensor.scale for w in ws])
    assert torch.equal(joint, fp8_grad_mm([torch.cat(dys, 1)], [codes], [scales]))
    dense = sum(dy.double() @ w.dequantize().double() for dy, w in zip(dys, ws, strict=True))
    assert 0 < rel_err(joint, dense) <= E4M3_REL
    assert not ws[0].accumulates and FP8Weight(ws[0].tensor, "emulated").accumulates
    emulated, narrow = (
        FP8Weight(ws[1].tensor, "emulated"),
        FP8Weight(quantize_fp8(torch.randn(16, 32)), "auto"),
    )
    four = [FP8Weight(w.tensor, "auto") for w in (*ws, ws[0])]
    assert ws[0].joint_grad_mm(dys[:2], [emulated]) is None
    assert ws[0].joint_grad_mm([dys[0], dys[1]], [narrow]) is None, "input widths differ"
    assert four[0].joint_grad_mm([*dys, dys[0]], four[1:]) is None, "more members than the kernel takes"
