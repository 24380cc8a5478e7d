"""DoRA members in the fused gated MLP against PEFT's DoRA written plainly (``reference.dora_linear`` per DoRA
projection, ``reference.lora_linear`` for the others): the output and the gradients of x, every A, B and every
magnitude, in fp64 (torch path) and fp32 in the Triton interpreter (the MLP kernels with DoRA's column factors)."""

from __future__ import annotations

import pytest
import torch

from loralei.errors import LoraleiError
from loralei.ops import reference
from loralei.ops.dora import dora_scale, row_norms, squared_row_norms
from loralei.ops.lora_mlp import lora_mlp
from loralei.ops.lowrank_sum import lowrank_sum
from loralei.ops.weights import LoRAWeights
from op_cases import as_dtype, outputs_and_grads, projection
from tolerances import assert_fp32_close

NAMES = ("gate", "up", "down")
# which projections have DoRA: all, gate only (a mixed pair), down only, gate and up
PATTERNS = pytest.mark.parametrize("dora", [(1, 1, 1), (1, 0, 0), (0, 0, 1), (1, 1, 0)], ids=str)


def _magnitude(w: LoRAWeights, seed: int) -> torch.Tensor:
    """Row norms of ``W + s B A`` times a random factor near 1 (a leaf), as after some training."""
    g = torch.Generator().manual_seed(seed)
    norms = row_norms(w, squared_row_norms(w)).to(w.dtype)
    return (norms * (1 + 0.3 * torch.randn(norms.shape, generator=g, dtype=w.dtype))).requires_grad_()


def _setup(hidden: int, inter: int, r: int, bias: bool, dtype: torch.dtype, dora: tuple[int, int, int]):
    """gate, up, down projections and the magnitudes of the DoRA ones (None elsewhere)."""
    shapes = ((hidden, inter), (hidden, inter), (inter, hidden))
    projs = [
        as_dtype(projection(i, o, r, bias, scale=0.5 + k, seed=k), dtype) for k, (i, o) in enumerate(shapes)
    ]
    mags = [_magnitude(w, 10 + k) if d else None for k, (w, d) in enumerate(zip(projs, dora, strict=True))]
    return projs, mags


def _plain(projs, mags, activation):
    def one(x, w, m):
        return reference.lora_linear(x, w) if m is None else reference.dora_linear(x, w, m)

    def run(x):
        h = reference.gated_activation(one(x, projs[0], mags[0]), one(x, projs[1], mags[1]), activation)
        return [one(h, projs[2], mags[2])]

    return run


def _fused(projs, mags, activation):
    scales = [
        None if m is None else dora_scale(w, m, squared_row_norms(w))
        for w, m in zip(projs, mags, strict=True)
    ]
    return lambda x: [lora_mlp(x, *projs, activation, scales=tuple(scales))]


def _params(projs, mags):
    return [t for w in projs for t in (w.A, w.B)] + [m for m in mags if m is not None]


def _check(projs, mags, x, activation, tolerance):
    params = _params(projs, mags)
    fused = outputs_and_grads(_fused(projs, mags, activation), x, params)
    plain = outputs_and_grads(_plain(projs, mags, activation), x, params)
    names = [
        "Y",
        "dX",
        *(f"d{p}_{n}" for n in NAMES for p in "AB"),
        *(f"dm_{n}" for n, m in zip(NAMES, mags, strict=True) if m is not None),
    ]
    for name, got, want in zip(names, fused, plain, strict=True):
        assert got.shape == want.shape and got.dtype == want.dtype, name
        assert_fp32_close(got, want, name, tolerance=tolerance)


@PATTERNS
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(("hidden", "inter", "r"), [(12, 20, 4), (9, 31, 2)])
def test_torch_path_matches_peft_dora_fp64(dora, bias, hidden, inter, r):
    projs, mags = _setup(hidden, inter, r, bias, torch.float64, dora)
    x = torch.randn(2, 5, hidden, dtype=torch.float64)
    _check(projs, mags, x, "silu", 1e-12)


@PATTERNS
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_mlp_kernels_match_peft_dora_in_interpreter(monkeypatch, dora, bias, activation):
    """The MLP kernels apply g (and a DoRA member's bias) as they read the sums and return the column dots."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from loralei.kernels import gated_mlp

    if not gated_mlp.interpreter_runs_loops():
        pytest.skip("this Triton's interpreter cannot run loops with run-time bounds")
    launches = []
    for name in ("_forward_impl", "_backward_impl"):
        real = getattr(gated_mlp, name)
        monkeypatch.setattr(gated_mlp, name, lambda *a, _n=name, _f=real: launches.append(_n) or _f(*a))
    projs, mags = _setup(16, 40, 4, bias, torch.float32, dora)
    x = torch.randn(3, 7, 16)
    _check(projs, mags, x, activation, 1e-5)
    assert launches == ["_forward_impl", "_backward_impl"]


def test_refuses_dropout_and_hand_over_on_dora_down():
    projs, mags = _setup(8, 12, 2, False, torch.float32, (1, 1, 1))
    scales = tuple(dora_scale(w, m, squared_row_norms(w)) for w, m in zip(projs, mags, strict=True))
    x = torch.randn(4, 8)
    with pytest.raises(LoraleiError, match=r"lora_mlp up: DoRA with dropout_p=0\.1"):
        lora_mlp(x, projs[0], projs[1]._replace(dropout_p=0.1), projs[2], "silu", scales=scales)
    with pytest.raises(LoraleiError, match="hand_over with DoRA on down"):
        lora_mlp(x, *projs, "silu", hand_over=True, scales=scales)


def test_plain_down_hands_its_term_over_beside_dora_gate_and_up():
    """DoRA on gate/up only: down's LoRA term still goes to the caller's residual add (lowrank_sum)."""
    projs, mags = _setup(12, 20, 4, True, torch.float64, (1, 1, 0))
    scales = tuple(
        None if m is None else dora_scale(w, m, squared_row_norms(w))
        for w, m in zip(projs, mags, strict=True)
    )

    def handed(x):
        base, u = lora_mlp(x, *projs, "silu", hand_over=True, scales=scales)
        flat = base.reshape(-1, base.shape[-1])
        return [lowrank_sum(u, projs[2].B, flat).view_as(base)]

    x = torch.randn(2, 5, 12, dtype=torch.float64)
    params = _params(projs, mags)
    got = outputs_and_grads(handed, x, params)
    want = outputs_and_grads(_plain(projs, mags, "silu"), x, params)
    for k, (a, b) in enumerate(zip(got, want, strict=True)):
        assert_fp32_close(a, b, f"output/grad {k}", tolerance=1e-12)
