"""What a buffer in pinned host memory costs, and its size for a person. PyTorch's caching host allocator rounds
every pinned allocation up to a power of two (its free lists are indexed by those sizes), so a layer input of
1.2 GiB held in pinned memory takes 2 GiB of the host. The budgets that bound what offloaded checkpointing keeps in
host memory count that, and the run's report lines say what is really pinned."""

from __future__ import annotations


def held_bytes(nbytes: int, pinned: bool) -> int:
    """Bytes of host memory a buffer of ``nbytes`` takes: the next power of two where it is pinned (the caching
    host allocator's block), else ``nbytes``."""
    if not pinned or nbytes <= 1:
        return nbytes
    return 1 << (nbytes - 1).bit_length()


def size_text(nbytes: int) -> str:
    """``nbytes`` for a person: in GiB from 1 GiB up, else in MiB (``"1.50 GiB"``, ``"16.00 MiB"``)."""
    if nbytes >= 2**30:
        return f"{nbytes / 2**30:,.2f} GiB"
    return f"{nbytes / 2**20:,.2f} MiB"
