"""CPU runs set torch's intra-op threads: OMP_NUM_THREADS when set, else the cores this process may use shared by
torchrun's processes on the machine (two trainings on one machine no longer both take every core by default
unless told to); the run says how many."""

from __future__ import annotations

import os

import pytest
import torch
from test_run import ONE_STEP, make_cfg, run

from loralei.errors import ConfigError
from loralei.train import launch


@pytest.fixture(autouse=True)
def _keep_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_omp_num_threads_wins() -> None:
    assert launch.cpu_threads({"OMP_NUM_THREADS": "3"}) == (3, "OMP_NUM_THREADS")


def test_otherwise_the_available_cores_shared_by_local_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0, 1, 2, 3, 4, 5}, raising=False)
    assert launch.cpu_threads({})[0] == 6
    threads, source = launch.cpu_threads({"LOCAL_WORLD_SIZE": "4"})
    assert threads == 1 and source == "6 cores available / 4 process(es) on this machine"


def test_a_bad_omp_num_threads_is_named() -> None:
    with pytest.raises(ConfigError, match=r"OMP_NUM_THREADS='two' is not a whole number"):
        launch.cpu_threads({"OMP_NUM_THREADS": "two"})


def test_a_cpu_run_uses_and_reports_them(tmp_path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    torch.set_num_threads(2)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    run(make_cfg(tmp_path / "run", **ONE_STEP))
    assert torch.get_num_threads() == 1
    printed = capsys.readouterr()
    assert (
        "CPU: 1 intra-op thread(s) (OMP_NUM_THREADS; set OMP_NUM_THREADS to choose)"
        in printed.out + printed.err
    )
