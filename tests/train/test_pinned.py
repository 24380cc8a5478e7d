"""Host buffers in power-of-two pieces (``train.pinned``): the pieces of a size, what a kept tensor costs, and
tensors sent into a buffer and brought back (unpinned pieces on the CPU; the pinned ones are the same code)."""

from __future__ import annotations

import pytest
import torch

from loralei.train.pinned import MIN_PIECE, PinnedBuffer, held_bytes, piece_sizes, size_text

MIB = 2**20


@pytest.mark.parametrize(
    "nbytes", [1, 3, 4096, MIN_PIECE - 1, MIN_PIECE, MIN_PIECE + 1, 781 * MIB + 5, 3 * 2**30]
)
def test_pieces_are_powers_of_two_that_waste_less_than_the_smallest(nbytes: int) -> None:
    pieces = piece_sizes(nbytes)
    assert all(p & (p - 1) == 0 for p in pieces) and pieces == sorted(pieces, reverse=True)
    assert sum(pieces) >= nbytes
    if nbytes <= MIN_PIECE:  # one piece, the allocator's own rounding
        assert len(pieces) == 1 and sum(pieces) < 2 * nbytes
    else:
        assert min(pieces) >= MIN_PIECE and sum(pieces) - nbytes < MIN_PIECE and sum(pieces) % MIN_PIECE == 0


def test_what_a_kept_tensor_costs() -> None:
    assert piece_sizes(0) == [] and held_bytes(0, pinned=True) == 0
    assert held_bytes(781 * MIB + 5, pinned=True) == 782 * MIB  # 512 + 256 + 8 + 4 + 2 MiB; one block: 1 GiB
    assert held_bytes(781 * MIB + 5, pinned=False) == 781 * MIB + 5
    assert (size_text(782 * MIB), size_text(3 * 2**30 // 2)) == ("782.00 MiB", "1.50 GiB")


@pytest.mark.parametrize(
    ("shape", "dtype"),
    [
        ((13 * MIB + 1,), torch.uint8),
        ((3, 2**20 + 7), torch.float32),
        ((5, 9), torch.bfloat16),
        ((0,), torch.int64),
    ],
)
def test_a_tensor_goes_in_and_comes_back_whole(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    tensor = torch.randint(0, 200, shape, generator=gen).to(dtype)
    buffer = PinnedBuffer(tensor.numel(), dtype, pin=False)
    assert buffer.numel >= tensor.numel() and buffer.nbytes == held_bytes(
        tensor.numel() * dtype.itemsize, True
    )
    buffer.send(tensor)
    back = buffer.bring(tensor.shape, torch.device("cpu"))
    assert back.dtype == dtype and torch.equal(back, tensor)


def test_a_buffer_takes_shorter_and_strided_tensors() -> None:
    """A slot's buffer, sized for its longest batch, holds a shorter one; a strided tensor (a column slice, a
    transpose) goes in in row-major order."""
    buffer = PinnedBuffer(
        3 * MIB + 11, torch.float32, pin=False
    )  # 12 MiB + 44 bytes: pieces of 8, 4 and 2 MiB
    assert len(buffer.pieces) == 3
    wide = torch.randn(2**20 + 3, 6)
    for tensor in (wide[:, 1:4], wide[:, :2].t(), torch.randn(7, 5)):
        buffer.send(tensor)
        assert torch.equal(buffer.bring(tensor.shape, torch.device("cpu")), tensor)
