"""Fixtures for Triton kernel tests on CPU.

``TRITON_INTERPRET=1`` is set per test through ``monkeypatch`` and undone afterwards, so it never leaks into
other test directories. loralei builds its kernels lazily and reads the variable at launch time, so importing
triton earlier in the session without it is fine.
"""

from __future__ import annotations

import pytest

from loralei.kernels import activations


def _torch_path_taken(*args, **kwargs):
    raise AssertionError("the torch fallback ran where the Triton interpreter should have")


@pytest.fixture
def interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    """Runs kernels in the Triton interpreter and fails the test if the torch fallback is used instead."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(activations, "torch_act_and_slope", _torch_path_taken)
