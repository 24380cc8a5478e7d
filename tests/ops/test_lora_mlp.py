"""Fused gated-MLP op vs its plain-torch twin: output and every LoRA/input gradient."""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from loralei.errors import LoraleiError
from loralei.ops import reference
from loralei.ops.lora_mlp import lora_mlp
from loralei.ops.lowrank_sum import lowrank_sum
from loralei.ops.weights import LoRAWeights
from op_cases import as_dtype, gemm_shapes
from tolerances import assert_fp32_close, assert_low_precision_close

HIDDEN, INTER = 13, 21
BATCH = (2, 3)
GRAD_NAMES = ("x", "A_gate", "B_gate", "A_up", "B_up", "A_down", "B_down")


def _proj(gen, out_f, in_f, r, bias, dropout_p, w_dtype, lora_dtype) -> LoRAWeights:
    return LoRAWeights(
        W=(torch.randn(out_f, in_f, generator=gen) / in_f**0.5).to(w_dtype),
        quant=None,
        A=(torch.randn(r, in_f, generator=gen) / in_f**0.5).to(lora_dtype).requires_grad_(),
        B=(torch.randn(out_f, r, generator=gen) / r**0.5).to(lora_dtype).requires_grad_(),
        scale=2.0 / r**0.5,
        dropout_p=dropout_p,
        bias=(torch.randn(out_f, generator=gen) * 0.1).to(w_dtype) if bias else None,
    )


def _setup(r=8, bias=True, dropout_p=0.0, w_dtype=torch.float32, lora_dtype=None, x_dtype=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    lora_dtype = lora_dtype or w_dtype
    projs = [
        _proj(gen, INTER, HIDDEN, r, bias, dropout_p, w_dtype, lora_dtype),
        _proj(gen, INTER, HIDDEN, r, bias, dropout_p, w_dtype, lora_dtype),
        _proj(gen, HIDDEN, INTER, r, bias, dropout_p, w_dtype, lora_dtype),
    ]
    x = torch.randn(*BATCH, HIDDEN, generator=gen).to(x_dtype or w_dtype).requires_grad_()
    dy = torch.randn(*BATCH, HIDDEN, generator=gen)
    masks = None
    if dropout_p:
        shapes = ((*BATCH, HIDDEN), (*BATCH, HIDDEN), (*BATCH, INTER))
        masks = tuple(
            (torch.rand(s, generator=gen) >= dropout_p).to(w_dtype) / (1 - dropout_p) for s in shapes
        )
    return x, projs, dy, masks


def _run(fn, x, projs, dy, activation, masks=None):
    """Output and the gradients of x and every A, B."""
    out = fn(x, *projs, activation, masks)
    inputs = [x] + [t for p in projs for t in (p.A, p.B)]
    grads = torch.autograd.grad(out, inputs, dy.to(out.dtype))
    return [out.detach(), *grads]


def _fp64_reference(x, projs, dy, activation, masks):
    """The twin on the same values in fp64: what low-precision runs are judged against."""
    x64 = x.detach().double().requires_grad_()
    projs64 = [as_dtype(p, torch.float64) for p in projs]
    masks64 = None if masks is None else tuple(None if m is None else m.double() for m in masks)
    return _run(reference.lora_mlp, x64, projs64, dy.double(), activation, masks64)


def _assert_matches_twin(fused, plain):
    for name, got, want in zip(("out", *GRAD_NAMES), fused, plain, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert_fp32_close(got, want, name)


@pytest.mark.parametrize("activation", ["silu", "gelu", "gelu_tanh"])
@pytest.mark.parametrize("r", [1, 8, 64])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dropout_p", [0.0, 0.3])
def test_fp32_matches_twin(activation, r, bias, dropout_p):
    x, projs, dy, masks = _setup(r=r, bias=bias, dropout_p=dropout_p)
    _assert_matches_twin(
        _run(lora_mlp, x, projs, dy, activation, masks),
        _run(reference.lora_mlp, x, projs, dy, activation, masks),
    )


def _record_calls(monkeypatch, calls: list[str], module, names: tuple[str, ...]) -> None:
    """Appends the name of each call of ``module.<name>`` (launchers) to ``calls``."""
    for name in names:
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _n=name, _f=real: calls.append(_n) or _f(*a))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("dropout_p", [0.0, 0.25])
def test_triton_interpreter_path(monkeypatch, dtype, activation, dropout_p):
    """Without a mask on h the MLP kernels run (LoRA terms added inside, the backward's reductions fused into
    it); with one, the elementwise kernel and separate GEMMs run. Both must equal the twin."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from loralei.kernels import activations, gated_mlp

    launches: list[str] = []
    _record_calls(monkeypatch, launches, activations, ("_launch",))
    _record_calls(monkeypatch, launches, gated_mlp, ("_forward_impl", "_backward_impl"))
    x, projs, dy, masks = _setup(r=8, dropout_p=dropout_p, w_dtype=dtype)
    fused = _run(lora_mlp, x, projs, dy, activation, masks)
    # forward and backward both ran Triton kernels (the MLP kernels where this interpreter can run them)
    fused_kernels = not dropout_p and gated_mlp.interpreter_runs_loops()
    assert launches == (["_forward_impl", "_backward_impl"] if fused_kernels else ["_launch", "_launch"])
    plain = _run(reference.lora_mlp, x, projs, dy, activation, masks)
    if dtype == torch.float32:
        _assert_matches_twin(fused, plain)
        return
    ref = _fp64_reference(x, projs, dy, activation, masks)
    for name, f, p, r in zip(("out", *GRAD_NAMES), fused, plain, ref, strict=True):
        assert_low_precision_close(f, p, r, dtype, name)


def _handed_over(x, gate, up, down, activation, masks=None):
    """The MLP with down's LoRA term left to :func:`lowrank_sum`, as the pre-norm layers' last add takes it."""
    base, u_d = lora_mlp(x, gate, up, down, activation, masks, hand_over=True)
    flat = base.reshape(-1, base.shape[-1])
    return lowrank_sum(u_d, down.B, flat).view_as(base)


@pytest.mark.parametrize("interpreter", [False, True])
@pytest.mark.parametrize("dropout_p", [0.0, 0.3])
def test_down_term_handed_over_matches_twin(monkeypatch, interpreter, dropout_p):
    """``hand_over`` returns the base output and ``U'_d = s_d (h⊙m_d) A_dᵀ``; with the term added by the caller's
    node, output and every gradient (B_d's from that node) equal the twin's (the MLP kernels and the kernel sum
    in the interpreter; torch elsewhere; a mask on h takes the unfused path)."""
    if interpreter:
        pytest.importorskip("triton")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    x, projs, dy, masks = _setup(r=8, dropout_p=dropout_p)
    base, u_d = lora_mlp(x, *projs, "silu", masks, hand_over=True)
    assert base.shape == x.shape and u_d.shape == (x.numel() // HIDDEN, 8)
    _assert_matches_twin(
        _run(_handed_over, x, projs, dy, "silu", masks),
        _run(reference.lora_mlp, x, projs, dy, "silu", masks),
    )


def test_fused_backward_kernel_with_masks_on_gate_and_up_only(monkeypatch):
    """gate/up masks enter the kernels through their r-wide products; only a mask on h keeps them off."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from loralei.kernels import gated_mlp

    if not gated_mlp.interpreter_runs_loops():
        pytest.skip("this Triton's interpreter cannot run loops with run-time bounds")
    launches: list[str] = []
    _record_calls(monkeypatch, launches, gated_mlp, ("_forward_impl", "_backward_impl"))
    x, projs, dy, masks = _setup(r=8, dropout_p=0.3)
    projs[2] = projs[2]._replace(dropout_p=0.0)
    masks = (masks[0], masks[1], None)
    fused = _run(lora_mlp, x, projs, dy, "silu", masks)
    assert launches == ["_forward_impl", "_backward_impl"]
    _assert_matches_twin(fused, _run(reference.lora_mlp, x, projs, dy, "silu", masks))


@pytest.mark.parametrize(
    ("x_dtype", "w_dtype"), [(torch.float16, torch.float32), (torch.float32, torch.float64)]
)
def test_input_dtype_is_cast_once_and_dx_returned_in_it(x_dtype, w_dtype):
    x, projs, dy, _ = _setup(w_dtype=w_dtype, x_dtype=x_dtype)
    fused = _run(lora_mlp, x, projs, dy, "silu")
    plain = _run(reference.lora_mlp, x, projs, dy, "silu")
    assert fused[0].dtype == w_dtype and fused[1].dtype == x_dtype
    if x_dtype == torch.float16:  # dX is rounded to fp16: judge it by the low-precision rule
        ref = _fp64_reference(x, projs, dy, "silu", None)
        assert_low_precision_close(fused[1], plain[1], ref[1], x_dtype, "x")
        fused, plain = fused[:1] + fused[2:], plain[:1] + plain[2:]
    for got, want in zip(fused, plain, strict=True):
        assert_fp32_close(got, want)


@pytest.mark.parametrize("w_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("dropout_p", [0.0, 0.2])
def test_fp32_lora_with_low_precision_base(w_dtype, dropout_p):
    x, projs, dy, masks = _setup(r=8, dropout_p=dropout_p, w_dtype=w_dtype, lora_dtype=torch.float32)
    fused = _run(lora_mlp, x, projs, dy, "gelu", masks)
    plain = _run(reference.lora_mlp, x, projs, dy, "gelu", masks)
    ref = _fp64_reference(x, projs, dy, "gelu", masks)
    for i, (name, f, p, r) in enumerate(zip(("out", *GRAD_NAMES), fused, plain, ref, strict=True)):
        assert f.dtype == (torch.float32 if i >= 2 else w_dtype), name  # A/B grads land in fp32
        assert_low_precision_close(f, p, r, w_dtype, name)


def test_drawn_dropout_masks_agree_between_forward_and_backward():
    """Masks drawn inside the op: under a fixed seed the op is a function whose directional derivative
    (central differences, fp64) must equal the gradient's projection on the same direction."""
    x, projs, dy, _ = _setup(r=4, dropout_p=0.5, w_dtype=torch.float64)
    inputs = [x] + [t for p in projs for t in (p.A, p.B)]

    def loss(values):
        torch.manual_seed(1234)
        ps = [p._replace(A=values[1 + 2 * i], B=values[2 + 2 * i]) for i, p in enumerate(projs)]
        return (lora_mlp(values[0], *ps, "gelu_tanh") * dy.double()).sum()

    grads = torch.autograd.grad(loss(inputs), inputs)
    gen = torch.Generator().manual_seed(7)
    direction = [torch.randn(t.shape, generator=gen, dtype=t.dtype) for t in inputs]
    eps = 1e-6
    with torch.no_grad():
        plus = loss([t + eps * d for t, d in zip(inputs, direction, strict=True)])
        minus = loss([t - eps * d for t, d in zip(inputs, direction, strict=True)])
    numeric = (plus - minus) / (2 * eps)
    analytic = sum((g * d).sum() for g, d in zip(grads, direction, strict=True))
    assert_fp32_close(analytic, numeric, "directional derivative")
    no_dropout = lora_mlp(x, *[p._replace(dropout_p=0.0) for p in projs], "gelu_tanh")
    torch.manual_seed(1234)
    assert not torch.allclose(lora_mlp(x, *projs, "gelu_tanh"), no_dropout)  # the masks really apply


def test_gradient_checkpointing_non_reentrant():
    x, projs, dy, masks = _setup(dropout_p=0.3)
    checkpointed = _run(lambda *a: checkpoint(lora_mlp, *a, use_reentrant=False), x, projs, dy, "silu", masks)
    _assert_matches_twin(checkpointed, _run(reference.lora_mlp, x, projs, dy, "silu", masks))


def test_saves_no_full_size_tensor_beyond_gate_and_up():
    x, projs, _, _ = _setup(r=4)
    tokens = x.numel() // HIDDEN
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        lora_mlp(x, *projs, "silu")
    activations = [t for t in saved if t.dim() == 2 and t.shape[0] == tokens]
    shapes = sorted(tuple(t.shape) for t in activations)
    # x, G, U and the three r-wide products; h is recomputed in backward.
    assert shapes == sorted([(tokens, HIDDEN), (tokens, INTER), (tokens, INTER), *[(tokens, 4)] * 3])


@pytest.mark.parametrize("dropout_p", [0.0, 0.3])
def test_gate_and_up_read_x_once_without_dropout(dropout_p):
    """Without masks: one (T, 2r) GEMM x [A_g; A_u]ᵀ and one (2r, H) dA GEMM; with masks: one each per projection."""
    x, projs, dy, masks = _setup(r=4, dropout_p=dropout_p)
    tokens = x.numel() // HIDDEN
    out = []
    forward = gemm_shapes(lambda: out.append(lora_mlp(x, *projs, "silu", masks)))
    backward = gemm_shapes(lambda: out[0].backward(dy))
    on_x = [s for s in forward if s[0] == tokens and s[1] in (4, 8)]
    da_on_x = [s for s in backward if s[1] == HIDDEN and s[0] in (4, 8)]
    if dropout_p:
        assert on_x == [(tokens, 4)] * 3 and da_on_x == [(4, HIDDEN)] * 2  # down's U is on h, also (T, 4)
    else:
        assert sorted(on_x) == [(tokens, 4), (tokens, 8)] and da_on_x == [(8, HIDDEN)]


def test_second_backward_through_same_graph_raises():
    x, projs, dy, _ = _setup()
    out = lora_mlp(x, *projs, "silu")
    torch.autograd.grad(out, x, dy, retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.grad(out, x, dy)


def test_torch_compile_has_no_graph_break():
    x, projs, dy, _ = _setup()

    def step(x):
        return lora_mlp(x, *projs, "gelu")

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    _assert_matches_twin(
        _run(lambda x, *_: compiled(x), x, projs, dy, "gelu"), _run(reference.lora_mlp, x, projs, dy, "gelu")
    )


def test_bad_inputs():
    x, projs, _, _ = _setup(dropout_p=0.3)
    with pytest.raises(ValueError, match=r"activation='relu'.*silu"):
        lora_mlp(x, *projs, "relu")
    with pytest.raises(LoraleiError, match="lora_mlp gate: quant is a object, not a quantized weight"):
        lora_mlp(x, projs[0]._replace(quant=object()), *projs[1:], "silu")
    with pytest.raises(LoraleiError, match="lora_mlp down: the base weight/bias requires grad"):
        lora_mlp(x, *projs[:2], projs[2]._replace(W=projs[2].W.clone().requires_grad_()), "silu")
    with pytest.raises(LoraleiError, match=r"dropout mask has shape \(2, 3, 21\); expected \(2, 3, 13\)"):
        lora_mlp(x, *projs, "silu", (torch.ones(*BATCH, INTER), None, None))
    with pytest.raises(LoraleiError, match=r"lora_mlp up: base weight is .* torch.float64, expected"):
        lora_mlp(x, projs[0], projs[1]._replace(W=projs[1].W.double()), projs[2], "silu")
    with pytest.raises(LoraleiError, match=r"lora_mlp down: base weight is \(13, 20\)"):
        lora_mlp(x, *projs[:2], projs[2]._replace(W=projs[2].W[:, :20]), "silu")
    with pytest.raises(LoraleiError, match="lora_mlp: input has 12 features, the projections take 13"):
        lora_mlp(x[..., :12], *projs, "silu")


@pytest.mark.gpu
@pytest.mark.parametrize("lora_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("r", [16, 8])
@pytest.mark.parametrize("masked", ["all", "gate_up", "none"])
def test_bf16_on_gpu_vs_fp64(monkeypatch, lora_dtype, r, masked):
    """bf16 on CUDA: the MLP kernels (no mask on h) and the unfused path (mask on h) vs an fp64 reference."""
    from loralei.kernels import gated_mlp

    launches: list[str] = []
    _record_calls(monkeypatch, launches, gated_mlp, ("_forward_impl", "_backward_impl"))
    dropout_p = 0.0 if masked == "none" else 0.1
    x, projs, dy, masks = _setup(r=r, dropout_p=dropout_p, w_dtype=torch.bfloat16, lora_dtype=lora_dtype)
    if masked == "gate_up":
        projs[2] = projs[2]._replace(dropout_p=0.0)
        masks = (masks[0], masks[1], None)
    to_cuda = lambda t: None if t is None else t.detach().cuda().requires_grad_(t.requires_grad)  # noqa: E731
    x, dy = to_cuda(x), dy.cuda()
    projs = [p._replace(W=to_cuda(p.W), A=to_cuda(p.A), B=to_cuda(p.B), bias=to_cuda(p.bias)) for p in projs]
    masks = None if masks is None else tuple(None if m is None else m.cuda() for m in masks)
    fused = _run(lora_mlp, x, projs, dy, "silu", masks)
    assert launches == ([] if masked == "all" else ["_forward_impl", "_backward_impl"])
    plain = _run(reference.lora_mlp, x, projs, dy, "silu", masks)
    ref = _fp64_reference(x, projs, dy, "silu", masks)
    for name, f, p, e in zip(("out", *GRAD_NAMES), fused, plain, ref, strict=True):
        assert_low_precision_close(f, p, e, torch.bfloat16, name)


@pytest.mark.gpu
@pytest.mark.parametrize("lora_dtype", [torch.bfloat16, torch.float32])
def test_bf16_handed_over_on_gpu_vs_fp64(lora_dtype):
    """bf16 on CUDA: the MLP kernels with down's term added by the caller's node, vs an fp64 reference."""
    x, projs, dy, _ = _setup(r=16, w_dtype=torch.bfloat16, lora_dtype=lora_dtype)
    to_cuda = lambda t: None if t is None else t.detach().cuda().requires_grad_(t.requires_grad)  # noqa: E731
    x, dy = to_cuda(x), dy.cuda()
    projs = [p._replace(W=to_cuda(p.W), A=to_cuda(p.A), B=to_cuda(p.B), bias=to_cuda(p.bias)) for p in projs]
    fused = _run(_handed_over, x, projs, dy, "silu")
    plain = _run(reference.lora_mlp, x, projs, dy, "silu")
    ref = _fp64_reference(x, projs, dy, "silu", None)
    for name, f, p, e in zip(("out", *GRAD_NAMES), fused, plain, ref, strict=True):
        assert f.dtype == p.dtype, name
        assert_low_precision_close(f, p, e, torch.bfloat16, name)
