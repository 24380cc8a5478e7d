"""Fixtures for the optimizer tests: a guard that fails on any device-to-host read."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

# Every way a tensor's value reaches Python (.item(), bool(), float(), int()) dispatches _local_scalar_dense;
# the others need the data on the host to size their output or to check for errors.
_HOST_READS = {
    aten._local_scalar_dense,
    aten.nonzero,
    aten.masked_select,
    aten.is_nonzero,
    aten.equal,
    aten._linalg_check_errors,
    aten.unique_consecutive,
    aten._unique2,
    aten.repeat_interleave,
}
# Indexing with a boolean mask finds the mask's true elements on the host (nonzero inside the kernel).
_INDEXING = {aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_}


def _mask_indexed(func: torch._ops.OpOverload, args: tuple) -> bool:
    if func.overloadpacket not in _INDEXING or len(args) < 2:
        return False
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1])


class _HostReadGuard(TorchDispatchMode):
    """Raises on any aten operation in ``_HOST_READS``: on CUDA each of them would stall the step."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in _HOST_READS or _mask_indexed(func, args):
            raise AssertionError(f"host sync inside the guarded code: {func}")
        return func(*args, **(kwargs or {}))


def _refuse(*_args: object, **_kwargs: object) -> None:
    raise AssertionError("host read (tolist/numpy) inside the guarded code")


@contextmanager
def _no_host_sync(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    # tolist() and numpy() read memory directly without dispatching an operator, so patch them too.
    with monkeypatch.context() as patch:
        patch.setattr(torch.Tensor, "tolist", _refuse)
        patch.setattr(torch.Tensor, "numpy", _refuse)
        with _HostReadGuard():
            yield


@pytest.fixture
def no_host_sync(monkeypatch: pytest.MonkeyPatch) -> Callable[[], AbstractContextManager[None]]:
    """A context-manager factory: code inside it fails if it reads any tensor value on the host."""
    return lambda: _no_host_sync(monkeypatch)
