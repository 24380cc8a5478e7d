"""The fused experts op against its expert-by-expert twin: outputs and every gradient (input, routing weights,
both banks' factors) at several shapes, with idle experts, one bank adapted, transposed banks, FP32 factors, and
the recompute-in-backward path taken under checkpointing; plus the routing and grouped-GEMM helpers."""

from __future__ import annotations

import pytest
import torch

from loralei.errors import LoraleiError
from loralei.kernels import moe
from loralei.ops import reference
from loralei.ops.grouped import grouped_mm, grouped_weight_grad, sort_routes
from loralei.ops.lora_experts import lora_experts
from loralei.ops.weights import ExpertBank
from tolerances import assert_fp32_close

SHAPES = [  # tokens, hidden, intermediate, experts, top_k, rank
    (16, 32, 24, 4, 2, 4),
    (37, 24, 40, 8, 3, 8),
    (5, 16, 8, 6, 1, 2),
]


def _bank(
    e: int,
    inp: int,
    out: int,
    r: int,
    g: torch.Generator,
    *,
    adapted=True,
    transposed=False,
    lora_dtype=torch.float32,
) -> ExpertBank:
    w = torch.randn(e, out, inp, generator=g) / inp**0.5
    if transposed:
        w = w.transpose(-2, -1).contiguous()
    a = (torch.randn(e, r, inp, generator=g) / inp**0.5).to(lora_dtype).requires_grad_() if adapted else None
    b = (torch.randn(e, out, r, generator=g) / r**0.5).to(lora_dtype).requires_grad_() if adapted else None
    return ExpertBank(w, None, a, b, 0.75, None, transposed)


def _case(shape, *, idle: int = 0, seed: int = 0, up_adapted=True, down_adapted=True, transposed=False):
    t, h, i, e, k, r = shape
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g).requires_grad_()
    scores = torch.randn(t, e, generator=g)
    scores[:, e - idle :] = -1e9  # the last `idle` experts receive no tokens
    weights, index = scores.softmax(-1).topk(k, dim=-1)
    up = _bank(e, h, 2 * i, r, g, adapted=up_adapted, transposed=transposed)
    down = _bank(e, i, h, r, g, adapted=down_adapted, transposed=transposed)
    return x, index, weights.detach().requires_grad_(), up, down


def _run(op, case, *extra):
    x, index, weights, up, down = case
    out = op(x, index, weights, up, down, *extra)
    dy = torch.randn(out.shape, generator=torch.Generator().manual_seed(7))
    tensors = [x, weights, *(t for b in (up, down) for t in (b.A, b.B) if t is not None)]
    grads = torch.autograd.grad(out, tensors, dy)
    return [out, *grads]


def _gate(gate_up: torch.Tensor) -> torch.Tensor:
    return reference.gated_activation(*gate_up.chunk(2, dim=-1), "silu")


def _assert_fused_matches_twin(case, what: str) -> None:
    fused = _run(lora_experts, case, "silu")
    plain = _run(reference.lora_experts, case, _gate)
    names = ["out", "dx", "dweights", "dA_up", "dB_up", "dA_down", "dB_down"]
    for name, f, p in zip(names[: len(fused)], fused, plain, strict=True):
        assert_fp32_close(f, p, f"{what} {name}")


@pytest.mark.parametrize("shape", SHAPES)
def test_fused_equals_twin(shape) -> None:
    _assert_fused_matches_twin(_case(shape), f"{shape}")


@pytest.mark.parametrize("shape", SHAPES[:2])
def test_idle_experts(shape) -> None:
    _assert_fused_matches_twin(_case(shape, idle=2), f"{shape} idle")


@pytest.mark.parametrize(("up_adapted", "down_adapted"), [(True, False), (False, True)])
def test_one_bank_adapted(up_adapted: bool, down_adapted: bool) -> None:
    _assert_fused_matches_twin(_case(SHAPES[0], up_adapted=up_adapted, down_adapted=down_adapted), "one bank")


def test_transposed_banks() -> None:
    _assert_fused_matches_twin(_case(SHAPES[1], transposed=True), "transposed")


def test_fp32_factors_with_fp64_banks_keep_their_dtype() -> None:
    x, index, weights, up, down = _case(SHAPES[0])
    up = up._replace(W=up.W.double())
    down = down._replace(W=down.W.double())
    grads = _run(lora_experts, (x, index, weights, up, down), "silu")
    assert grads[0].dtype == torch.float64 and grads[1].dtype == torch.float32
    assert all(g.dtype == torch.float32 for g in grads[3:])


@pytest.mark.parametrize("hooks", ["checkpoint", "save_on_cpu"])
def test_recompute_path_under_saved_tensor_hooks(hooks: str) -> None:
    """With saved-tensor hooks active the op keeps its input only and recomputes in backward: same grads."""
    case = _case(SHAPES[1], idle=1)
    expected = _run(lora_experts, case, "silu")
    x, index, weights, up, down = case
    if hooks == "checkpoint":
        out = torch.utils.checkpoint.checkpoint(
            lora_experts, x, index, weights, up, down, "silu", use_reentrant=False
        )
    else:
        with torch.autograd.graph.save_on_cpu():
            out = lora_experts(x, index, weights, up, down, "silu")
    dy = torch.randn(out.shape, generator=torch.Generator().manual_seed(7))
    grads = torch.autograd.grad(out, [x, weights, up.A, up.B, down.A, down.B], dy)
    for name, got, want in zip(
        ["out", "dx", "dw", "dA_u", "dB_u", "dA_d", "dB_d"], [out, *grads], expected, strict=True
    ):
        assert_fp32_close(got, want, f"{hooks} {name}")


def _layer(case, after: torch.Tensor | None):
    """An MoE layer around the op: the routing computed from the input (its router trainable), the residual
    add, and with ``after`` an op that saves the layer's output (a norm-like scale), as a later op would."""
    x, index, _, up, down = case
    e, k = up.W.shape[0], index.shape[1]
    router = (torch.randn(x.shape[1], e, generator=torch.Generator().manual_seed(3)) / 4).requires_grad_()

    def layer(hidden: torch.Tensor) -> torch.Tensor:
        weights, idx = (hidden @ router).softmax(-1).topk(k, dim=-1)
        out = hidden + lora_experts(hidden, idx, weights, up, down, "silu")
        return out * after if after is not None else out

    return layer, [x, router, up.A, up.B, down.A, down.B]


@pytest.mark.parametrize("read_after", [False, True])
def test_input_only_checkpoint_keeps_the_recomputed_values_and_skips_the_unread_output(
    read_after: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The runner's checkpoint (loralei.train.input_checkpoint) runs the layer without autograd, then again with
    it before the backward: that second run keeps G, Z_u, Z_d (no third gate_up pass in the backward) and, as
    only the residual add reads its output, skips the down bank's products and the combine. 16 grouped GEMMs
    (6 forward, 4 again, 6 backward) instead of 22; same output and gradients. When a later op saves the
    output, the layer is recomputed in full (its output filled) and still gives the same gradients."""
    from loralei.ops import lora_experts as op
    from loralei.train.input_checkpoint import InputCheckpoint

    after = torch.randn(SHAPES[1][1], generator=torch.Generator().manual_seed(5)) if read_after else None
    case = _case(SHAPES[1], idle=1)
    layer, tensors = _layer(case, after.requires_grad_() if after is not None else None)
    tensors += [after] if after is not None else []
    dy = torch.randn(case[0].shape, generator=torch.Generator().manual_seed(7))

    def run(forward) -> list[torch.Tensor]:
        """The output and every gradient (the checkpoint hands the parameters theirs through ``.grad``)."""
        for t in tensors:
            t.grad = None
        out = forward(layer, case[0])
        out.backward(dy)
        return [out.detach(), *(t.grad for t in tensors)]

    want = run(lambda f, x: f(x))
    calls = {"grouped_mm": 0}

    def counted(*args, **kwargs):
        calls["grouped_mm"] += 1
        return grouped_mm(*args, **kwargs)

    monkeypatch.setattr(op, "grouped_mm", counted)
    got = run(InputCheckpoint(offload=False))
    names = ["out", "dx", "drouter", "dA_u", "dB_u", "dA_d", "dB_d", "dafter"][: len(want)]
    for name, g, w in zip(names, got, want, strict=True):
        assert_fp32_close(g, w, f"input-only checkpoint {name}")
    # read after: the deferred run is noticed, and the layer runs again in full (6 more)
    assert calls["grouped_mm"] == (16 + 6 if read_after else 16)


@pytest.mark.parametrize("lean", [False, True])
@pytest.mark.parametrize(("up_adapted", "down_adapted"), [(True, True), (True, False), (False, True)])
def test_triton_kernels_in_the_interpreter_equal_twin(
    lean: bool, up_adapted: bool, down_adapted: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The op's Triton path (row gather, combine, activation and its backward, each summing the base and LoRA
    addends as it reads them) in the interpreter, kept and recomputed (saved-tensor hooks) alike."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(moe, "_summed", None)  # the torch paths' helper: calling it fails the test
    case = _case(SHAPES[1], idle=1, up_adapted=up_adapted, down_adapted=down_adapted)
    plain = _run(reference.lora_experts, case, _gate)
    if lean:
        with torch.autograd.graph.save_on_cpu():
            fused = _run(lora_experts, case, "silu")
    else:
        fused = _run(lora_experts, case, "silu")
    for i, (f, p) in enumerate(zip(fused, plain, strict=True)):
        assert_fp32_close(f, p, f"interpreter lean={lean} output/grad {i}")


def test_bank_with_bias_or_trainable_is_refused() -> None:
    x, index, weights, up, down = _case(SHAPES[0])
    with pytest.raises(LoraleiError, match="has a bias"):
        lora_experts(x, index, weights, up._replace(bias=torch.zeros(4, 48)), down, "silu")
    with pytest.raises(LoraleiError, match="requires grad"):
        lora_experts(x, index, weights, up._replace(W=up.W.requires_grad_()), down, "silu")


# --- routing and grouped GEMMs ---


def test_sort_routes_groups_rows_by_expert() -> None:
    index = torch.tensor([[2, 0], [2, 1], [0, 2]])
    routing = sort_routes(index, 4)
    assert routing.counts.tolist() == [2, 1, 3, 0] and routing.offsets.tolist() == [2, 3, 6, 6]
    assert index.flatten()[routing.order].tolist() == [0, 0, 1, 2, 2, 2]
    assert routing.token.tolist() == (routing.order // 2).tolist()
    assert torch.equal(routing.order[routing.position], torch.arange(6))
    rows = routing.order.double().unsqueeze(-1)  # the sorted row of route j holds j
    assert routing.combine(rows).flatten().tolist() == [0 + 1, 2 + 3, 4 + 5]


def test_grouped_products_equal_per_expert_matmuls() -> None:
    g = torch.Generator().manual_seed(0)
    index = torch.randint(0, 5, (30, 1), generator=g)
    index[index == 3] = 4  # expert 3 idle
    routing = sort_routes(index, 5)
    x, w = torch.randn(30, 6, generator=g), torch.randn(5, 6, 7, generator=g)
    b = torch.randn(30, 3, generator=g)
    out, wgrad = grouped_mm(x, w, routing), grouped_weight_grad(x.t(), b, routing, torch.float32)
    experts = index.flatten()[routing.order]
    for e in range(5):
        rows = experts == e
        if not rows.any():
            assert torch.equal(wgrad[e], torch.zeros(6, 3)), "an idle expert's sum is zero"
            continue
        assert_fp32_close(out[rows], x[rows] @ w[e], f"expert {e}")
        assert_fp32_close(wgrad[e], x[rows].t() @ b[rows], f"weight grad {e}")
