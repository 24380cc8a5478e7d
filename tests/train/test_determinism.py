"""training.deterministic: torch's deterministic algorithms, cuDNN and cuBLAS set for the run and restored after,
loralei's autotuned kernels at a fixed configuration, torch's refusals and a non-reproducible cuBLAS workspace
reported by the setting's name; on a GPU, two runs of one config the same bits."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_run import losses, make_cfg, run

from launching import child_env
from loralei.errors import ConfigError, TrainingError
from loralei.kernels.activations import launch_autotuned
from loralei.train import determinism
from saved_adapter import saved_adapter

pytestmark = pytest.mark.usefixtures("one_thread")

_REFUSAL = (
    "index_add_cuda_ does not have a deterministic implementation, but you set "
    "'torch.use_deterministic_algorithms(True)'. You can turn off determinism just for this operation..."
)


@pytest.fixture
def no_cublas_setting(monkeypatch):
    monkeypatch.delenv(determinism.CUBLAS_SETTING, raising=False)


def _settings() -> tuple:
    return (
        torch.are_deterministic_algorithms_enabled(),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
        os.environ.get(determinism.CUBLAS_SETTING),
    )


def test_the_run_sets_torch_cudnn_and_cublas_and_restores_them(no_cublas_setting):
    before = _settings()
    assert before[0] is False and before[3] is None
    with determinism.deterministic_run(True):
        assert _settings() == (True, True, False, ":4096:8")
    assert _settings() == before
    with pytest.raises(KeyError), determinism.deterministic_run(True):  # restored when the run fails too
        raise KeyError("boom")
    assert _settings() == before
    with determinism.deterministic_run(False):
        assert _settings() == before


def test_a_reproducible_cublas_setting_of_the_user_is_kept(monkeypatch):
    monkeypatch.setenv(determinism.CUBLAS_SETTING, ":16:8")
    with determinism.deterministic_run(True):
        assert os.environ[determinism.CUBLAS_SETTING] == ":16:8"
    assert os.environ[determinism.CUBLAS_SETTING] == ":16:8"


def test_another_cublas_setting_is_refused_by_name(monkeypatch):
    monkeypatch.setenv(determinism.CUBLAS_SETTING, ":0:0")
    with pytest.raises(
        ConfigError, match=r"training.deterministic: true needs CUBLAS_WORKSPACE_CONFIG .*':0:0'"
    ):
        determinism.check(True)
    assert determinism.check(False) == []


def test_torchs_refusal_names_the_setting_and_other_errors_pass(no_cublas_setting):
    refused = pytest.raises(
        TrainingError, match=r"^training.deterministic: true: index_add_cuda_ does not have"
    )
    with refused, determinism.deterministic_run(True):
        raise RuntimeError(_REFUSAL)
    with pytest.raises(RuntimeError, match=r"^out of memory$"), determinism.deterministic_run(True):
        raise RuntimeError("out of memory")
    assert torch.are_deterministic_algorithms_enabled() is False


class _Config:
    def __init__(self, **kwargs) -> None:
        self.kwargs = kwargs

    def all_kwargs(self) -> dict:
        return dict(self.kwargs)


class _Autotuned:
    """Stands for a ``triton.autotune``-wrapped kernel: launching through it 'times' the configs and keeps the
    last; ``fn`` launches at a given config. Records every launch's config."""

    def __init__(self) -> None:
        self.configs = [_Config(BT=16, num_warps=4), _Config(BT=64, num_warps=8)]
        self.launches: list[dict] = []
        self.fn = self

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            if self.fn is self and not {"BT"} <= kwargs.keys():  # through the autotuner
                self.best_config = self.configs[-1]
                kwargs = {**kwargs, **self.best_config.all_kwargs()}
            self.launches.append(kwargs)

        return launch


def test_autotuned_kernels_run_their_first_config_under_deterministic_algorithms():
    kernel, tuned = _Autotuned(), {}
    assert launch_autotuned(kernel, tuned, ("k",), (1,), X=1) == {"BT": 64, "num_warps": 8}  # timed
    torch.use_deterministic_algorithms(True)
    try:
        assert launch_autotuned(kernel, tuned, ("k",), (1,), X=1) == {"BT": 16, "num_warps": 4}
        assert launch_autotuned(kernel, tuned, ("k",), (1,), X=1) == {"BT": 16, "num_warps": 4}
    finally:
        torch.use_deterministic_algorithms(False)
    assert launch_autotuned(kernel, tuned, ("k",), (1,), X=1) == {
        "BT": 64,
        "num_warps": 8,
    }  # the timed one again
    assert [launch["BT"] for launch in kernel.launches] == [64, 16, 16, 64]


def test_the_runner_trains_under_deterministic_algorithms_and_says_so(tmp_path, no_cublas_setting):
    seen = []
    result = run(
        make_cfg(tmp_path / "run", training={"max_steps": 3, "deterministic": True}),
        callbacks=[lambda state: seen.append(torch.are_deterministic_algorithms_enabled())],
    )
    assert seen == [True, True, True]
    assert torch.are_deterministic_algorithms_enabled() is False
    assert any(
        note.startswith("training.deterministic: torch's deterministic") for note in result.setup_notes
    )
    plain = run(make_cfg(tmp_path / "plain", training={"max_steps": 3}))
    assert not any("deterministic" in note for note in plain.setup_notes)


def test_a_bad_cublas_setting_stops_the_run_before_the_output_directory_changes(tmp_path, monkeypatch):
    monkeypatch.setenv(determinism.CUBLAS_SETTING, ":0:0")
    with pytest.raises(ConfigError, match="CUBLAS_WORKSPACE_CONFIG"):
        run(make_cfg(tmp_path / "run", training={"max_steps": 3, "deterministic": True}))
    assert not (tmp_path / "run").exists()


ROOT = Path(__file__).resolve().parents[2]


def _quickstart_dpo(out: Path, *overrides: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The DPO quickstart in its own process (its own cuBLAS), bf16, 12 steps: every step's loss, the adapter."""
    args = [
        sys.executable, "-m", "loralei.cli", str(ROOT / "examples" / "quickstart-dpo.yaml"), f"output_dir={out}",
        "model.dtype=bfloat16", "training.max_steps=12", "training.logging_steps=1", "training.report_to=none",
        *overrides,
    ]  # fmt: skip
    proc = subprocess.run(args, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return losses(out), saved_adapter(out / "adapter")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("checkpointing", ["false", "offload"])
def test_on_the_gpu_two_deterministic_runs_give_the_same_bits(tmp_path, checkpointing):
    """Two processes, one config with deterministic: true (the fused kernels, CUDA graphs, the shared-prompt
    attention and the per-sequence log-probability sums): the same loss at every step and the same adapter, bit
    for bit."""
    mode = (f"training.gradient_checkpointing={checkpointing}", "training.deterministic=true")
    (losses_a, adapter_a), (losses_b, adapter_b) = (_quickstart_dpo(tmp_path / n, *mode) for n in "ab")
    assert len(losses_a) == 12 and losses_a == losses_b
    assert adapter_a.keys() == adapter_b.keys()
    assert all(torch.equal(adapter_a[name], adapter_b[name]) for name in adapter_a)
