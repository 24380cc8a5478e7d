"""Tensors side by side in one buffer (``loralei.kernels.joint_buffer``): which neighbours join into one view
without a copy, and the spare columns that take one more gradient exactly once."""

from __future__ import annotations

import torch

from loralei.kernels.joint_buffer import joined, take_spare, with_spare


def test_adjacent_columns_and_rows_join_without_a_copy() -> None:
    buffer = torch.arange(60.0).view(6, 10)
    both = joined(buffer[:, 2:5], buffer[:, 5:9], 1)
    assert both is not None and torch.equal(both, buffer[:, 2:9])
    assert both.data_ptr() == buffer[:, 2:5].data_ptr()  # a view, not a copy
    weights = torch.arange(21.0).view(7, 3)
    rows = joined(weights[:3], weights[3:], 0)
    assert rows is not None and torch.equal(rows, weights)


def test_tensors_that_do_not_lie_side_by_side_do_not_join() -> None:
    buffer = torch.arange(60.0).view(6, 10)
    a = buffer[:, :4]
    assert joined(a, buffer[:, 5:8], 1) is None  # a gap
    assert joined(buffer[:, 4:8], a, 1) is None  # the wrong order
    assert joined(a, buffer[:5, 4:8], 1) is None  # another row count
    assert joined(a, buffer[:, 4:8].clone(), 1) is None  # another buffer
    assert joined(a, buffer.t().contiguous().t()[:, 4:8], 1) is None  # other strides
    assert joined(a, buffer[:, 4:8].to(torch.float64), 1) is None
    assert joined(buffer[:2], buffer[3:], 0) is None


def test_the_spare_columns_are_taken_once() -> None:
    buffer = with_spare(torch.zeros(2, 3, 10), 7)
    flat = buffer.view(6, 10)
    before = flat[:, 4:7]
    assert take_spare(flat[:, :4], torch.Size([6, 3])) is None  # not the columns right before the spare ones
    assert take_spare(before, torch.Size([6, 2])) is None  # not the spare width
    slot = take_spare(before, torch.Size([6, 3]))
    assert slot is not None and slot.shape == (6, 3) and joined(before, slot, 1) is not None
    slot.copy_(torch.ones(6, 3))
    assert torch.equal(buffer[..., 7:], torch.ones(2, 3, 3))
    assert take_spare(before, torch.Size([6, 3])) is None  # taken


def test_a_tensor_of_an_unmarked_buffer_has_no_spare_columns() -> None:
    flat = torch.zeros(6, 10)
    assert take_spare(flat[:, 4:7], torch.Size([6, 3])) is None
    assert take_spare(torch.zeros(6, 7), torch.Size([6, 3])) is None  # no buffer behind it at all
