"""The DoRA op, the gated MLP with DoRA members and a shared-input group with DoRA members on the GPU in bf16 (the
output-gradient kernel, the MLP kernels with DoRA's column factors, the row-norm kernel) against the fp64 twin:
within the tolerance table of plain DoRA's bf16 error; the row-norm kernel against the torch path's FP32-output
GEMMs at 8B shapes; and the output scaling kernel against torch's passes, bit for bit. GPU only."""

from __future__ import annotations

import pytest
import torch

from loralei.kernels import column_scale, dora_norms
from loralei.ops import reference
from loralei.ops.dora import dora_scale, dora_w, row_norms, squared_row_norms
from loralei.ops.lora_mlp import lora_mlp
from loralei.ops.shared_input import lora_group
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


def _cuda_projection(inp: int, out: int, r: int, seed: int) -> tuple:
    """A bf16 projection on the GPU (fp32 LoRA factors) with a trained-looking fp32 magnitude."""
    w = projection(inp, out, r, False, dtype=torch.bfloat16, lora_dtype=torch.float32, seed=seed)
    w = w._replace(
        W=w.W.to(CUDA), A=w.A.detach().to(CUDA).requires_grad_(), B=w.B.detach().to(CUDA).requires_grad_()
    )
    norms = row_norms(w, squared_row_norms(w))
    m = (norms * (1 + 0.2 * torch.randn(norms.shape, device=CUDA))).requires_grad_()
    return w, m


def _compare(fused_fn, plain_fn, ws, mags, x) -> None:
    """``fused_fn`` in bf16 within the table of ``plain_fn``'s bf16 error, both against ``plain_fn`` in fp64."""
    params = [p for w in ws for p in (w.A, w.B)] + list(mags)
    ws64 = [as_dtype(w, torch.float64) for w in ws]
    mags64 = [m.detach().double().requires_grad_() for m in mags]
    fused = outputs_and_grads(lambda t: fused_fn(t, ws, mags), x, params)
    plain = outputs_and_grads(lambda t: plain_fn(t, ws, mags), x, params)
    params64 = [p for w in ws64 for p in (w.A, w.B)] + mags64
    expected = outputs_and_grads(lambda t: plain_fn(t, ws64, mags64), x.double(), params64)
    for k, (f, p, e) in enumerate(zip(fused, plain, expected, strict=True)):
        assert_low_precision_close(f, p, e, torch.bfloat16, f"output/grad {k}")


def _scales(ws, mags) -> list:
    return [dora_scale(w, m, squared_row_norms(w)) for w, m in zip(ws, mags, strict=True)]


def test_mlp_kernels_with_dora_bf16_within_the_table() -> None:
    """The MLP kernels with DoRA's column factors (compiled, autotuned) at a small Llama-like shape."""
    (gate, m_g), (up, m_u), (down, m_d) = (
        _cuda_projection(i, o, 16, k) for k, (i, o) in enumerate([(512, 1408), (512, 1408), (1408, 512)])
    )

    def fused(t, ws, mags):
        return [lora_mlp(t, *ws, "silu", scales=tuple(_scales(ws, mags)))]

    def plain(t, ws, mags):
        g, u = (reference.dora_linear(t, w, m) for w, m in zip(ws[:2], mags[:2], strict=True))
        return [reference.dora_linear(reference.gated_activation(g, u, "silu"), ws[2], mags[2])]

    x = torch.randn(2, 300, 512, device=CUDA, dtype=torch.bfloat16)
    _compare(fused, plain, [gate, up, down], [m_g, m_u, m_d], x)


def test_group_with_dora_bf16_within_the_table() -> None:
    """q/k/v-like DoRA members in one shared-input group (the output-gradient kernel per member)."""
    pairs = [_cuda_projection(512, o, 16, k) for k, o in enumerate([512, 128, 128])]
    ws, mags = [w for w, _ in pairs], [m for _, m in pairs]

    def fused(t, ws, mags):
        return list(lora_group(t, ws, scales=_scales(ws, mags)))

    def plain(t, ws, mags):
        return [reference.dora_linear(t, w, m) for w, m in zip(ws, mags, strict=True)]

    _compare(fused, plain, ws, mags, torch.randn(2, 300, 512, device=CUDA, dtype=torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("bias", [None, "same", "fp32"])
def test_column_scale_is_torch_bit_for_bit(dtype: torch.dtype, bias: str | None) -> None:
    """The output scaling kernel gives torch's ``mul_`` (then ``add_``) values exactly, an FP32 output with a bias
    included (compiled without FMA contraction), on a column slice of a wider buffer."""
    g = torch.Generator(device=CUDA).manual_seed(0)
    z = (3 * torch.randn(1000, 1100, device=CUDA, generator=g)).to(dtype)[:, 7:1031]
    factors = 1 + 0.3 * torch.randn(1024, device=CUDA, generator=g)
    b = torch.randn(1024, device=CUDA, generator=g)
    b = None if bias is None else b.to(dtype if bias == "same" else torch.float32)
    want = z.clone().mul_(factors)
    if b is not None:
        want.add_(b)
    assert column_scale.usable(z, factors, b)
    assert torch.equal(column_scale.scale_columns_(z, factors, b), want)


@pytest.mark.parametrize(("inp", "out"), [(4096, 1024), (4096, 14336), (14336, 4096)])
@pytest.mark.parametrize("lora_dtype", [torch.bfloat16, torch.float32])
def test_row_norm_kernel_matches_the_torch_path(
    inp: int, out: int, lora_dtype: torch.dtype, monkeypatch
) -> None:
    """The compiled kernel (bf16 W Aᵀ on tensor cores, FP32 after) against the torch path's FP32-output GEMMs and
    FP32 passes: the same values up to FP32 summation order."""
    w, _ = _cuda_projection(inp, out, 16, seed=inp + out)
    w = w._replace(A=w.A.detach().to(lora_dtype), B=(10 * w.B.detach()).to(lora_dtype))  # a trained-looking B
    w_sq = squared_row_norms(w)
    assert dora_norms.usable(w.W, w.A, w.B, w_sq)
    norms = row_norms(w, w_sq)
    monkeypatch.setattr(dora_norms, "usable", lambda *a: False)
    want = row_norms(w, w_sq)
    assert norms.dtype == want.dtype == torch.float32
    torch.testing.assert_close(norms, want, rtol=1e-5, atol=0)
