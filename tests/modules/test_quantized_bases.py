"""The quantized-base implementations (NF4 and FP8 via TorchAO, FP8 with per-row or 128x128 block scales,
bitsandbytes 4-bit) through their common protocol."""

from __future__ import annotations

import pytest
import torch

from loralei import LoRAConfig, LoraleiError
from loralei.errors import InjectionError
from loralei.modules.quantized import as_quantized, fp8, fp8_blocks, quantize_weight
from loralei.modules.quantized.buffers import release_buffers, shared_buffer
from loralei.modules.quantized.fp8 import FP8Weight, float8_tensor, quantize_fp8
from loralei.modules.quantized.fp8_blocks import block_gemm_problem, block_grad_mm, block_mm, quantize_groups
from loralei.modules.quantized.fp8_gemm import check_fp8_shape, fp8_grad_mm, fp8_mm, quantize_rows
from loralei.modules.quantized.nf4 import NF4Weight, quantize_nf4
from loralei.ops.weights import QuantizedWeight
from tiny_models import fp8_checkpoint_weight
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


def _fp8_blocks(out: int = 48, inp: int = 64, dtype: torch.dtype = torch.float32, kernel: str = "emulated"):
    """An FP8Weight of a fine-grained FP8 checkpoint's codes and 128x128 block scales (Transformers' quantizer)."""
    g = torch.Generator().manual_seed(out + inp)
    codes, scales = fp8_checkpoint_weight(torch.randn(out, inp, generator=g))
    return FP8Weight(float8_tensor()(codes, scales, block_size=[128, 128], dtype=dtype), kernel)


@pytest.mark.parametrize("quantized", [_nf4, _fp8, _fp8_blocks], ids=["nf4", "fp8", "fp8_blocks"])
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
    """Only per-row and 128x128 block scales are computed with: a Float8Tensor with other blocks is named, not
    dequantized wrong."""
    per_row = quantize_fp8(torch.randn(16, 32))
    blocks = type(per_row)(per_row.qdata, torch.ones(2, 2), block_size=[8, 16], dtype=per_row.dtype)
    with pytest.raises(
        LoraleiError, match=r"scales \(2, 2\): loralei computes with one scale per output row"
    ):
        FP8Weight(blocks)


@pytest.mark.parametrize(
    "scales",
    [torch.ones(2, 2), torch.ones(1, 1), torch.ones(2, 3, dtype=torch.float64)],
    ids=["grid", "few", "fp64"],
)
def test_fp8_block_scales_of_another_grid_or_dtype_are_refused(scales: torch.Tensor) -> None:
    codes = torch.zeros(200, 330, dtype=torch.float8_e4m3fn)
    with pytest.raises(LoraleiError) as err:
        FP8Weight(float8_tensor()(codes, scales, block_size=[128, 128], dtype=torch.bfloat16))
    message = str(err.value)
    assert f"an FP8 base weight (200, 330) with scales {tuple(scales.shape)}: loralei computes" in message
    assert (
        "or one per 128x128 block (2, 3) only, in float32 (this weight's block size is [128, 128], its scales "
        f"{scales.dtype})" in message
    )


def _exact(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """What e4m3 codes and their row scales stand for, in fp64."""
    return codes.double() * scales.double()


def _multiply_the_quantized_operands(rows: int, dtype: torch.dtype, device: torch.device) -> None:
    g = torch.Generator().manual_seed(rows)
    codes, scales = (t.to(device) for t in quantize_rows(torch.randn(48, 64, generator=g)))
    x, dy = (torch.randn(rows, n, generator=g).to(device, dtype) for n in (64, 48))
    y, dx = fp8_mm(x, codes, scales), fp8_grad_mm([dy], [codes], [scales])
    assert y.dtype == dx.dtype == dtype and y.shape == (rows, 48) and dx.shape == (rows, 64)
    want_y = _exact(*quantize_rows(x, reciprocal=True)) @ _exact(codes, scales).t()
    want_dx = _exact(*quantize_rows(dy.float() * scales.t(), reciprocal=True)) @ codes.double()
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


@pytest.mark.gpu
def test_fp8_fast_accumulation_stays_within_bf16_rounding_of_fp32_accumulation_on_an_fp8_gpu() -> None:
    """The forward's fast accumulation (``fp8_fast_accum``) over the 8B shape's widest reduction (14,336, down's)
    and a 4096 one: the bf16 outputs differ from FP32 accumulation's by less than bf16's own rounding, norm-wise."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 GEMMs need compute capability >= 8.9")
    g = torch.Generator().manual_seed(0)
    for k in (4096, 14336):
        codes, scales = (t.cuda() for t in quantize_rows(torch.randn(4096, k, generator=g) / k**0.5))
        x = torch.randn(1024, k, generator=g).cuda().bfloat16()
        fast, fp32 = (fp8_mm(x, codes, scales, fast_accum=f) for f in (True, False))
        assert 0 < rel_err(fast, fp32.double()) < 2**-8


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


@pytest.mark.parametrize("fast_accum", [True, False])
def test_fp8_forward_gemm_accumulates_as_configured_and_the_input_gradient_in_fp32(
    monkeypatch, fast_accum: bool
) -> None:
    """``fp8_fast_accum`` (default on) reaches the forward product's ``_scaled_mm`` only: the input gradient
    (alone or a shared-input group's joint one) keeps FP32 accumulation."""
    monkeypatch.setattr(fp8, "_fp8_kernel_problem", lambda device, kernel: None)
    calls = []
    scaled_mm = torch._scaled_mm
    monkeypatch.setattr(
        torch, "_scaled_mm", lambda *a, **kw: calls.append(kw["use_fast_accum"]) or scaled_mm(*a, **kw)
    )
    config = LoRAConfig(quantize_base=True, quantization_type="fp8", fp8_fast_accum=fast_accum)
    assert LoRAConfig(quantize_base=True, quantization_type="fp8").fp8_fast_accum  # the default
    q, k = (as_quantized(quantize_weight(torch.randn(48, 64), config), config) for _ in range(2))
    x, dy = torch.randn(5, 64), torch.randn(5, 48)
    q.mm(x), q.grad_mm(dy), q.joint_grad_mm([dy, dy], [k])
    assert calls == [fast_accum, False, False]
    assert ("fast accumulation forward" if fast_accum else "FP32 accumulation") in q.backend


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
    monkeypatch.setattr(fp8_gemm, "quantize_rows", lambda t, **kw: calls.append(t.shape) or quantize(t, **kw))
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


def _block_reference(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """What e4m3 codes and their 128x128 block scales stand for, in fp64 (each code times its block's scale)."""
    expanded = scales.double().repeat_interleave(128, 0).repeat_interleave(128, 1)
    return codes.double() * expanded[: codes.shape[0], : codes.shape[1]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("out", "inp"), [(256, 384), (320, 256), (200, 330), (48, 64)])
def test_fp8_block_scales_dequantize_each_code_with_its_blocks_scale(
    out: int, inp: int, dtype: torch.dtype
) -> None:
    """Whole and partial 128x128 blocks (the last block of a dimension that is not a multiple of 128): each code
    times its block's scale, in FP32, rounded once to ``dtype`` (TorchAO's values where it takes the shape), and
    within e4m3's rounding of the dense weight."""
    g = torch.Generator().manual_seed(out * inp)
    dense = torch.randn(out, inp, generator=g) * 2.0 ** torch.linspace(-8, 8, out).unsqueeze(1)
    dense = dense.to(dtype)
    codes, scales = fp8_checkpoint_weight(dense.float())
    q = FP8Weight(float8_tensor()(codes, scales, block_size=[128, 128], dtype=dtype), "emulated")
    assert isinstance(q, QuantizedWeight) and q.shape == dense.shape and q.dtype == dtype and not q.per_row
    assert q.nbytes == out * inp + 4 * scales.numel() and scales.shape == (-(-out // 128), -(-inp // 128))
    got = q.dequantize()
    assert got.dtype == dtype and torch.equal(got, _block_reference(codes, scales).to(dtype))
    if out % 128 == 0 and inp % 128 == 0:  # TorchAO dequantizes whole blocks only
        assert torch.equal(got, q.tensor.dequantize())
    block_amax = scales.double().repeat_interleave(128, 0).repeat_interleave(128, 1)[:out, :inp] * 448
    assert ((got.double() - dense.double()).abs() <= block_amax * E4M3_REL + got.double().abs() * 2**-7).all()


def test_fp8_block_and_row_scales_share_one_implementation_but_say_which() -> None:
    rows, blocks = _fp8(), _fp8_blocks()
    assert rows.per_row and rows.block == (1, 64) and blocks.block == (128, 128)
    assert "per-row scales), emulated" in rows.backend
    assert blocks.backend == (
        "FP8 e4m3 (128x128 block scales), emulated: dequantized into a shared buffer for dense GEMMs"
    )


def test_fp8_block_scales_under_auto_run_the_dequantize_backend_where_block_gemms_do_not(monkeypatch) -> None:
    """Off a compute capability 9.x GPU (or on a weight of partial blocks) fp8_kernel='auto' cannot run the
    block-scaled GEMMs: the products are the dequantize backend's (not an error: a checkpoint's weights come in
    FP8 whatever the machine), and the backend says why."""
    q = _fp8_blocks(256, 384, kernel="auto")
    x, dy = torch.randn(5, 384), torch.randn(5, 256)
    w = q.dequantize()
    assert torch.equal(q.mm(x), x @ w.t()) and torch.equal(q.grad_mm(dy), dy @ w) and q.accumulates
    if block_gemm_problem(q.shape, q.device) is not None:
        assert q.backend == (
            "FP8 e4m3 (128x128 block scales), dequantized into a shared buffer for dense GEMMs (fp8_kernel='auto', "
            "but block-scaled FP8 GEMMs run on CUDA GPUs of compute capability 9.x only, and the weight is on cpu)"
        )
    monkeypatch.setattr(fp8_blocks, "_device_problem", lambda device: None)
    assert "(fp8_kernel='auto', but weight (320, 256) is not made of whole 128x128 blocks)" in (
        _fp8_blocks(320, 256, kernel="auto").backend
    )


def test_fp8_block_scales_under_auto_run_the_block_gemms_where_they_run(monkeypatch) -> None:
    """Where the block-scaled GEMMs run (faked: they need a compute capability 9.x GPU) both products are theirs,
    given the stored codes and scales as they are."""
    monkeypatch.setattr(fp8_blocks, "_device_problem", lambda device: None)
    calls = []
    gemms = fp8._Gemms(*(lambda *a, name=n: calls.append((name, a)) or a[0] for n in ("mm", "grad_mm")))
    monkeypatch.setattr(fp8, "_BLOCK_GEMMS", gemms)
    q = _fp8_blocks(256, 384, kernel="auto")
    x, dy = torch.randn(5, 384), torch.randn(5, 256)
    q.mm(x), q.grad_mm(dy)
    assert [name for name, _ in calls] == ["mm", "grad_mm"]
    for (_, args), first in zip(calls, (x, dy), strict=True):
        assert args[0] is first and args[1] is q.tensor.qdata and args[2] is q.tensor.scale
    assert q.backend == (
        "FP8 e4m3 (128x128 block scales): FP8 GEMMs (torch.nn.functional.scaled_mm) with 1x128 activation scales"
    )
    assert not q.accumulates  # the GEMMs write a new product
    monkeypatch.setattr(fp8, "_fp8_kernel_problem", lambda device, kernel: None)
    rows = FP8Weight(quantize_fp8(torch.randn(16, 384)), "auto")
    # a shared-input group's joint input gradient is per-row only: block-scaled members multiply one by one
    assert q.joint_grad_mm([dy, torch.randn(5, 16)], [rows]) is None
    assert rows.joint_grad_mm([torch.randn(5, 16), dy], [q]) is None


def test_activation_groups_are_quantized_as_rows_of_128() -> None:
    """The 1x128 activation recipe is the per-row one applied to each run of 128 columns (all-zero groups: scale
    1, codes 0)."""
    x = torch.randn(7, 384) * 2.0 ** torch.linspace(-6, 6, 384)
    x[2, 128:256] = 0
    codes, scales = quantize_groups(x)
    row_codes, row_scales = quantize_rows(x.reshape(-1, 128))
    assert codes.shape == x.shape and scales.shape == (7, 3) and scales[2, 1] == 1
    assert torch.equal(scales, row_scales.reshape(7, 3))
    assert torch.equal(codes.view(torch.uint8), row_codes.reshape(7, 384).view(torch.uint8))


@pytest.mark.parametrize(("out", "inp", "rows"), [(256, 384, 5), (384, 640, 37), (128, 128, 16)])
def test_block_gemm_operands_have_the_layouts_scaled_mm_checks(out: int, inp: int, rows: int) -> None:
    """On meta tensors torch's own shape and stride checks of the 1x128 x 128x128 recipe run on any machine: the
    activation scales column-major, the weight scales' block columns padded to 4 (both products)."""
    meta = torch.device("meta")
    codes = torch.empty(out, inp, dtype=torch.float8_e4m3fn, device=meta)
    scales = torch.empty(out // 128, inp // 128, device=meta)
    x, dy = (torch.empty(rows, n, dtype=torch.bfloat16, device=meta) for n in (inp, out))
    assert block_mm(x, codes, scales).shape == (rows, out)
    assert block_grad_mm(dy, codes, scales).shape == (rows, inp)


def _block_gemms_multiply_the_quantized_operands(rows: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(rows)
    codes, scales = fp8_checkpoint_weight(torch.randn(384, 256, generator=g))
    x, dy = (torch.randn(rows, n, generator=g).to(dtype) for n in (256, 384))
    cuda = torch.device("cuda")
    y = block_mm(x.to(cuda), codes.to(cuda), scales.to(cuda)).cpu()
    dx = block_grad_mm(dy.to(cuda), codes.to(cuda), scales.to(cuda)).cpu()
    assert y.dtype == dx.dtype == dtype and y.shape == (rows, 384) and dx.shape == (rows, 256)
    dense = _block_reference(codes, scales)
    x_codes, x_scales = quantize_groups(x)
    dy_codes, dy_scales = quantize_groups(dy)
    want_y = _block_reference_rows(x_codes, x_scales) @ dense.t()
    want_dx = _block_reference_rows(dy_codes, dy_scales) @ dense
    # cuBLAS adds up the e4m3 products of each 128-deep block in reduced precision: norm-wise 1.3e-4 with FP32
    # output, 1.7e-3 with bf16, measured on an H200 (a scale applied to the wrong block gives errors near 1)
    bound = 1e-3 if dtype == torch.float32 else 4e-3
    assert rel_err(y, want_y) <= bound and rel_err(dx, want_dx) <= bound
    assert 0 < rel_err(y, x.double() @ dense.t()) <= E4M3_REL
    assert 0 < rel_err(dx, dy.double() @ dense) <= E4M3_REL


def _block_reference_rows(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """What e4m3 codes and their 1x128 scales stand for, in fp64."""
    return codes.double() * scales.double().repeat_interleave(128, 1)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [5, 8192])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_gemms_multiply_the_quantized_operands_on_a_hopper_gpu(rows: int, dtype: torch.dtype) -> None:
    """F.scaled_mm's 1x128 x 128x128 products are the fp64 products of the e4m3 operands they are given, to the
    GEMM's accumulation (activations and output gradients quantized per row and 128 columns, the weight's codes
    and block scales), with non-square block grids (3 x 2) whose block columns need padding (2 and 3 to 4), so a
    transposed or unpadded scale layout cannot pass."""
    problem = block_gemm_problem(torch.Size((384, 256)), torch.device("cuda"))
    if problem is not None:
        pytest.skip(problem)
    _block_gemms_multiply_the_quantized_operands(rows, dtype)
