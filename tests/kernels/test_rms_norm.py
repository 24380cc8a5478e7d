"""loralei's RMSNorm kernels vs torch (Triton interpreter, fp32 and fp16): output, input gradient and weight
gradient for each form, at odd widths and row counts; a frozen weight takes no weight-gradient work; the residual
add taken in the kernels gives the bits of the add and the norm apart; which form each Transformers class
computes (``loralei.fusion.norms``)."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from loralei.fusion import norms
from loralei.kernels import fp8_operands
from loralei.kernels import rms_norm as kernels
from loralei.kernels.rms_norm import NormForm, residual_rms_norm, rms_norm, rms_norm_reference
from loralei.modules.quantized.fp8_gemm import padded_rows, quantize_rows
from tiny_models import tiny_model
from tolerances import assert_fp32_close, assert_low_precision_close

FORMS = {"llama": NormForm(0.0, True), "gemma": NormForm(1.0, False), "olmo2": NormForm(0.0, False)}
# (shape): one row, rows of a width below / above a power of two, many narrow rows (per-head norms)
SHAPES = [(1, 37), (3, 5, 37), (70, 8), (7, 128), (2, 300), (257, 16)]


def _run(x: torch.Tensor, weight: torch.Tensor, dy: torch.Tensor, fn) -> list[torch.Tensor]:
    x, weight = x.detach().requires_grad_(), weight.detach().requires_grad_()
    y = fn(x, weight)
    return [y.detach(), *torch.autograd.grad(y, (x, weight), dy)]


def _inputs(shape, dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=gen) * 3).to(dtype)
    weight = (1 + torch.randn(shape[-1], generator=gen) / 2).to(dtype)
    dy = torch.randn(shape, generator=gen).to(dtype)
    return x, weight, dy


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("form", FORMS.values(), ids=FORMS.keys())
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kernels_match_torch_in_interpreter(interpret, shape, form, dtype) -> None:
    x, weight, dy = _inputs(shape, dtype)
    fused = _run(x, weight, dy, lambda a, w: rms_norm(a, w, 1e-6, form))
    plain = _run(x, weight, dy, lambda a, w: rms_norm_reference(a, w, 1e-6, form))
    exact = _run(x.double(), weight.double(), dy.double(), lambda a, w: rms_norm_reference(a, w, 1e-6, form))
    assert fused[0].dtype == plain[0].dtype
    for what, f, p, e in zip(["y", "dx", "dw"], fused, plain, exact, strict=True):
        if dtype == torch.float32:
            assert_fp32_close(f, e, what)
        else:
            assert_low_precision_close(f, p, e, dtype, what)


def test_a_frozen_weight_takes_no_weight_gradient_work(interpret, monkeypatch) -> None:
    calls = []
    backward = kernels._backward_impl
    names = list(inspect.signature(backward).parameters)
    monkeypatch.setattr(
        kernels, "_backward_impl", lambda *a: calls.append(a[names.index("weight_grad")]) or backward(*a)
    )
    x, weight, dy = _inputs((9, 40), torch.float32)
    x.requires_grad_()
    (dx,) = torch.autograd.grad(rms_norm(x, weight, 1e-5, FORMS["llama"]), x, dy)
    assert calls == [False] and weight.grad is None
    expected = _run(x, weight, dy, lambda a, w: rms_norm_reference(a, w, 1e-5, FORMS["llama"]))[1]
    assert_fp32_close(dx, expected, "dx")


def test_without_a_kernel_the_torch_form_runs(monkeypatch) -> None:
    """bf16 in the interpreter (it yields NaN there) and CPU tensors outside it take the torch form."""
    x, weight, dy = _inputs((4, 24), torch.bfloat16)
    for interpret in ("0", "1"):
        monkeypatch.setenv("TRITON_INTERPRET", interpret)
        got = _run(x, weight, dy, lambda a, w: rms_norm(a, w, 1e-6, FORMS["llama"]))
        want = _run(x, weight, dy, lambda a, w: rms_norm_reference(a, w, 1e-6, FORMS["llama"]))
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def _residual_run(x, branch, weight, dh, dy, fn) -> list[torch.Tensor]:
    """``(h, y)`` of ``fn`` and the gradients of ``h·dh + y·dy`` for x, the branch (if any) and the weight."""
    leaves = [t.detach().requires_grad_() for t in (x, weight) + (() if branch is None else (branch,))]
    h, y = fn(leaves[0], None if branch is None else leaves[2], leaves[1])
    return [h.detach(), y.detach(), *torch.autograd.grad((h, y), leaves, (dh, dy))]


def _apart(x, branch, weight, eps, form):
    """The add and the norm as separate ops (the norm still loralei's kernel)."""
    h = x if branch is None else x + branch
    return h * 1 if branch is None else h, rms_norm(h, weight, eps, form)


@pytest.mark.parametrize("shape", [(3, 5, 37), (70, 8), (2, 300)])
@pytest.mark.parametrize("form", FORMS.values(), ids=FORMS.keys())
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("with_branch", [False, True], ids=["input-kept", "add-then-norm"])
def test_residual_add_in_the_kernels_gives_the_bits_of_the_ops_apart(
    interpret, shape, form, dtype, with_branch
) -> None:
    """``h`` (and in the backward the gradient along the residual path) joins the kernels: same bits as the add
    and the norm kernel run apart, the weight's gradient included."""
    x, weight, dy = _inputs(shape, dtype)
    branch, _, dh = _inputs(shape, dtype, seed=1)
    branch = branch if with_branch else None
    fused = _residual_run(x, branch, weight, dh, dy, lambda a, b, w: residual_rms_norm(a, b, w, 1e-6, form))
    apart = _residual_run(x, branch, weight, dh, dy, lambda a, b, w: _apart(a, b, w, 1e-6, form))
    names = ["h", "y", "dx", "dw", "dbranch"][: len(fused)]
    for what, f, a in zip(names, fused, apart, strict=True):
        assert torch.equal(f, a), what


def test_the_residual_norm_without_a_kernel_is_the_torch_composition(monkeypatch) -> None:
    """bf16 in the interpreter takes torch's add and the torch form; with a branch of another dtype the add is
    torch's (promoting) and only the norm runs the kernel."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    x, weight, dy = _inputs((4, 24), torch.bfloat16)
    branch, _, dh = _inputs((4, 24), torch.bfloat16, seed=1)
    form = FORMS["llama"]
    got = _residual_run(x, branch, weight, dh, dy, lambda a, b, w: residual_rms_norm(a, b, w, 1e-6, form))
    want = _residual_run(
        x, branch, weight, dh, dy, lambda a, b, w: (a + b, rms_norm_reference(a + b, w, 1e-6, form))
    )
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    x, weight = x.float(), weight.float()
    h, y = residual_rms_norm(x, branch, weight, 1e-6, form)
    assert h.dtype == torch.float32 and torch.equal(h, x + branch)
    assert torch.equal(y, rms_norm(x + branch, weight, 1e-6, form))


# each family's RMSNorm classes and the form they compute
FAMILY_FORMS = {
    "llama": FORMS["llama"],
    "qwen3": FORMS["llama"],
    "phi3": FORMS["llama"],
    "gemma2": FORMS["gemma"],
    "gemma3": FORMS["gemma"],
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", FAMILY_FORMS)
def test_each_family_norm_is_recognised_by_its_output(family, dtype) -> None:
    model = tiny_model(family, dtype=dtype)
    found = {type(m).__name__: norms.form_of(m) for m in model.modules() if norms.is_rms_norm(m)}
    assert found and set(found.values()) == {FAMILY_FORMS[family]}, found


class ScaledRMSNorm(nn.Module):
    """Named like an RMSNorm, computing something else (a mean-centred norm)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = 1e-6

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x - x.mean(-1, keepdim=True)) * torch.rsqrt(x.var(-1, keepdim=True) + self.eps)


def test_a_norm_of_another_formula_keeps_its_forward() -> None:
    module = ScaledRMSNorm(16)
    assert norms.is_rms_norm(module) and norms.form_of(module) is None
    assert not norms.is_rms_norm(nn.LayerNorm(16))  # not named RMSNorm: never probed


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(4096, 1024), (8192, 128), (1024, 4096), (300, 5120)])
@pytest.mark.parametrize("form", FORMS.values(), ids=FORMS.keys())
@pytest.mark.parametrize("weight_grad", [False, True])
def test_kernels_match_torch_on_the_gpu(shape, form, weight_grad) -> None:
    """bf16 on the GPU (autotuned row blocks: the weight gradient's partials follow the tuned block)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    x, weight, dy = (t.cuda() for t in _inputs(shape, torch.bfloat16))
    x_, w_ = x.detach().requires_grad_(), weight.detach().requires_grad_(weight_grad)
    fused = rms_norm(x_, w_, 1e-6, form)
    grads = torch.autograd.grad(fused, (x_, w_) if weight_grad else (x_,), dy)
    plain = _run(x, weight, dy, lambda a, w: rms_norm_reference(a, w, 1e-6, form))
    exact = _run(x.double(), weight.double(), dy.double(), lambda a, w: rms_norm_reference(a, w, 1e-6, form))
    for what, f, p, e in zip(["y", "dx", "dw"], [fused.detach(), *grads], plain, exact, strict=False):
        assert_low_precision_close(f, p, e, torch.bfloat16, what)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(8192, 4096), (300, 5120)])
@pytest.mark.parametrize("with_branch", [False, True], ids=["input-kept", "add-then-norm"])
def test_residual_add_in_the_kernels_gives_the_bits_of_the_ops_apart_on_the_gpu(shape, with_branch) -> None:
    """bf16 on the GPU, Llama's form: the add taken in the kernels changes no bit of h, y or any gradient."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    x, weight, dy = (t.cuda() for t in _inputs(shape, torch.bfloat16))
    branch, _, dh = (t.cuda() for t in _inputs(shape, torch.bfloat16, seed=1))
    branch = branch if with_branch else None
    form = FORMS["llama"]
    fused = _residual_run(x, branch, weight, dh, dy, lambda a, b, w: residual_rms_norm(a, b, w, 1e-6, form))
    apart = _residual_run(x, branch, weight, dh, dy, lambda a, b, w: _apart(a, b, w, 1e-6, form))
    for what, f, a in zip(["h", "y", "dx", "dw", "dbranch"], fused, apart, strict=False):
        assert torch.equal(f, a), what


class _Recorder:
    """A kernel stand-in: records each launch's grid and keyword arguments; the grid sees them with the config
    the launcher adds (``chosen``: what an autotuner adds, its chosen config)."""

    def __init__(self, name: str, calls: list, chosen: dict) -> None:
        self.name, self.calls, self.chosen = name, calls, chosen

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((self.name, grid(kwargs | self.chosen), kwargs))


def test_gpu_launches_reuse_the_autotuned_rows_and_count_their_programs(monkeypatch) -> None:
    """After the first launch per width the kernel runs with the autotuner's rows per program, without the
    autotuner; the weight gradient's partials are counted with those rows."""
    calls: list = []
    chosen = {"ROWS": 4, "num_warps": 8}
    autotuned = _Recorder("autotune", calls, chosen)
    autotuned.fn = _Recorder("direct", calls, {})
    autotuned.best_config = SimpleNamespace(all_kwargs=lambda: chosen)
    monkeypatch.setattr(kernels, "_kernel", lambda backward, interpret: autotuned)
    monkeypatch.setattr(kernels, "_TUNED", {})
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    t = torch.zeros(2, dtype=torch.bfloat16)
    # 1000 rows of 1024: 2 rows per block (2048 // 1024), 4 blocks per program -> 125 programs
    programs = [
        kernels._launch(True, 1000, 1024, (t, 1000, 1024), CAST_FIRST=True, W_GRAD=True) for _ in "ab"
    ]
    assert programs == [125, 125]
    assert [(name, grid) for name, grid, _ in calls] == [("autotune", (125,)), ("direct", (125,))]
    assert calls[1][2] == {
        "CAST_FIRST": True,
        "W_GRAD": True,
        "BN": 1024,
        "BM0": 2,
        "ROWS": 4,
        "num_warps": 8,
    }


@pytest.mark.parametrize("shape", [(3, 5, 37), (16, 8), (2, 300), (33, 64)])
@pytest.mark.parametrize("form", FORMS.values(), ids=FORMS.keys())
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("with_branch", [False, True], ids=["input-kept", "add-then-norm"])
def test_fp8_codes_of_the_output_are_the_quantization_kernels(
    interpret, shape, form, dtype, with_branch
) -> None:
    """With ``quantize`` the forward (with autograd and without) offers ``y``'s per-row e4m3 codes and scales,
    rows padded to 16 (zero codes, scale 1), for the flattened view a projection reads: the bits of the FP8
    quantization of ``y`` (``quantize_rows(..., reciprocal=True)``); ``h``, ``y`` and every gradient are those
    of the norm without codes."""
    x, weight, dy = _inputs(shape, dtype)
    x[..., 0, :] = 0  # all-zero rows: scale 1
    branch, _, dh = _inputs(shape, dtype, seed=1)
    branch = branch if with_branch else None
    offered = []

    def coded(a, b, w):
        h, y = residual_rms_norm(a, b, w, 1e-6, form, quantize=True)
        offered.append(fp8_operands.take_codes(y.reshape(-1, shape[-1])))
        return h, y

    plain = _residual_run(x, branch, weight, dh, dy, lambda a, b, w: residual_rms_norm(a, b, w, 1e-6, form))
    with_codes = _residual_run(x, branch, weight, dh, dy, coded)
    for what, p, c in zip(["h", "y", "dx", "dw", "dbranch"], plain, with_codes, strict=False):
        assert torch.equal(p, c), what
    with torch.no_grad():
        coded(x, branch, weight)
    want_codes, want_scales = quantize_rows(padded_rows(plain[1].reshape(-1, shape[-1])), reciprocal=True)
    assert len(offered) == 2 and all(o is not None for o in offered), "no codes offered"
    for codes, scales in offered:
        assert torch.equal(scales, want_scales)
        assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8))


def test_offered_codes_serve_one_product_of_that_memory_unchanged(interpret) -> None:
    x, weight, _ = _inputs((2, 16, 32), torch.float32)
    _, y = residual_rms_norm(x, None, weight, 1e-6, FORMS["llama"], quantize=True)
    assert fp8_operands.take_codes(y[:, :8].reshape(-1, 32)) is None, "part of its memory"
    assert fp8_operands.take_codes(y.clone()) is None, "a copy"
    assert fp8_operands.take_codes(y.view(-1, 32)) is not None
    assert fp8_operands.take_codes(y.view(-1, 32)) is None, "taken twice"
    _, y = residual_rms_norm(x, None, weight, 1e-6, FORMS["llama"], quantize=True)
    y.view(-1, 32).mul_(2)
    assert fp8_operands.take_codes(y) is None, "changed in place since"


def test_offered_codes_follow_the_memory_not_the_tensor_object(interpret) -> None:
    """Codes stay offered while their memory lives, also where only a view of it does (autograd hands a gradient
    on as a view and drops the tensor the kernel wrote); a tensor on another storage at the same address (an alias
    whose writes the version counter does not see, or new memory where freed memory was) gets none."""
    x, weight, _ = _inputs((2, 16, 32), torch.float32)
    _, y = residual_rms_norm(x, None, weight, 1e-6, FORMS["llama"], quantize=True)
    flat = y.detach().view(-1, 32)  # on y's storage without holding y (as autograd's gradient views are)
    del y
    assert fp8_operands.take_codes(flat) is not None
    _, y = residual_rms_norm(x, None, weight, 1e-6, FORMS["llama"], quantize=True)
    alias = torch.from_numpy(y.numpy())
    assert alias.data_ptr() == y.data_ptr() and alias.untyped_storage() is not y.untyped_storage()
    assert fp8_operands.take_codes(alias) is None, "another storage"
    assert fp8_operands.take_codes(y) is not None


def test_forward_op_passes_opcheck(interpret) -> None:
    """The custom op torch.compile sees, with and without the residual add and the FP8 codes."""
    x, weight, branch = _inputs((5, 32), torch.float32)
    for quantize in (False, True):
        for b in (None, branch):
            torch.library.opcheck(kernels._forward_op, (x, b, weight, 1e-6, 0.0, True, quantize))


@pytest.mark.parametrize("shape", [(3, 5, 37), (16, 8), (2, 300)])
@pytest.mark.parametrize("form", FORMS.values(), ids=FORMS.keys())
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fp8_codes_of_the_input_gradient_are_the_quantization_kernels(interpret, shape, form, dtype) -> None:
    """With ``grad_factors`` the backward offers the per-row codes of ``dx`` times them (the output gradient of
    the projection whose output is the branch, with that projection's row scales): the bits of the FP8
    quantization of ``dx`` with those factors; every result is that of the norm without codes."""
    x, weight, dy = _inputs(shape, dtype)
    branch, _, dh = _inputs(shape, dtype, seed=1)
    dh[..., 0, :] = 0
    dy[..., 0, :] = 0  # all-zero rows of dx: scale 1
    factors = torch.rand(shape[-1], generator=torch.Generator().manual_seed(2)) * 1e-2
    plain = _residual_run(x, branch, weight, dh, dy, lambda a, b, w: residual_rms_norm(a, b, w, 1e-6, form))
    coded = _residual_run(
        x,
        branch,
        weight,
        dh,
        dy,
        lambda a, b, w: residual_rms_norm(a, b, w, 1e-6, form, grad_factors=factors),
    )
    for what, p, c in zip(["h", "y", "dx", "dw", "dbranch"], plain, coded, strict=True):
        assert torch.equal(p, c), what
    dx = coded[2].reshape(-1, shape[-1])
    assert fp8_operands.take_codes(dx) is None, "codes without the factors"
    offered = fp8_operands.take_codes(dx, [factors])
    assert offered is not None, "no codes offered for dx"
    want_codes, want_scales = quantize_rows(padded_rows(dx.float() * factors), reciprocal=True)
    assert torch.equal(offered[1], want_scales)
    assert torch.equal(offered[0].view(torch.uint8), want_codes.view(torch.uint8))


def test_backward_op_passes_opcheck(interpret) -> None:
    """The backward custom op, with and without the residual gradient and the FP8 codes of ``dx``."""
    x, weight, dy = _inputs((5, 32), torch.float32)
    r = torch.rand(5)
    for factors in (None, torch.rand(32)):
        for dh in (None, dy * 2):
            torch.library.opcheck(kernels._backward_op, (dy, x, weight, r, 0.0, True, False, factors, dh))
