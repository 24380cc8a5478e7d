"""lora_group (fused shared-input group) against its twin reference.lora_group."""

from __future__ import annotations

import pytest
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from loralei.errors import LoraleiError
from loralei.kernels.joint_buffer import with_spare
from loralei.ops import reference
from loralei.ops.shared_input import _lora_group_grads_op, _lora_group_impl, _lora_group_op, lora_group
from op_cases import as_dtype, gemm_shapes, keep_mask, outputs_and_grads, plain_path_mask, projection
from tolerances import FP32_REL, assert_low_precision_close, rel_err

FP32 = FP32_REL


def _members(inp: int, outs: list[int], ranks: list[int], biases: list[bool]) -> list:
    return [
        projection(inp, o, r, b, seed=i) for i, (o, r, b) in enumerate(zip(outs, ranks, biases, strict=True))
    ]


def _compare(ws, x, masks=None, used=None) -> float:
    params = [t for w in ws for t in (w.A, w.B)]
    pick = (lambda outs: [outs[i] for i in used]) if used else list
    fused = outputs_and_grads(lambda t: pick(lora_group(t, ws, masks)), x, params)
    plain = outputs_and_grads(lambda t: pick(reference.lora_group(t, ws, masks)), x, params)
    return max(rel_err(f, p) for f, p in zip(fused, plain, strict=True))


@pytest.mark.parametrize("r", [1, 8, 64])
def test_qkv_like_group_matches_twin(r: int) -> None:
    ws = _members(33, [33, 11, 11], [r, r, r], [False, False, False])
    assert _compare(ws, torch.randn(2, 5, 33)) <= FP32


def test_mixed_ranks_biases_and_masks() -> None:
    """Some members with bias and some without, each member with its own mask (or none)."""
    ws = _members(21, [13, 7, 21], [1, 8, 3], [True, False, True])
    x = torch.randn(3, 4, 21)
    masks = [
        keep_mask(x.shape, 0.2, torch.float32, seed=1),
        None,
        keep_mask(x.shape, 0.5, torch.float32, seed=2),
    ]
    assert _compare(ws, x, masks) <= FP32


def test_single_member_and_all_biases() -> None:
    assert _compare(_members(9, [4], [2], [True]), torch.randn(5, 9)) <= FP32
    assert _compare(_members(9, [4, 6], [2, 3], [True, True]), torch.randn(5, 9)) <= FP32


def test_unused_outputs_get_zero_lora_gradients() -> None:
    ws = _members(12, [12, 6, 6], [4, 4, 4], [False, False, False])
    assert _compare(ws, torch.randn(2, 3, 12), used=[0, 2]) <= FP32


def test_drawn_masks_are_per_member_and_follow_member_order() -> None:
    ws = [w._replace(dropout_p=0.4) for w in _members(16, [8, 8], [4, 4], [False, False])]
    x = torch.randn(6, 16)
    torch.manual_seed(3)
    fused = lora_group(x, ws)
    torch.manual_seed(3)
    plain = [reference.lora_linear(x, w, plain_path_mask(x, w.dropout_p)) for w in ws]
    assert max(rel_err(f, p) for f, p in zip(fused, plain, strict=True)) <= FP32
    same_ab = [ws[0], ws[0]]
    a, b = lora_group(x, same_ab)
    assert rel_err(a, b) > 1e-3  # one mask each, not one shared mask


def test_saves_the_shared_input_once() -> None:
    ws = _members(32, [32, 8, 8], [4, 4, 4], [False, False, False])
    x = torch.randn(6, 32, requires_grad=True)
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        lora_group(x, ws)
    activations = [t for t in saved if t.shape == x.shape]
    assert len(activations) == 1 and activations[0].data_ptr() == x.data_ptr()


def test_rejects_bad_groups() -> None:
    ws = _members(8, [4, 4], [2, 2], [False, False])
    x = torch.randn(2, 8)
    with pytest.raises(LoraleiError, match="ws is empty"):
        lora_group(x, [])
    with pytest.raises(LoraleiError, match="dropout_masks"):
        lora_group(x, ws, [None])
    with pytest.raises(LoraleiError, match="share the input size"):
        lora_group(x, [ws[0], projection(9, 4, 2, False)])


def test_compiles_without_graph_break() -> None:
    ws = _members(16, [16, 8], [4, 2], [True, False])
    params = [t for w in ws for t in (w.A, w.B)]
    compiled = torch.compile(lambda t: lora_group(t, ws), backend="aot_eager", fullgraph=True)
    x = torch.randn(3, 16)
    fused = outputs_and_grads(compiled, x, params)
    plain = outputs_and_grads(lambda t: reference.lora_group(t, ws), x, params)
    assert max(rel_err(f, p) for f, p in zip(fused, plain, strict=True)) <= FP32


def test_eager_calls_skip_the_custom_op(monkeypatch) -> None:
    """Eager calls run the autograd.Function twin (less CPU time per call); the custom op serves torch.compile."""
    import loralei.ops.shared_input as module

    def refuse(*args):
        raise AssertionError("eager lora_group went through torch.library dispatch")

    monkeypatch.setattr(module, "_lora_group_op", refuse)
    ws = _members(16, [16, 8], [4, 2], [True, False])
    params = [t for w in ws for t in (w.A, w.B)]
    x = torch.randn(3, 16)
    fused = outputs_and_grads(lambda t: lora_group(t, ws), x, params)
    plain = outputs_and_grads(lambda t: reference.lora_group(t, ws), x, params)
    assert max(rel_err(f, p) for f, p in zip(fused, plain, strict=True)) <= FP32


def _gemms_of_step(ws, x: torch.Tensor, masks=None) -> tuple[list, list]:
    """Output shapes of the forward's GEMMs and of the backward's GEMMs of one lora_group step."""
    x = x.detach().requires_grad_()
    ys: list[torch.Tensor] = []
    forward = gemm_shapes(lambda: ys.extend(lora_group(x, ws, masks)))
    backward = gemm_shapes(lambda: torch.autograd.backward(ys, [torch.ones_like(y) for y in ys]))
    return forward, backward


# T = 6 tokens, in = 32; ranks 4, 3, 5 (Σr = 12) and outputs 24, 8, 8 are all distinct from T and in, so a
# GEMM's role can be read off its output shape.
_T, _IN, _RANKS = 6, 32, [4, 3, 5]


def test_unmasked_group_reads_the_input_once_per_direction() -> None:
    """Forward: one U GEMM X [A_i]ᵀ (T, Σr) instead of three; backward: one dA GEMM (Σr, in) instead of three."""
    ws = _members(_IN, [24, 8, 8], _RANKS, [False, True, False])
    forward, backward = _gemms_of_step(ws, torch.randn(_T, _IN))
    assert [s for s in forward if s[1] in (*_RANKS, 12)] == [(_T, 12)]
    assert len(forward) == 7  # U, then per member the LoRA term and the base GEMM into it
    assert [s for s in backward if s == (12, _IN) or s[0] in _RANKS] == [(12, _IN)]
    assert len(backward) == 11  # 3 G_i, 1 LoRA dX term, 3 dY_i W_i, 1 dA, 3 dB_i


def test_masked_members_keep_their_own_gemms_and_match_twin() -> None:
    """Member 1 masked, members 0 and 2 (not adjacent) batched: U (T, 9) + (T, 3), dA (9, in) + (3, in)."""
    ws = _members(_IN, [24, 8, 8], _RANKS, [True, False, True])
    x = torch.randn(2, 3, _IN)
    masks = [None, keep_mask(x.shape, 0.3, torch.float32, seed=5), None]
    forward, backward = _gemms_of_step(ws, x, masks)
    assert sorted(s for s in forward if s[1] in (*_RANKS, 9)) == [(_T, 3), (_T, 9)]
    assert sorted(s for s in backward if s[1] == _IN and s[0] != _T) == [(3, _IN), (9, _IN)]
    assert _compare(ws, x, masks) <= FP32
    assert _compare(ws, x, masks, used=[1, 2]) <= FP32


def test_member_gradients_do_not_share_storage() -> None:
    """dA_i come from one GEMM but each is its own tensor: .grad must not pin (or alias) a shared buffer."""
    ws = _members(_IN, [24, 8, 8], _RANKS, [False, False, False])
    torch.stack([y.sum() for y in lora_group(torch.randn(_T, _IN), ws)]).sum().backward()
    storages = {w.A.grad.untyped_storage().data_ptr() for w in ws}
    assert len(storages) == 3 and all(w.A.grad.is_contiguous() for w in ws)


@pytest.mark.parametrize("lora_dtype", [torch.bfloat16, torch.float32])
def test_low_precision_group_error_within_twice_plain(lora_dtype: torch.dtype) -> None:
    """bf16 bases, A/B bf16 or FP32 (lora_fp32_gradients), unmasked members batched; dA/dB in A's/B's dtype."""
    ws = [
        projection(64, out, 8, bias=out == 16, dtype=torch.bfloat16, lora_dtype=lora_dtype, seed=i, scale=0.3)
        for i, out in enumerate([64, 16, 16])
    ]
    params = [t for w in ws for t in (w.A, w.B)]
    x = torch.randn(4, 16, 64)
    w64 = [as_dtype(w, torch.float64) for w in ws]
    params64 = [t for w in w64 for t in (w.A, w.B)]
    exact = outputs_and_grads(lambda t: reference.lora_group(t, w64), x.double(), params64)
    fused = outputs_and_grads(lambda t: lora_group(t, ws), x, params)
    plain = outputs_and_grads(lambda t: reference.lora_group(t, ws), x, params)
    assert all(g.dtype == lora_dtype for g in fused[4:])
    for f, p, e in zip(fused, plain, exact, strict=True):
        assert_low_precision_close(f, p, e, torch.bfloat16)


def test_compiles_with_masked_and_unmasked_members() -> None:
    ws = _members(16, [16, 8, 8], [4, 2, 3], [True, False, False])
    params = [t for w in ws for t in (w.A, w.B)]
    x = torch.randn(3, 16)
    masks = [None, keep_mask(x.shape, 0.5, torch.float32, seed=3), None]
    compiled = torch.compile(lambda t: lora_group(t, ws, masks), backend="aot_eager", fullgraph=True)
    fused = outputs_and_grads(compiled, x, params)
    plain = outputs_and_grads(lambda t: reference.lora_group(t, ws, masks), x, params)
    assert max(rel_err(f, p) for f, p in zip(fused, plain, strict=True)) <= FP32


@pytest.mark.parametrize("masked", [(), (1,), (0, 1, 2)])
def test_op_passes_opcheck(masked: tuple[int, ...]) -> None:
    """Schema, fake (the U_plain/masked-U output layout; (T, 0) U_plain when all are masked), no aliasing."""
    ws = _members(16, [16, 8, 8], [4, 2, 3], [True, False, False])
    x = torch.randn(3, 16, requires_grad=True)
    keeps = [keep_mask(x.shape, 0.5, torch.float32, seed=i) if i in masked else None for i in range(3)]
    args = (x, [w.W for w in ws], [-1] * 3, [w.bias for w in ws], [w.A for w in ws], [w.B for w in ws], keeps)
    torch.library.opcheck(_lora_group_op, (*args, [1.0] * 3, [w.scale for w in ws]))


def test_the_backward_op_gives_contiguous_gradients_that_share_no_memory() -> None:
    """Unmasked members' dA are row blocks of one GEMM; the compiler's op must get them apart (and contiguous),
    with the values the eager backward gives."""
    ws = _members(16, [16, 8, 8], [4, 2, 3], [False, False, False])
    x = torch.randn(5, 16)
    Ws, As, Bs = [w.W for w in ws], [w.A for w in ws], [w.B for w in ws]
    outs = _lora_group_impl(x, Ws, [-1] * 3, [None] * 3, As, Bs, [None] * 3, [1.0] * 3, [w.scale for w in ws])
    dys = [torch.randn_like(y) for y in outs[:3]]
    args = (dys, x, Ws, [-1] * 3, As, Bs, [None] * 3, outs[3], [], [1.0] * 3, [w.scale for w in ws], True)
    grads = _lora_group_grads_op(*args)
    assert len({g.untyped_storage().data_ptr() for g in grads}) == len(grads) == 7
    assert all(g.is_contiguous() for g in grads)
    plain = torch.autograd.grad(
        sum((y * dy).sum() for y, dy in zip(reference.lora_group(x.requires_grad_(), ws), dys, strict=True)),
        [x, *As, *Bs],
    )
    for g, e in zip(grads, plain, strict=True):
        assert rel_err(g, e) <= FP32_REL


def _with_scales(ws: list, scales: tuple[float, ...]) -> list:
    return [w._replace(scale=s) for w, s in zip(ws, scales, strict=True)]


def test_members_with_their_own_scales_match_twin() -> None:
    ws = _with_scales(_members(16, [16, 8, 8], [4, 2, 4], [False] * 3), (0.5, 2.0, 0.75))
    assert _compare(ws, torch.randn(3, 16)) <= FP32


class _OpsReading(TorchDispatchMode):
    """The names of the ops that take one of ``tensors`` (by storage) as an input."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        super().__init__()
        self.storages = {t.untyped_storage().data_ptr() for t in tensors}
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        inputs = [t for t in pytree.tree_leaves((args, kwargs or {})) if isinstance(t, torch.Tensor)]
        if any(t.untyped_storage().data_ptr() in self.storages for t in inputs):
            self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("scales", [(0.75, 0.75, 0.75), (0.5, 2.0, 0.75)])
def test_a_scale_shared_by_the_members_is_the_input_gradient_gemms_alpha(scales) -> None:
    """With one scale the LoRA input-gradient GEMM takes it as alpha, so no scaled copy of any A_i is made (a
    kernel per member saved); members with their own scales get A_i scaled first, and match the twin above."""
    ws = _with_scales(_members(_IN, [24, 8, 8], _RANKS, [False] * 3), scales)
    x = torch.randn(_T, _IN, requires_grad=True)
    ys = lora_group(x, ws)
    with _OpsReading([w.A for w in ws]) as reads:
        torch.autograd.backward(ys, [torch.ones_like(y) for y in ys])
    assert ("mul" in reads.names) == (len(set(scales)) > 1), reads.names


def test_each_member_reads_its_output_gradient_once_in_the_interpreter(monkeypatch) -> None:
    """Where the Triton kernel runs, G_i = dY_i B_i and dB_i = s_i dY_iᵀ U_i come from one pass over each dY_i
    (no G_i or dB_i GEMM is left), masked members included, and the group still equals its twin."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from loralei.kernels import gated_mlp, output_grad

    if not gated_mlp.interpreter_runs_loops():
        pytest.skip("this Triton's interpreter cannot run loops with run-time bounds")
    passes: list[tuple[int, ...]] = []
    real = output_grad.output_grad_products
    monkeypatch.setattr(
        output_grad,
        "output_grad_products",
        lambda dy, *a, **k: passes.append(tuple(dy.shape)) or real(dy, *a, **k),
    )
    ws = _members(_IN, [24, 8, 8], _RANKS, [False, True, False])
    x = torch.randn(2, 3, _IN)
    masks = [None, keep_mask(x.shape, 0.3, torch.float32, seed=5), None]
    _, backward = _gemms_of_step(ws, x, masks)
    assert passes == [(_T, 24), (_T, 8), (_T, 8)]
    assert [s for s in backward if s[1] in _RANKS] == []  # neither a (T, r_i) G_i nor an (out_i, r_i) dB_i
    assert _compare(ws, x, masks) <= FP32


def _stacked(ws: list) -> list:
    """The members with their base weights moved into one buffer, as row blocks (as the fusion stacks them)."""
    stacked = torch.cat([w.W for w in ws])
    return [
        w._replace(W=block) for w, block in zip(ws, stacked.split([w.W.shape[0] for w in ws]), strict=True)
    ]


def _input_gradient_gemms(ws, x: torch.Tensor, grads: list[torch.Tensor]) -> tuple[list, torch.Tensor]:
    """The (T, in) GEMMs of the backward for these output gradients, and dX."""
    x = x.detach().requires_grad_()
    ys = lora_group(x, ws)
    dx: list[torch.Tensor] = []
    shapes = gemm_shapes(lambda: dx.extend(torch.autograd.grad(ys, [x], grads)))
    return [s for s in shapes if s == (_T, _IN)], dx[0]


def test_members_side_by_side_take_their_input_gradient_in_one_gemm() -> None:
    """Stacked base weights and output gradients that are adjacent columns of one buffer (the fused q/k/v):
    ``Σ dY_i W_i`` is one GEMM after the LoRA term, with the value of three."""
    ws = _members(_IN, [24, 8, 8], _RANKS, [False, True, False])
    stacked_ws = _stacked(ws)
    x, dy = torch.randn(_T, _IN), torch.randn(_T, 40)
    side_by_side = list(dy.split([24, 8, 8], dim=1))
    apart = [g.clone() for g in side_by_side]
    joint, dx_joint = _input_gradient_gemms(stacked_ws, x, side_by_side)
    separate, dx = _input_gradient_gemms(stacked_ws, x, apart)
    assert (len(joint), len(separate)) == (2, 4)  # the LoRA term, then the base products into it
    assert len(_input_gradient_gemms(ws, x, side_by_side)[0]) == 4  # weights apart: one GEMM each
    assert rel_err(dx_joint, dx) <= FP32


def test_a_gradient_taken_into_spare_columns_joins_its_neighbours() -> None:
    """q's and k's output gradients side by side in a buffer with spare columns after them (as the RoPE backward
    leaves them), v's apart: v's is written there and the three base products are still one GEMM."""
    ws = _stacked(_members(_IN, [24, 8, 8], _RANKS, [False, False, False]))
    x = torch.randn(_T, _IN)
    buffer = with_spare(torch.randn(_T, 40), 32)
    grads = [buffer[:, :24], buffer[:, 24:32], torch.randn(_T, 8)]
    separate, dx = _input_gradient_gemms(ws, x, [g.clone() for g in grads])
    joint, dx_joint = _input_gradient_gemms(ws, x, grads)
    assert (len(joint), len(separate)) == (2, 4)
    assert torch.equal(buffer[:, 32:], grads[2])
    assert rel_err(dx_joint, dx) <= FP32


@pytest.mark.parametrize("masked", [False, True])
def test_kept_outputs_give_the_same_outputs_and_gradients_without_the_base_products(masked: bool) -> None:
    """A recomputation that has the members' outputs (ops.kept_outputs): the node forms only the U's, no base
    GEMM, and its outputs and every gradient are the computing node's, bit for bit."""
    ws = _members(21, [21, 7, 7], [4, 4, 2], [True, False, False])
    x = torch.randn(3, 4, 21)
    masks = [keep_mask(x.shape, 0.3, torch.float32, seed=1) if masked else None, None, None]
    params = [t for w in ws for t in (w.A, w.B)]
    with torch.no_grad():
        kept = [y.clone() for y in lora_group(x, ws, masks)]
    want = outputs_and_grads(lambda t: lora_group(t, ws, masks), x, params)
    got = outputs_and_grads(lambda t: lora_group(t, ws, masks, kept=kept), x, params)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    # the U GEMM(s) only: one (T, Σr) product for the plain members, one per masked member
    ranks = [w.A.shape[0] for w, m in zip(ws, masks, strict=True) if m is None]
    shapes = gemm_shapes(lambda: lora_group(x, ws, masks, kept=kept))
    assert shapes == [(12, sum(ranks))] + ([(12, 4)] if masked else [])


def test_kept_outputs_are_refused_with_dora_members_or_a_wrong_count() -> None:
    from loralei.ops.dora import DoRAScale

    ws = _members(8, [8, 4], [2, 2], [False, False])
    x = torch.randn(3, 8)
    with pytest.raises(LoraleiError, match=r"kept outputs \(1 for 2 projections\)"):
        lora_group(x, ws, kept=[torch.zeros(3, 8)])
    scale = DoRAScale(torch.ones(8), torch.ones(8))
    with pytest.raises(LoraleiError, match="LoRA members in eager mode only"):
        lora_group(x, ws, scales=[scale, None], kept=[torch.zeros(3, 8), torch.zeros(3, 4)])
