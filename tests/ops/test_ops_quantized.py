"""Every fused op with an NF4 base against its plain twin (dequantize, then the reference math): outputs and
every gradient; and the twin itself against the same op on the dense dequantized weight."""

from __future__ import annotations

import pytest
import torch

from loralei.ops import reference
from loralei.ops.lora_mlp import lora_mlp
from loralei.ops.lora_w import lora_w
from loralei.ops.shared_input import lora_group
from op_cases import as_dtype, dequantized, keep_mask, nf4_projection, outputs_and_grads
from tolerances import assert_fp32_close, assert_low_precision_close

pytest.importorskip("torchao")


def _assert_all_close(fused: list[torch.Tensor], plain: list[torch.Tensor]) -> None:
    for i, (f, p) in enumerate(zip(fused, plain, strict=True)):
        assert f.shape == p.shape and f.dtype == p.dtype, i
        assert_fp32_close(f, p, f"output/gradient {i}")


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("masked", [False, True])
def test_lora_w_with_nf4_base_matches_twin(bias: bool, masked: bool) -> None:
    w = nf4_projection(32, 48, 4, bias)
    x = torch.randn(3, 5, 32)
    mask = keep_mask(x.shape, 0.25, torch.float32, seed=2) if masked else None
    params = [w.A, w.B]
    fused = outputs_and_grads(lambda t: [lora_w(t, w, mask)], x, params)
    _assert_all_close(fused, outputs_and_grads(lambda t: [reference.lora_linear(t, w, mask)], x, params))
    dense = dequantized(w)
    _assert_all_close(fused, outputs_and_grads(lambda t: [lora_w(t, dense, mask)], x, params))


def test_lora_group_with_nf4_bases_matches_twin() -> None:
    ws = [nf4_projection(32, out, 4, bias=i == 1, seed=i) for i, out in enumerate((32, 16, 16))]
    x = torch.randn(2, 7, 32)
    masks = [None, keep_mask(x.shape, 0.3, torch.float32, seed=5), None]
    params = [t for w in ws for t in (w.A, w.B)]
    fused = outputs_and_grads(lambda t: lora_group(t, ws, masks), x, params)
    _assert_all_close(fused, outputs_and_grads(lambda t: reference.lora_group(t, ws, masks), x, params))


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("dropout_p", [0.0, 0.3])
def test_lora_mlp_with_nf4_bases_matches_twin(activation: str, dropout_p: float) -> None:
    gate, up = (nf4_projection(32, 64, 4, bias=False, seed=s) for s in (0, 1))
    down = nf4_projection(64, 32, 4, bias=True, seed=2)
    x = torch.randn(2, 3, 32)
    masks = None
    if dropout_p:
        masks = tuple(keep_mask(s, dropout_p, torch.float32, seed=i) for i, s in enumerate((x.shape,) * 2))
        masks = (*masks, keep_mask((2, 3, 64), dropout_p, torch.float32, seed=9))
    params = [t for w in (gate, up, down) for t in (w.A, w.B)]
    fused = outputs_and_grads(lambda t: [lora_mlp(t, gate, up, down, activation, masks)], x, params)
    plain = outputs_and_grads(lambda t: [reference.lora_mlp(t, gate, up, down, activation, masks)], x, params)
    _assert_all_close(fused, plain)


def test_lora_mlp_kernel_path_with_nf4_bases(monkeypatch) -> None:
    """The MLP kernels (Triton interpreter, fp16) compute G₀/U₀ and dh₀ from the quantized bases too."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from loralei.kernels import gated_mlp

    if not gated_mlp.interpreter_runs_loops():
        pytest.skip("this Triton's interpreter cannot run the MLP backward kernel's loops")
    calls: list[str] = []
    real = gated_mlp.gated_mlp_forward
    monkeypatch.setattr(gated_mlp, "gated_mlp_forward", lambda *a: calls.append("fwd") or real(*a))
    gate, up = (nf4_projection(32, 64, 4, bias=False, seed=s) for s in (0, 1))
    down = nf4_projection(64, 32, 4, bias=False, seed=2)
    x = torch.randn(2, 3, 32)
    params = [t for w in (gate, up, down) for t in (w.A, w.B)]
    fused = outputs_and_grads(lambda t: [lora_mlp(t, gate, up, down, "silu")], x, params)
    assert calls == ["fwd"]
    plain = outputs_and_grads(lambda t: [reference.lora_mlp(t, gate, up, down, "silu")], x, params)
    _assert_all_close(fused, plain)


def test_plain_twin_keeps_no_dense_weight_for_backward() -> None:
    """QLoRA's point: between forward and backward only packed weights stay alive, never a dense copy."""
    w = nf4_projection(32, 48, 4, bias=False)
    saved: list[tuple[int, ...]] = []
    x = torch.randn(4, 32, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        reference.lora_linear(x, w).sum().backward()
        lora_w(x, w).sum().backward()
    assert (48, 32) not in saved and (32, 48) not in saved


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_nf4_matmul_path_matches_twin(monkeypatch, dtype: torch.dtype) -> None:
    """nf4_kernel="triton" (interpreter): every base product runs the fused NF4 kernel, none dequantizes."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from loralei.kernels import nf4
    from loralei.modules.quantized import nf4 as nf4_module

    if not nf4.usable(torch.empty(1, dtype=dtype)):
        pytest.skip("this Triton's interpreter cannot run the fused kernel's loop")
    calls: list[bool] = []
    real = nf4_module.nf4_matmul.nf4_matmul
    monkeypatch.setattr(nf4_module.nf4_matmul, "nf4_matmul", lambda *a: calls.append(a[3]) or real(*a))
    gate, up = (nf4_projection(32, 64, 4, False, dtype, seed=s, kernel="triton") for s in (0, 1))
    down = nf4_projection(64, 32, 4, True, dtype, seed=2, kernel="triton")
    x = torch.randn(2, 5, 32, dtype=dtype)
    params = [t for w in (gate, up, down) for t in (w.A, w.B)]
    fused = outputs_and_grads(lambda t: [lora_mlp(t, gate, up, down, "silu")], x, params)
    assert sorted(set(calls)) == [False, True] and len(calls) == 6  # 3 forward, 3 input-gradient products
    plain = outputs_and_grads(lambda t: [reference.lora_mlp(t, gate, up, down, "silu")], x, params)
    if dtype == torch.float32:
        _assert_all_close(fused, plain)
        return
    w64 = [as_dtype(dequantized(w), torch.float64) for w in (gate, up, down)]
    params64 = [t for w in w64 for t in (w.A, w.B)]
    exact = outputs_and_grads(lambda t: [reference.lora_mlp(t, *w64, "silu")], x.double(), params64)
    for i, (f, p, e) in enumerate(zip(fused, plain, exact, strict=True)):
        assert_low_precision_close(f, p, e, dtype, f"output/gradient {i}")
