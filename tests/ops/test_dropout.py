"""The dropout mask helpers that the plain path and the fused ops share."""

from __future__ import annotations

import torch

from loralei.ops.dropout import draw_keep_mask, keep_scale, scaled_mask


def test_no_mask_without_dropout() -> None:
    assert draw_keep_mask((3, 4), torch.device("cpu"), 0.0) is None
    assert scaled_mask(None, 0.0, torch.float32) is None


def test_mask_is_bool_keeps_about_1_minus_p_and_scales() -> None:
    torch.manual_seed(0)
    keep = draw_keep_mask((200, 50), torch.device("cpu"), 0.25)
    assert keep.dtype == torch.bool and keep.shape == (200, 50)
    assert abs(keep.float().mean().item() - 0.75) < 0.02
    scaled = scaled_mask(keep, 0.25, torch.float32)
    assert torch.equal(scaled, keep.float() * keep_scale(0.25)) and keep_scale(0.25) == 1 / 0.75


def test_same_seed_same_mask() -> None:
    torch.manual_seed(1)
    a = draw_keep_mask((8, 8), torch.device("cpu"), 0.5)
    torch.manual_seed(1)
    assert torch.equal(a, draw_keep_mask((8, 8), torch.device("cpu"), 0.5))
