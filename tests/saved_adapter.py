"""The tensors of an adapter a run saved, read back for the tests."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file


def saved_adapter(directory: Path | str) -> dict[str, torch.Tensor]:
    """The tensors of the adapter saved in ``directory`` (the run's ``adapter``: its native safetensors file)."""
    return load_file(next(Path(directory).glob("*.safetensors")))
