"""The environment of the processes a test launches: torchrun's ranks, or a run's one-process twin."""

from __future__ import annotations

import os
from pathlib import Path

from loralei.train import launch

SRC = Path(__file__).resolve().parents[1] / "src"


def child_env(gpus: bool = False) -> dict[str, str]:
    """This process's environment for a process it launches: without torchrun's variables (the child starts a
    run of its own), loralei's sources first on the path, one intra-op thread per process, gloo over the
    loopback interface (every rank is on this machine), and no GPU unless ``gpus``."""
    env = {k: v for k, v in os.environ.items() if k not in launch.TORCHRUN_VARIABLES}
    env |= {"PYTHONPATH": os.pathsep.join([str(SRC), env.get("PYTHONPATH", "")]), "OMP_NUM_THREADS": "1"}
    env["GLOO_SOCKET_IFNAME"] = "lo"
    if not gpus:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env
