"""Run logging: the JSONL log, its truncation on resume, and the optional plot."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

from loralei.train.metrics import MetricsLogger, host_peak_gib, plot_log, read_log, setup_memory_gib
from loralei.train.schema import WandbSection


def test_log_is_jsonl_and_resume_drops_records_past_the_checkpoint(tmp_path):
    logger = MetricsLogger(tmp_path, total_steps=4)
    for step in range(1, 5):
        logger.log({"step": step, "loss": 1.0 / step, "tokens_per_s": 10.0})
    logger.close()
    assert [r["step"] for r in read_log(tmp_path)] == [1, 2, 3, 4]
    MetricsLogger(tmp_path, total_steps=4, start_step=2).close()
    assert [r["step"] for r in read_log(tmp_path)] == [1, 2]


def test_non_main_process_writes_nothing(tmp_path):
    logger = MetricsLogger(tmp_path / "o", total_steps=2, enabled=False)
    logger.log({"step": 1, "loss": 1.0})
    assert logger.close() is None and not (tmp_path / "o").exists()


def test_plot_is_skipped_with_a_note_without_matplotlib(tmp_path, monkeypatch):
    (tmp_path / "log.jsonl").write_text('{"step": 1, "loss": 2.0, "tokens_per_s": 5.0}\n')
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert "matplotlib is not installed" in plot_log(tmp_path)
    assert not (tmp_path / "loss.png").exists()


def test_plot_is_drawn_with_matplotlib(tmp_path):
    pytest.importorskip("matplotlib")
    (tmp_path / "log.jsonl").write_text(
        '{"step": 1, "loss": 2.0, "tokens_per_s": 5.0}\n{"step": 2, "loss": 1.0}\n'
    )
    assert plot_log(tmp_path) is None
    assert (tmp_path / "loss.png").read_bytes()[:4] == b"\x89PNG"


def test_wandb_run_gets_config_and_metrics(tmp_path, monkeypatch):
    calls = {"log": []}

    class FakeRun:
        def log(self, data, step):
            calls["log"].append((step, data))

        def finish(self):
            calls["finished"] = True

    def init(**kwargs):
        calls["init"] = kwargs
        return FakeRun()

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    settings = WandbSection(project="demo", name="run-1", tags=["a"])
    logger = MetricsLogger(tmp_path, total_steps=1, wandb_settings=settings, run_config={"lora": {"r": 4}})
    logger.log({"step": 1, "loss": 2.0})
    logger.close()
    assert calls["init"]["project"] == "demo" and calls["init"]["name"] == "run-1"
    assert calls["init"]["config"] == {"lora": {"r": 4}}
    assert calls["log"] == [(1, {"loss": 2.0})] and calls["finished"]


def test_the_setup_peak_is_taken_apart_and_the_counters_restart(monkeypatch):
    """setup_memory_gib reads the peak so far and restarts the counters, so the log's peaks are the training
    steps' own (CUDA calls stood in for: this machine may have no GPU)."""
    import torch

    calls = []
    monkeypatch.setattr(
        torch.cuda, "max_memory_allocated", lambda device=None: calls.append("read") or 3 * 2**30
    )
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: calls.append("reset"))
    assert setup_memory_gib(torch.device("cuda", 0)) == 3.0 and calls == ["read", "reset"]
    assert setup_memory_gib(torch.device("cpu")) is None and calls == ["read", "reset"]


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="reads Linux's own count")
def test_the_host_peak_is_the_process_peak_resident_memory():
    """host_peak_gib is what Linux counts as the process's high-water mark of resident memory (VmHWM)."""
    status = Path("/proc/self/status").read_text()
    before = int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:")))
    got = host_peak_gib()
    assert got is not None and before / 2**20 - 1e-3 <= got <= before / 2**20 + 0.1


def test_the_summary_names_both_peaks_on_a_gpu_and_none_elsewhere(tmp_path):
    from loralei.train.result import Phases, write_result
    from loralei.train.state import TrainState

    paths = (tmp_path / "adapter", tmp_path / "adapter_peft", None)
    gpu = write_result(
        tmp_path,
        TrainState(),
        paths,
        Phases(),
        [],
        memory_gib={"setup": 15.2, "setup_host": 3.5, "training": 43.1},
    )
    assert "GPU memory, peak allocated: 43.10 GiB in training, 15.20 GiB while setting up" in gpu.summary()
    assert "host memory, peak resident while setting up: 3.50 GiB" in gpu.summary()
    cpu = write_result(
        tmp_path, TrainState(), paths, Phases(), [], memory_gib={"setup": None, "training": None}
    )
    assert "GPU memory" not in cpu.summary()
