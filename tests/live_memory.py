"""The most tensor storage a CPU run holds at once, counted as CUDA's caching allocator counts allocated bytes:
each storage an op creates is counted from that op until it is freed (views and in-place results are not new
storage; what existed before the count started, the weights among it, is not counted).

The allocator's count follows the order the host issues allocations and frees in, not the GPU's timing, so a CPU
run of the same code shows where a step's peak is and what it holds, up to the ops whose CPU path allocates
differently from their CUDA kernels. Offloaded checkpointing's host copies are left out and each copy back is
counted as the device allocation it is on CUDA (:func:`offload_as_on_cuda`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveStorage(TorchDispatchMode):
    """Counts the storages the ops inside it create (``peak``: the most bytes alive at once)."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.current = self.peak = 0
        self.paused = 0

    @contextlib.contextmanager
    def pause(self) -> Iterator[None]:
        """What ops create in here is not counted (host memory)."""
        self.paused += 1
        try:
            yield
        finally:
            self.paused -= 1

    def _forget_freed(self) -> None:
        for key, (ref, nbytes) in list(self.live.items()):
            if ref.expired():
                del self.live[key]
                self.current -= nbytes

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self._forget_freed()
        if not self.paused:
            tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            inputs = {t.untyped_storage().data_ptr() for t in tensors}
            for tensor in tree_leaves(out):
                if not isinstance(tensor, torch.Tensor):
                    continue
                storage = tensor.untyped_storage()
                key = storage.data_ptr()
                if key in self.live or key in inputs or storage.nbytes() == 0:
                    continue
                self.live[key] = (StorageWeakRef(storage), storage.nbytes())
                self.current += storage.nbytes()
        self.peak = max(self.peak, self.current)
        return out


def offload_as_on_cuda(monkeypatch: pytest.MonkeyPatch, live: LiveStorage) -> None:
    """Offloaded checkpointing's copies as on CUDA: the copy to the host is not device memory, and each copy back
    (a prefetch) is a new device tensor."""
    from loralei.train.input_checkpoint import _HostCopy

    init = _HostCopy.__init__

    def host_init(self: _HostCopy, *args: Any) -> None:
        with live.pause():
            init(self, *args)

    def device_prefetch(self: _HostCopy) -> None:
        if self.back is None:
            self.back = self.host.clone()

    monkeypatch.setattr(_HostCopy, "__init__", host_init)
    monkeypatch.setattr(_HostCopy, "prefetch", device_prefetch)
