"""Host buffers for tensors that offloaded checkpointing keeps, and what pinned host memory costs.

PyTorch's caching host allocator rounds every pinned allocation up to a power of two (its free lists are indexed
by those sizes): a layer input of 781 MiB (100K tokens at Llama-3-8B's shape) held in one pinned allocation takes
1 GiB of the host, and at lengths just above a power of two nearly twice the bytes. A :class:`PinnedBuffer` is
made of pieces whose sizes are powers of two (the binary digits of the bytes it needs, rounded up to
:data:`MIN_PIECE`), so the allocator rounds nothing and a buffer wastes less than :data:`MIN_PIECE` (a buffer of
that size or less is one piece, rounded by the allocator); a tensor goes into it and back with one copy per
piece.

The budgets that bound what offloaded checkpointing keeps in host memory count each buffer as it is allocated
(:func:`held_bytes`), and the run's report lines say what is pinned (:func:`size_text`).
"""

from __future__ import annotations

import torch

MIN_PIECE = 2**21  # bytes: a buffer's smallest piece, and at most what it holds beyond what it was asked for


def piece_sizes(nbytes: int) -> list[int]:
    """The pieces of a buffer of ``nbytes``, powers of two, largest first: up to :data:`MIN_PIECE`, one piece
    (the allocator's own rounding); above it, pieces of :data:`MIN_PIECE` or more whose sum is ``nbytes``
    rounded up to a multiple of :data:`MIN_PIECE`."""
    if nbytes <= 0:
        return []
    if nbytes <= MIN_PIECE:
        return [1 << (nbytes - 1).bit_length()]
    total = -(-nbytes // MIN_PIECE) * MIN_PIECE
    return [1 << bit for bit in reversed(range(total.bit_length())) if total >> bit & 1]


def held_bytes(nbytes: int, pinned: bool) -> int:
    """Bytes of host memory a kept tensor of ``nbytes`` takes: its :class:`PinnedBuffer`'s pieces where it is
    pinned, else ``nbytes`` (a plain host copy)."""
    return sum(piece_sizes(nbytes)) if pinned else nbytes


def tensor_held_bytes(tensor: torch.Tensor) -> int:
    """Bytes of host memory ``tensor`` takes kept there (:func:`held_bytes`; pinned when it is on a CUDA device)."""
    return held_bytes(tensor.numel() * tensor.element_size(), tensor.is_cuda)


class PinnedBuffer:
    """Host memory for up to :attr:`numel` elements of one dtype, as pinned pieces (module docstring); ``pin``
    False makes plain host pieces (the CPU's tests)."""

    def __init__(self, numel: int, dtype: torch.dtype, pin: bool = True) -> None:
        size = dtype.itemsize  # a power of two, as every piece is: pieces hold whole elements
        sizes = piece_sizes(numel * size)
        self.dtype = dtype
        self.pieces = [torch.empty(n // size, dtype=dtype, pin_memory=pin) for n in sizes]
        self.numel = sum(p.numel() for p in self.pieces)
        self.nbytes = sum(sizes)

    def _spans(self, numel: int) -> list[tuple[torch.Tensor, int, int]]:
        """(piece, start, end) of the buffer's first ``numel`` elements, piece by piece."""
        spans, start = [], 0
        for piece in self.pieces:
            if start >= numel:
                break
            end = min(numel, start + piece.numel())
            spans.append((piece, start, end))
            start = end
        return spans

    def send(self, tensor: torch.Tensor, blocking: bool = False) -> None:
        """Copies ``tensor`` (its elements in row-major order) into the buffer, one copy per piece on the current
        stream: asynchronously from a CUDA device unless ``blocking``."""
        flat = tensor.reshape(-1)
        for piece, start, end in self._spans(flat.numel()):
            piece[: end - start].copy_(flat[start:end], non_blocking=not blocking)

    def bring(self, shape: torch.Size, device: torch.device, out: torch.Tensor | None = None) -> torch.Tensor:
        """A tensor of ``shape`` on ``device`` filled from the buffer's first elements (as :meth:`send` wrote
        them): one copy per piece, asynchronous to a CUDA device, on the current stream; into ``out`` (contiguous,
        of that shape) where given, else into a new tensor."""
        out = torch.empty(shape, dtype=self.dtype, device=device) if out is None else out
        flat = out.view(-1)
        for piece, start, end in self._spans(flat.numel()):
            flat[start:end].copy_(piece[: end - start], non_blocking=True)
        return out


def size_text(nbytes: int) -> str:
    """``nbytes`` for a person: in GiB from 1 GiB up, else in MiB (``"1.50 GiB"``, ``"16.00 MiB"``)."""
    if nbytes >= 2**30:
        return f"{nbytes / 2**30:,.2f} GiB"
    return f"{nbytes / 2**20:,.2f} MiB"
