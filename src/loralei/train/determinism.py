"""``training.deterministic``: the same run, twice on the same GPU and software, gives the same bits.

Some of a GPU step's sums come out in an order that can change from run to run: torch's ``index_add`` and
cuDNN's attention backward add with atomics, cuBLAS may split a product over streams, and an autotuner times a
kernel's tilings and keeps the fastest, which another process may see differently. Each changes only last bits,
but Adam moves every weight by about its learning rate whatever its gradient's size, so within a few steps two
runs of one config can log visibly different losses. With ``deterministic: true`` the run:

- turns on torch's deterministic algorithms: torch runs the deterministic variant of an op where it has one
  (``index_add`` and scatters add in a fixed order; SDPA no longer picks cuDNN's attention) and raises where it
  has none, which the run reports naming this setting;
- sets ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (cuBLAS's condition for reproducible products) where it is unset;
  cuBLAS reads it when the process first uses it, so a library caller that already ran CUDA products sets it
  before;
- makes cuDNN choose deterministic algorithms, without benchmarking them;
- runs loralei's autotuned Triton kernels at their first configuration and the NF4 kernel at its conservative
  tile (``kernels.activations.launch_autotuned``, ``kernels.nf4_matmul.choose_tile``).

It costs speed (no timed choices; torch's slower deterministic kernels). The previous settings come back when the
run ends.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

from ..errors import ConfigError, TrainingError

CUBLAS_SETTING = "CUBLAS_WORKSPACE_CONFIG"
_REPRODUCIBLE = (":4096:8", ":16:8")  # the workspace settings cuBLAS documents as reproducible
_TORCH_REFUSAL = "does not have a deterministic implementation"


def check(deterministic: bool) -> list[str]:
    """The run's note on ``training.deterministic`` (none when off), after refusing a ``CUBLAS_WORKSPACE_CONFIG``
    under which cuBLAS products are not reproducible.

    Raises:
        ConfigError: ``deterministic`` with the variable set to anything else than ``:4096:8`` or ``:16:8``.
    """
    if not deterministic:
        return []
    value = os.environ.get(CUBLAS_SETTING)
    if value is not None and value not in _REPRODUCIBLE:
        raise ConfigError(
            f"training.deterministic: true needs {CUBLAS_SETTING} unset or one of {', '.join(_REPRODUCIBLE)} "
            f"(cuBLAS's reproducible workspaces), and the environment sets it to {value!r}; unset it, or set "
            "training.deterministic: false"
        )
    return [
        "training.deterministic: torch's deterministic algorithms, cuBLAS's reproducible workspace and loralei's "
        "Triton kernels at fixed tiles (slower than the default)"
    ]


@contextlib.contextmanager
def deterministic_run(deterministic: bool) -> Iterator[None]:
    """Within it, torch, cuDNN, cuBLAS and loralei's kernels compute as the module docstring says, when
    ``deterministic``; else nothing changes. The environment is :func:`check`'s to refuse, before the run starts.

    Raises:
        TrainingError: an op that torch has no deterministic implementation of, naming it and the setting.
    """
    if not deterministic:
        yield
        return
    saved = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
        os.environ.get(CUBLAS_SETTING),
    )
    os.environ.setdefault(CUBLAS_SETTING, _REPRODUCIBLE[0])
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    try:
        yield
    except RuntimeError as exc:
        if _TORCH_REFUSAL not in str(exc):
            raise
        raise TrainingError(
            f"training.deterministic: true: {str(exc).splitlines()[0]}; set training.deterministic: false to "
            "train this model on this device"
        ) from exc
    finally:
        enabled, warn_only, cudnn_deterministic, benchmark, cublas = saved
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = cudnn_deterministic, benchmark
        if cublas is None:
            os.environ.pop(CUBLAS_SETTING, None)
