"""lora_group (fused shared-input group) against its twin reference.lora_group."""

from __future__ import annotations

import pytest
import torch

from loralei.errors import LoraleiError
from loralei.ops import reference
from loralei.ops.dropout import draw_keep_mask, scaled_mask
from loralei.ops.shared_input import lora_group
from op_cases import keep_mask, outputs_and_grads, projection
from tolerances import FP32_REL, rel_err

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
    plain = [reference.lora_linear(x, w, keep_mask_from_global(x, w.dropout_p)) for w in ws]
    assert max(rel_err(f, p) for f, p in zip(fused, plain, strict=True)) <= FP32
    same_ab = [ws[0], ws[0]]
    a, b = lora_group(x, same_ab)
    assert rel_err(a, b) > 1e-3  # one mask each, not one shared mask


def keep_mask_from_global(x: torch.Tensor, p: float) -> torch.Tensor:
    return scaled_mask(draw_keep_mask(x.shape, x.device, p), p, x.dtype)


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
