"""DoRA's row-norm kernel (Triton interpreter, fp32 and fp16 bases) against the definition ``‖W + s B A‖_row`` in
fp64 and against the torch path of ``ops.dora.row_norms``: odd shapes, ranks that are not powers of two, strided
operands, FP32 factors on a narrower base; where it declines; and the DoRA op launching it."""

from __future__ import annotations

import pytest
import torch

from loralei.kernels import dora_norms
from loralei.ops import dora
from loralei.ops.weights import LoRAWeights
from op_cases import outputs_and_grads, projection
from tolerances import assert_fp32_close


@pytest.fixture
def looping_interpreter(interpret) -> None:
    from loralei.kernels import gated_mlp

    if not gated_mlp.interpreter_runs_loops():
        pytest.skip("this Triton's interpreter cannot run loops with run-time bounds")


# (out, in, r, base dtype, factor dtype)
CASES = [
    (45, 70, 4, torch.float32, torch.float32),
    (100, 33, 16, torch.float16, torch.float32),
    (17, 130, 24, torch.float32, torch.float32),
    (64, 64, 1, torch.float16, torch.float16),
    (33, 40, 128, torch.float32, torch.float32),
]


def _weights(n_out: int, n_in: int, r: int, dtype: torch.dtype, lora_dtype: torch.dtype) -> LoRAWeights:
    """W as a column slice of a wider buffer (row stride > in), B likewise; trained-looking (non-zero) B."""
    g = torch.Generator().manual_seed(n_out * n_in + r)
    w = torch.randn(n_out, n_in + 3, generator=g).to(dtype)[:, 1 : 1 + n_in]
    a = (torch.randn(r, n_in, generator=g) / n_in**0.5).to(lora_dtype)
    b = (torch.randn(n_out, r + 2, generator=g) / r**0.5).to(lora_dtype)[:, :r]
    return LoRAWeights(W=w, quant=None, A=a, B=b, scale=1.7, dropout_p=0.0, bias=None)


def _torch_path(w: LoRAWeights, w_sq: torch.Tensor, monkeypatch: pytest.MonkeyPatch) -> torch.Tensor:
    with monkeypatch.context() as patch:
        patch.setattr(dora_norms, "usable", lambda *a: False)
        return dora.row_norms(w, w_sq)


@pytest.mark.usefixtures("looping_interpreter")
@pytest.mark.parametrize(("n_out", "n_in", "r", "dtype", "lora_dtype"), CASES)
def test_kernel_matches_the_definition_and_the_torch_path(
    n_out: int, n_in: int, r: int, dtype: torch.dtype, lora_dtype: torch.dtype, monkeypatch
) -> None:
    w = _weights(n_out, n_in, r, dtype, lora_dtype)
    w_sq = dora.squared_row_norms(w)
    assert dora_norms.usable(w.W, w.A, w.B, w_sq)
    launched = []
    original = dora_norms.row_norms
    monkeypatch.setattr(dora_norms, "row_norms", lambda *a: launched.append(1) or original(*a))
    norms = dora.row_norms(w, w_sq)
    assert launched and norms.dtype == torch.float32 and norms.shape == (n_out,)
    # W Aᵀ takes A rounded to W's dtype, the B A A^T B^T term A in full: the definition, term by term, in fp64
    a_w, a64, b64 = w.A.to(dtype).double(), w.A.double(), w.B.double()
    want = w.W.double().square().sum(1) + 2 * w.scale * ((w.W.double() @ a_w.t()) * b64).sum(1)
    want = (want + w.scale**2 * ((b64 @ a64) ** 2).sum(1)).sqrt()
    assert_fp32_close(norms, want, "norms vs fp64", tolerance=1e-6)
    if (
        lora_dtype == dtype
    ):  # on the CPU the torch path takes FP32 factors in full for W Aᵀ (on CUDA, rounded)
        assert_fp32_close(norms, _torch_path(w, w_sq, monkeypatch), "norms vs torch path", tolerance=1e-6)


@pytest.mark.usefixtures("looping_interpreter")
def test_kernel_clamps_a_cancelled_norm_to_zero(monkeypatch) -> None:
    """``B A = -W / s`` makes a row's norm zero: rounding may leave a tiny negative square, taken as 0, not NaN."""
    w = _weights(20, 48, 4, torch.float32, torch.float32)
    b = torch.zeros(20, 4)
    b[3] = torch.linalg.lstsq(w.A.t(), -w.W[3] / w.scale).solution
    w = w._replace(W=w.W.clone(), B=b)
    w.W[3] = -w.scale * (b[3] @ w.A)
    norms = dora.row_norms(w, dora.squared_row_norms(w))
    assert torch.isfinite(norms).all() and norms[3] < 1e-3


def test_kernel_declines_what_it_does_not_run(interpret) -> None:
    w = _weights(16, 32, 4, torch.float32, torch.float32)
    w_sq = dora.squared_row_norms(w)
    wide = _weights(16, 32, dora_norms.MAX_RANK + 1, torch.float32, torch.float32)
    assert not dora_norms.usable(wide.W, wide.A, wide.B, w_sq)
    assert not dora_norms.usable(w.W.double(), w.A, w.B, w_sq.double())  # fp64 runs torch's path
    assert not dora_norms.usable(w.W.t().contiguous().t(), w.A, w.B, w_sq)  # W's columns strided
    assert not dora_norms.usable(w.W, w.A, w.B, w_sq.double())
    assert not dora_norms.usable(w.W.to(torch.bfloat16), w.A, w.B, w_sq)  # bf16 yields NaN in the interpreter


@pytest.mark.usefixtures("looping_interpreter")
def test_dora_op_with_the_kernel_matches_the_torch_path(monkeypatch) -> None:
    """The fused DoRA op's output and every gradient, norms from the kernel vs from torch's passes."""
    w = projection(40, 56, 8, True)
    m = (dora.row_norms(w, dora.squared_row_norms(w)) * 1.1).requires_grad_()
    x = torch.randn(3, 21, 40)
    params = [w.A, w.B, m]
    launched = []
    original = dora_norms.row_norms
    monkeypatch.setattr(dora_norms, "row_norms", lambda *a: launched.append(1) or original(*a))
    fused = outputs_and_grads(lambda t: [dora.dora_w(t, w, m, dora.squared_row_norms(w))], x, params)
    assert launched
    monkeypatch.setattr(dora_norms, "usable", lambda *a: False)
    plain = outputs_and_grads(lambda t: [dora.dora_w(t, w, m, dora.squared_row_norms(w))], x, params)
    for name, f, p in zip(["Y", "dX", "dA", "dB", "dm"], fused, plain, strict=True):
        assert_fp32_close(f, p, name, tolerance=1e-6)
