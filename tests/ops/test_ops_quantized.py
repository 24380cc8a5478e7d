"""Every fused op with a quantized base (NF4, FP8 on its emulated backend) against its plain twin (dequantize,
then the reference math): outputs and every gradient; and the twin itself against the same op on the dense
dequantized weight."""

from __future__ import annotations

import copy

import pytest
import torch

from loralei.errors import LoraleiError
from loralei.ops import reference
from loralei.ops.lora_mlp import lora_mlp
from loralei.ops.lora_w import lora_w
from loralei.ops.shared_input import lora_group
from loralei.ops.weights import quant_handle, quant_of
from op_cases import (
    as_dtype,
    dequantized,
    fp8_projection,
    keep_mask,
    nf4_projection,
    outputs_and_grads,
    projection,
)
from tolerances import assert_fp32_close, assert_low_precision_close

pytest.importorskip("torchao")

# How each quantized base is made: (in, out, r, bias, dtype=..., seed=...) -> LoRAWeights.
QUANTIZED = pytest.mark.parametrize("quantized", [nf4_projection, fp8_projection], ids=["nf4", "fp8"])


def _assert_all_close(fused: list[torch.Tensor], plain: list[torch.Tensor]) -> None:
    for i, (f, p) in enumerate(zip(fused, plain, strict=True)):
        assert f.shape == p.shape and f.dtype == p.dtype, i
        assert_fp32_close(f, p, f"output/gradient {i}")


@QUANTIZED
@pytest.mark.parametrize(("inp", "out"), [(32, 48), (96, 32)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("masked", [False, True])
def test_lora_w_with_quantized_base_matches_twin(
    quantized, inp: int, out: int, bias: bool, masked: bool
) -> None:
    w = quantized(inp, out, 4, bias)
    x = torch.randn(3, 5, inp)
    mask = keep_mask(x.shape, 0.25, torch.float32, seed=2) if masked else None
    params = [w.A, w.B]
    fused = outputs_and_grads(lambda t: [lora_w(t, w, mask)], x, params)
    _assert_all_close(fused, outputs_and_grads(lambda t: [reference.lora_linear(t, w, mask)], x, params))
    dense = dequantized(w)
    _assert_all_close(fused, outputs_and_grads(lambda t: [lora_w(t, dense, mask)], x, params))


@QUANTIZED
def test_lora_group_with_quantized_bases_matches_twin(quantized) -> None:
    ws = [quantized(32, out, 4, bias=i == 1, seed=i) for i, out in enumerate((32, 16, 16))]
    x = torch.randn(2, 7, 32)
    masks = [None, keep_mask(x.shape, 0.3, torch.float32, seed=5), None]
    params = [t for w in ws for t in (w.A, w.B)]
    fused = outputs_and_grads(lambda t: lora_group(t, ws, masks), x, params)
    _assert_all_close(fused, outputs_and_grads(lambda t: reference.lora_group(t, ws, masks), x, params))


@QUANTIZED
def test_lora_w_and_lora_group_with_quantized_bases_compile_as_custom_ops(quantized) -> None:
    """Under torch.compile a quantized base travels to the custom op as a handle: no graph break (fullgraph),
    the same outputs and gradients as the plain twin, and a mixed group (dense and quantized) works too."""
    torch._dynamo.reset()
    w = quantized(32, 48, 4, bias=True)
    ws = [quantized(32, 16, 4, bias=False, seed=1), projection(32, 8, 2, bias=True, seed=2), w]
    x = torch.randn(2, 5, 32)
    params = [t for m in ws for t in (m.A, m.B)]
    single = torch.compile(lambda t: [lora_w(t, w)], backend="aot_eager", fullgraph=True)
    group = torch.compile(lambda t: lora_group(t, ws), backend="aot_eager", fullgraph=True)
    _assert_all_close(
        outputs_and_grads(single, x, [w.A, w.B]),
        outputs_and_grads(lambda t: [reference.lora_linear(t, w)], x, [w.A, w.B]),
    )
    _assert_all_close(
        outputs_and_grads(group, x, params),
        outputs_and_grads(lambda t: reference.lora_group(t, ws), x, params),
    )


@QUANTIZED
def test_lora_mlp_with_quantized_bases_compiles_without_graph_break(quantized) -> None:
    """Compiled, the gated MLP with quantized bases is the group op (gate, up), the activation and the single
    op (down): no graph break, the plain twin's outputs and gradients."""
    torch._dynamo.reset()
    gate, up = (quantized(32, 64, 4, bias=False, seed=s) for s in (0, 1))
    down = quantized(64, 32, 4, bias=True, seed=2)
    x = torch.randn(2, 5, 32)
    params = [t for w in (gate, up, down) for t in (w.A, w.B)]
    compiled = torch.compile(
        lambda t: [lora_mlp(t, gate, up, down, "silu")], backend="aot_eager", fullgraph=True
    )
    plain = outputs_and_grads(lambda t: [reference.lora_mlp(t, gate, up, down, "silu")], x, params)
    _assert_all_close(outputs_and_grads(compiled, x, params), plain)


@QUANTIZED
def test_ops_with_quantized_bases_pass_opcheck(quantized) -> None:
    """Schema, fake outputs (shapes read off the base behind the handle), autograd registration (the backward
    through loralei::lora_w_grads / lora_group_grads), for the single projection and a mixed group."""
    from loralei.ops.lora_w import _lora_w_op
    from loralei.ops.shared_input import _lora_group_op

    w = quantized(32, 48, 4, bias=True)
    x = torch.randn(2, 3, 32, requires_grad=True)
    torch.library.opcheck(_lora_w_op, (x, None, quant_handle(w.quant), w.bias, w.A, w.B, None, 1.0, w.scale))
    ws = [w, projection(32, 8, 2, bias=False, seed=2)]
    keeps = [keep_mask(x.shape, 0.5, torch.float32, seed=1), None]
    args = (x, [None, ws[1].W], [quant_handle(w.quant), -1], [m.bias for m in ws], [m.A for m in ws])
    torch.library.opcheck(
        _lora_group_op, (*args, [m.B for m in ws], keeps, [1.0, 1.0], [m.scale for m in ws])
    )


def test_a_quantized_base_keeps_its_handle_while_it_lives() -> None:
    first, second = fp8_projection(16, 16, 2, bias=False).quant, fp8_projection(16, 16, 2, bias=False).quant
    handle = quant_handle(first)
    assert quant_handle(first) == handle and quant_of(handle) is first
    assert quant_handle(second) != handle
    copied = copy.deepcopy(first)  # a copy is another base, with a number of its own
    assert quant_handle(copied) != handle and quant_of(quant_handle(copied)) is copied
    del first
    with pytest.raises(KeyError):  # the registry does not keep a base alive
        quant_of(handle)


@QUANTIZED
def test_lora_mlp_hands_down_term_over_with_quantized_bases(quantized) -> None:
    """``hand_over``: the base output (the quantized base's own product) and ``U'_d``; with ``U'_d B_dᵀ`` added by
    the caller, the twin's outputs and gradients."""
    gate, up = (quantized(32, 64, 4, bias=False, seed=s) for s in (0, 1))
    down = quantized(64, 32, 4, bias=True, seed=2)
    x = torch.randn(2, 3, 32)
    params = [t for w in (gate, up, down) for t in (w.A, w.B)]

    def handed(t: torch.Tensor) -> list[torch.Tensor]:
        base, u = lora_mlp(t, gate, up, down, "silu", hand_over=True)
        return [base + (u @ down.B.to(u.dtype).t()).view_as(base)]

    plain = outputs_and_grads(lambda t: [reference.lora_mlp(t, gate, up, down, "silu")], x, params)
    _assert_all_close(outputs_and_grads(handed, x, params), plain)


def test_lora_mlp_refuses_to_hand_over_under_compile_with_quantized_bases(monkeypatch) -> None:
    """Compiled with quantized bases the MLP is the group and single custom ops, which keep their terms."""
    gate, up = (nf4_projection(32, 64, 4, bias=False, seed=s) for s in (0, 1))
    down = nf4_projection(64, 32, 4, bias=True, seed=2)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with pytest.raises(
        LoraleiError, match=r"hand_over is not available under torch\.compile with a quantized base"
    ):
        lora_mlp(torch.randn(2, 3, 32), gate, up, down, "silu", hand_over=True)


@QUANTIZED
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("dropout_p", [0.0, 0.3])
def test_lora_mlp_with_quantized_bases_matches_twin(quantized, activation: str, dropout_p: float) -> None:
    gate, up = (quantized(32, 64, 4, bias=False, seed=s) for s in (0, 1))
    down = quantized(64, 32, 4, bias=True, seed=2)
    x = torch.randn(2, 3, 32)
    masks = None
    if dropout_p:
        masks = tuple(keep_mask(s, dropout_p, torch.float32, seed=i) for i, s in enumerate((x.shape,) * 2))
        masks = (*masks, keep_mask((2, 3, 64), dropout_p, torch.float32, seed=9))
    params = [t for w in (gate, up, down) for t in (w.A, w.B)]
    fused = outputs_and_grads(lambda t: [lora_mlp(t, gate, up, down, activation, masks)], x, params)
    plain = outputs_and_grads(lambda t: [reference.lora_mlp(t, gate, up, down, activation, masks)], x, params)
    _assert_all_close(fused, plain)


@QUANTIZED
def test_lora_mlp_kernel_path_with_quantized_bases(monkeypatch, quantized) -> None:
    """The MLP kernels (Triton interpreter, fp16) compute G₀/U₀ and dh₀ from the quantized bases too."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from loralei.kernels import gated_mlp

    if not gated_mlp.interpreter_runs_loops():
        pytest.skip("this Triton's interpreter cannot run the MLP backward kernel's loops")
    calls: list[str] = []
    real = gated_mlp.gated_mlp_forward
    monkeypatch.setattr(
        gated_mlp, "gated_mlp_forward", lambda *a, **kw: calls.append("fwd") or real(*a, **kw)
    )
    gate, up = (quantized(32, 64, 4, bias=False, seed=s) for s in (0, 1))
    down = quantized(64, 32, 4, bias=False, seed=2)
    x = torch.randn(2, 3, 32)
    params = [t for w in (gate, up, down) for t in (w.A, w.B)]
    fused = outputs_and_grads(lambda t: [lora_mlp(t, gate, up, down, "silu")], x, params)
    assert calls == ["fwd"]
    plain = outputs_and_grads(lambda t: [reference.lora_mlp(t, gate, up, down, "silu")], x, params)
    _assert_all_close(fused, plain)


@QUANTIZED
def test_plain_twin_keeps_no_dense_weight_for_backward(quantized) -> None:
    """QLoRA's point: between forward and backward only packed weights stay alive, never a dense copy."""
    w = quantized(32, 48, 4, bias=False)
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


# Each fused op with its plain twin: (fused, plain) taking (x, projections), and the projections' (in, out, bias).
_OPS = {
    "lora_w": (
        lambda t, ws: [lora_w(t, *ws)],
        lambda t, ws: [reference.lora_linear(t, *ws)],
        [(48, 80, True)],
    ),
    "lora_group": (
        lambda t, ws: lora_group(t, ws),
        lambda t, ws: reference.lora_group(t, ws),
        [(48, 48, False), (48, 16, True), (48, 16, False)],
    ),
    "lora_mlp": (
        lambda t, ws: [lora_mlp(t, *ws, "silu")],
        lambda t, ws: [reference.lora_mlp(t, *ws, "silu")],
        [(48, 80, False), (48, 80, False), (80, 48, True)],
    ),
}


@pytest.mark.parametrize("op", list(_OPS))
def test_fp8_bases_in_bfloat16_are_as_close_to_fp64_as_the_plain_twin(op: str) -> None:
    """The emulated FP8 path computing in bf16: each fused op's outputs and gradients are as close to fp64 math
    on the dequantized weights as the plain bf16 twin's."""
    fused_fn, plain_fn, shapes = _OPS[op]
    ws = [fp8_projection(i, o, 4, b, torch.bfloat16, seed=s) for s, (i, o, b) in enumerate(shapes)]
    x = torch.randn(3, 5, 48, dtype=torch.bfloat16)
    params = [t for w in ws for t in (w.A, w.B)]
    fused = outputs_and_grads(lambda t: fused_fn(t, ws), x, params)
    plain = outputs_and_grads(lambda t: plain_fn(t, ws), x, params)
    w64 = [as_dtype(dequantized(w), torch.float64) for w in ws]
    exact = outputs_and_grads(lambda t: plain_fn(t, w64), x.double(), [t for w in w64 for t in (w.A, w.B)])
    for i, (f, p, e) in enumerate(zip(fused, plain, exact, strict=True)):
        assert_low_precision_close(f, p, e, torch.bfloat16, f"{op} output/gradient {i}")
