"""The gated-MLP kernels vs torch (Triton interpreter, fp32 and fp16): the forward with the LoRA terms added
inside that also forms the down projection's ``h A_dᵀ``, and the backward that takes the MLP's rank-r
reductions."""

from __future__ import annotations

from types import SimpleNamespace
from typing import NamedTuple

import pytest
import torch

from loralei.kernels import gated_mlp, gated_mlp_launch
from loralei.kernels.activations import ACTIVATIONS
from loralei.ops.reference import gated_activation
from tolerances import assert_fp32_close, assert_low_precision_close


@pytest.fixture
def looping_interpreter(interpret) -> None:
    if not gated_mlp.interpreter_runs_loops():
        pytest.skip(
            "this Triton's interpreter cannot run loops with run-time bounds; the GPU tests cover the kernel"
        )


# (T, I, r_down, r_gate, r_up, splits): odd sizes, ranks below and above the 16-wide padding, unequal ranks,
# and reductions split among several programs (some of them left with no rows or columns).
CASES = [(37, 45, 8, 8, 8, 1), (21, 70, 1, 3, 20, 2), (50, 33, 16, 16, 16, 3), (5, 19, 64, 2, 5, 7)]
SCALES = (2.0, 0.5, 1.25)  # s_d, s_g, s_u
F32 = (torch.float32,) * 3  # the backward products' dtypes


class Inputs(NamedTuple):
    gate: torch.Tensor  # G₀ (T, I)
    up: torch.Tensor  # U₀
    dh: torch.Tensor  # dh₀
    terms: tuple  # (dh_term, gate_term, up_term) as gated_mlp.LowRank


def _inputs(tokens, inter, r_d, r_g, r_u, dtype) -> Inputs:
    """Base operands and LoRA terms in ``dtype``; the z's are strided column views and the m's come in both
    layouts the MLP passes (``A_d`` row-major, ``B_gᵀ`` / ``B_uᵀ`` transposed views; B_u in fp32 as with
    ``lora_fp32_gradients``)."""
    gen = torch.Generator().manual_seed(tokens * inter + r_d)
    gate = (torch.randn(tokens, inter, generator=gen) * 3).to(dtype)  # wide: reaches the activations' tails
    up, dh = (torch.randn(tokens, inter, generator=gen).to(dtype) for _ in range(2))
    p_down = torch.randn(tokens, r_d, generator=gen).to(dtype)
    z = torch.randn(tokens, r_g + r_u, generator=gen).to(dtype)
    a_d = (torch.randn(r_d, inter, generator=gen) / 4).to(dtype)
    b_g = (torch.randn(inter, r_g, generator=gen) / 4).to(dtype)
    b_u = torch.randn(inter, r_u, generator=gen) / 4
    s_d, s_g, s_u = SCALES
    terms = (
        gated_mlp.LowRank(p_down, a_d, s_d),
        gated_mlp.LowRank(z[:, :r_g], b_g.t(), s_g),
        gated_mlp.LowRank(z[:, r_g:], b_u.t(), s_u),
    )
    return Inputs(gate, up, dh, terms)


def _full(base: torch.Tensor, term, dtype: torch.dtype) -> torch.Tensor:
    """``base + s z m`` in ``dtype``."""
    return base.to(dtype) + term.scale * (term.z.to(dtype) @ term.m.to(dtype))


def _expected_forward(inp: Inputs, activation: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(h, h A_dᵀ)`` in ``dtype`` (the product from h rounded to it, accumulated in fp32 for fp16)."""
    dh_term, gate_term, up_term = inp.terms
    h = gated_activation(_full(inp.gate, gate_term, dtype), _full(inp.up, up_term, dtype), activation)
    acc = torch.float32 if dtype == torch.float16 else dtype
    return h, h.to(acc) @ dh_term.m.to(dtype).to(acc).t()


def _forward(inp: Inputs, activation: str, per_split: int = gated_mlp.SPLIT_COLUMNS) -> tuple:
    return gated_mlp.gated_mlp_forward(
        inp.gate, inp.up, *inp.terms[1:], inp.terms[0].m, activation, per_split
    )


def _expected_backward(inp: Inputs, activation: str, dtype: torch.dtype) -> tuple:
    """``(dG, dU, s_d P_dᵀh, s_g dGᵀZ_g, s_u dUᵀZ_u)`` by autograd and matmuls in ``dtype`` (h, dG, dU rounded
    to it)."""
    dh_term, gate_term, up_term = inp.terms
    g = _full(inp.gate, gate_term, dtype).requires_grad_()
    u = _full(inp.up, up_term, dtype).requires_grad_()
    h = gated_activation(g, u, activation)
    d_gate, d_up = torch.autograd.grad(h, (g, u), _full(inp.dh, dh_term, dtype))
    # the products from the dtype's values, accumulated in fp32 for fp16 (as the kernel and the GEMMs it replaces)
    acc = torch.float32 if dtype == torch.float16 else dtype
    h, dg, du = (t.detach().to(acc) for t in (h, d_gate, d_up))
    pd, zg, zu = (t.z.to(acc) for t in inp.terms)
    s_d, s_g, s_u = SCALES
    return d_gate, d_up, s_d * (pd.t() @ h), s_g * (dg.t() @ zg), s_u * (du.t() @ zu)


def _backward(inp: Inputs, activation: str, splits: int | None = None, dtypes=(torch.float32,) * 3) -> tuple:
    d_gate, d_up = inp.gate.clone(), inp.up.clone()
    products = gated_mlp.gated_mlp_backward_(inp.dh, d_gate, d_up, *inp.terms, activation, dtypes, splits)
    return (d_gate, d_up, *products)


def _assert_close(got, fp64, plain, dtype, names) -> None:
    """fp32: within FP32_REL of fp64; fp16: no further from fp64 than plain torch in fp16 (tolerances table)."""
    for name, g, ref, pln in zip(names, got, fp64, plain, strict=True):
        if dtype == torch.float32:
            assert_fp32_close(g, ref, name)
        else:
            assert_low_precision_close(g.to(dtype), pln.to(dtype), ref, dtype, name)


NAMES = ("dG", "dU", "s_d P_d^T h", "s_g dG^T Z_g", "s_u dU^T Z_u")


@pytest.mark.parametrize("activation", sorted(ACTIVATIONS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", CASES)
def test_forward_kernel_matches_torch_in_interpreter(looping_interpreter, activation, dtype, case):
    tokens, inter, r_d, r_g, r_u, splits = case
    inp = _inputs(tokens, inter, r_d, r_g, r_u, dtype)
    # 32 columns per split (the interpreter's column block) spread the columns over up to 3 programs
    got = _forward(inp, activation, 32 if splits > 1 else gated_mlp.SPLIT_COLUMNS)
    assert [(t.shape, t.dtype) for t in got] == [((tokens, inter), dtype), ((tokens, r_d), dtype)]
    plain = _expected_forward(inp, activation, dtype)
    _assert_close(got, _expected_forward(inp, activation, torch.float64), plain, dtype, ["h", "h A_d^T"])


@pytest.mark.parametrize("activation", sorted(ACTIVATIONS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", CASES)
def test_backward_kernel_matches_torch_in_interpreter(looping_interpreter, activation, dtype, case):
    tokens, inter, r_d, r_g, r_u, splits = case
    inp = _inputs(tokens, inter, r_d, r_g, r_u, dtype)
    assert gated_mlp.usable(inp.gate, (r_d, r_g, r_u))
    got = _backward(inp, activation, splits)
    assert [t.shape for t in got] == [
        (tokens, inter),
        (tokens, inter),
        (r_d, inter),
        (inter, r_g),
        (inter, r_u),
    ]
    assert [t.dtype for t in got] == [dtype] * 2 + [torch.float32] * 3
    reference = _expected_backward(inp, activation, torch.float64)
    _assert_close(got, reference, _expected_backward(inp, activation, dtype), dtype, NAMES)


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize(
    ("tokens", "inter", "r_d", "r_g", "r_u"), [(4096, 3072, 16, 16, 16), (1500, 2900, 8, 16, 5)]
)
def test_backward_kernel_on_gpu_in_bf16(activation, tokens, inter, r_d, r_g, r_u):
    """The compiled, autotuned backward at sizes where each program loops over many row blocks (each one's loads
    issued while the last is computed) and the column blocks end inside the last one."""
    inp = _inputs(tokens, inter, r_d, r_g, r_u, torch.bfloat16)
    on_gpu = Inputs(
        inp.gate.cuda(),
        inp.up.cuda(),
        inp.dh.cuda(),
        tuple(t._replace(z=t.z.cuda(), m=t.m.cuda()) for t in inp.terms),
    )
    got = [t.cpu() for t in _backward(on_gpu, activation)]
    plain = _expected_backward(inp, activation, torch.bfloat16)
    _assert_close(got, _expected_backward(inp, activation, torch.float64), plain, torch.bfloat16, NAMES)


def test_backward_products_land_in_the_dtypes_asked_for(looping_interpreter):
    """Each scaled product is rounded once from its fp32 sum to its own dtype (the factors' dtypes can differ)."""
    inp = _inputs(30, 40, 8, 20, 3, torch.float32)
    dtypes = (torch.float16, torch.float32, torch.float16)
    got = _backward(inp, "silu", 3, dtypes)
    assert [t.dtype for t in got[2:]] == list(dtypes)
    for name, g, want in zip(NAMES[2:], got[2:], _backward(inp, "silu", 3)[2:], strict=True):
        assert torch.equal(g, want.to(g.dtype)), name


def test_zero_terms_leave_the_base_operands(looping_interpreter):
    """With all-zero LoRA factors the kernels compute the plain gated activation and its backward."""
    inp = _inputs(30, 40, 8, 8, 8, torch.float32)
    inp = inp._replace(terms=tuple(t._replace(m=torch.zeros_like(t.m)) for t in inp.terms))
    h, _ = _forward(inp, "silu")
    assert_fp32_close(h, gated_activation(inp.gate.double(), inp.up.double(), "silu"), "h")
    g, u = inp.gate.double().requires_grad_(), inp.up.double().requires_grad_()
    d_gate, d_up = torch.autograd.grad(gated_activation(g, u, "silu"), (g, u), inp.dh.double())
    got = _backward(inp, "silu")
    assert_fp32_close(got[0], d_gate, "dG")
    assert_fp32_close(got[1], d_up, "dU")


def test_split_count_does_not_change_the_result(looping_interpreter):
    """Any number of programs sharing a reduction (the backward's rows, the forward's columns) gives the same
    values (fp32)."""
    inp = _inputs(40, 50, 8, 8, 8, torch.float32)
    for results in (
        [_backward(inp, "silu", splits) for splits in (1, 2, 5)],
        [_forward(inp, "silu", per_split) for per_split in (gated_mlp.SPLIT_COLUMNS, 32)],
    ):
        for other in results[1:]:
            for a, b in zip(results[0], other, strict=True):
                assert_fp32_close(b, a)


def test_usable_only_where_triton_runs_and_rank_fits(monkeypatch):
    gate = torch.zeros(4, 8)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not gated_mlp.usable(gate, (8, 8, 8))  # CPU tensor, compiled mode: the unfused path runs
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert gated_mlp.usable(gate, (8, 8, gated_mlp.MAX_RANK)) == gated_mlp.interpreter_runs_loops()
    assert not gated_mlp.usable(gate, (8, 8, gated_mlp.MAX_RANK + 1))
    assert not gated_mlp.usable(gate.double(), (8, 8, 8))


class _Recorder:
    """A kernel as ``launch`` sees it: ``kernel[grid](*args, **kwargs)`` records the keyword arguments."""

    def __init__(self, name: str, calls: list) -> None:
        self.name, self.calls = name, calls

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((self.name, kwargs))


def test_gpu_launches_reuse_the_autotuned_config(monkeypatch):
    """After the first launch per key the kernel runs with the autotuner's choice, without the autotuner."""
    calls: list = []
    autotuned = _Recorder("autotune", calls)
    autotuned.fn = _Recorder("direct", calls)
    autotuned.best_config = SimpleNamespace(all_kwargs=lambda: {"BT": 32, "BI": 64, "num_warps": 4})
    monkeypatch.setattr(gated_mlp_launch, "_kernel", lambda backward, interpret: autotuned)
    monkeypatch.setattr(gated_mlp_launch, "_TUNED", {})
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    t = torch.zeros(2, 3, dtype=torch.bfloat16)
    for inter in (64, 64, 128, 64):
        gated_mlp_launch.launch(True, None, (t, t, 5, inter), inter, ACT=0, R=16, FULL=True)
    assert [name for name, _ in calls] == ["autotune", "direct", "autotune", "direct"]
    assert calls[1][1] == {
        "ACT": 0,
        "R": 16,
        "FULL": True,
        "PRECISION": "tf32",
        "BT": 32,
        "BI": 64,
        "num_warps": 4,
    }


def test_bad_layouts_are_refused(interpret):
    inp = _inputs(8, 16, 4, 4, 4, torch.float32)
    dh_term, gate_term, up_term = inp.terms
    with pytest.raises(ValueError, match="dh must be contiguous"):
        gated_mlp.gated_mlp_backward_(inp.dh.t().contiguous().t(), inp.gate, inp.up, *inp.terms, "silu", F32)
    narrow = dh_term._replace(z=dh_term.z.t().contiguous().t())
    with pytest.raises(ValueError, match=r"dh_term\.z must have contiguous columns"):
        gated_mlp.gated_mlp_backward_(inp.dh, inp.gate, inp.up, narrow, gate_term, up_term, "silu", F32)
    with pytest.raises(ValueError, match=r"up_term\.m is \(16, 4\), expected \(rank, I\) = \(4, 16\)"):
        bad = up_term._replace(m=up_term.m.t())
        gated_mlp.gated_mlp_forward(inp.gate, inp.up, gate_term, bad, dh_term.m, "silu")
    with pytest.raises(ValueError, match=r"down_a is \(16, 4\), expected \(rank, I\) with I = 16"):
        gated_mlp.gated_mlp_forward(inp.gate, inp.up, gate_term, up_term, dh_term.m.t(), "silu")


def test_ops_pass_opcheck(looping_interpreter):
    """The custom ops torch.compile sees: schemas (gate/up mutated by the backward), fake outputs, no aliasing."""
    inp = _inputs(12, 20, 4, 4, 4, torch.float32)
    dh_term, gate_term, up_term = (t._replace(z=t.z.contiguous()) for t in inp.terms)
    for columns in (torch.empty(1), 1 + torch.rand(4, 20)):  # without and with DoRA's column factors
        for h_max in (None, torch.zeros(12)):  # without and with the row maxima for FP8
            forward_args = (inp.gate, inp.up, *gate_term, *up_term, dh_term.m, "silu", 8, h_max, columns)
            torch.library.opcheck(gated_mlp._forward_op, forward_args)
        args = (inp.dh, inp.gate, inp.up, *dh_term, *gate_term, *up_term, "silu", 2, *F32)
        torch.library.opcheck(gated_mlp._backward_op, (*args, None, None, None, columns))
        maxima = (torch.zeros(12), torch.rand(20), torch.rand(20))
        torch.library.opcheck(gated_mlp._backward_op, (*args, *maxima, columns))


def _dora_columns(inter: int, dora: bool, seed: int) -> torch.Tensor | None:
    """DoRA's (4, I) rows ``f_g, b_g, f_u, b_u`` (factors in [0.5, 1.5), biases in [-1, 1)), or None."""
    if not dora:
        return None
    gen = torch.Generator().manual_seed(seed)
    rows = torch.rand(4, inter, generator=gen)
    return torch.stack([rows[0] + 0.5, 2 * rows[1] - 1, rows[2] + 0.5, 2 * rows[3] - 1])


@pytest.mark.parametrize("dora", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", CASES)
def test_kernels_take_the_row_maxima_of_what_they_write(looping_interpreter, dtype, case, dora):
    """Asked for them, the forward takes each row's ``max |h|`` and the backward ``max(|dG c_g|, |dU c_u|)``
    (of the values as stored, the factors applied in fp32: what the FP8 quantization of h and of ``[dG dU]``
    reads; with DoRA's columns, h of the scaled sums and ``f_g ⊙ dG``, ``f_u ⊙ dU``), bit for bit, over several
    column splits and row blocks; everything else they write is unchanged."""
    tokens, inter, r_d, r_g, r_u, splits = case
    inp = _inputs(tokens, inter, r_d, r_g, r_u, dtype)
    columns = _dora_columns(inter, dora, tokens)
    forward_args = (inp.gate, inp.up, *inp.terms[1:], inp.terms[0].m, "silu", 32)
    h_max = torch.zeros(tokens)
    h, z_down = gated_mlp.gated_mlp_forward(*forward_args, row_max=h_max, columns=columns)
    assert torch.equal(h_max, h.float().abs().amax(1))
    plain = gated_mlp.gated_mlp_forward(*forward_args, columns=columns)
    assert torch.equal(h, plain[0]) and torch.equal(z_down, plain[1])

    gen = torch.Generator().manual_seed(tokens)
    stale = torch.full((tokens,), float("nan"))  # the backward overwrites its maxima (no zeroing needed)
    maxima = gated_mlp.RowMaxima(stale, torch.rand(inter, generator=gen), torch.rand(inter) * 9)
    outs = []
    for row_max in (maxima, None):
        d_gate, d_up = inp.gate.clone(), inp.up.clone()
        products = gated_mlp.gated_mlp_backward_(
            inp.dh, d_gate, d_up, *inp.terms, "silu", F32, splits, row_max=row_max, columns=columns
        )
        outs.append((d_gate, d_up, *products))
    d_gate, d_up = outs[0][:2]
    expected = torch.maximum(
        (d_gate.float() * maxima.gate_factors).abs().amax(1), (d_up.float() * maxima.up_factors).abs().amax(1)
    )
    assert torch.equal(maxima.out, expected)
    for got, want in zip(*outs, strict=True):
        assert torch.equal(got, want)


def test_row_maxima_of_the_wrong_shape_are_refused(interpret):
    inp = _inputs(6, 16, 4, 4, 4, torch.float32)
    with pytest.raises(ValueError, match=r"row_max must be \(6,\) float32 on cpu, got \(5,\)"):
        gated_mlp.gated_mlp_forward(
            inp.gate, inp.up, *inp.terms[1:], inp.terms[0].m, "silu", row_max=torch.zeros(5)
        )
    maxima = gated_mlp.RowMaxima(torch.zeros(6), torch.rand(16), torch.rand(16, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"row_max factors must be contiguous \(16,\) float32"):
        gated_mlp.gated_mlp_backward_(inp.dh, inp.gate, inp.up, *inp.terms, "silu", F32, row_max=maxima)
