"""DPO under DDP: two processes (gloo on the CPU) train the DPO quickstart like one process with the same global
batch of pairs: the same logged losses and preference metrics (averaged over both ranks' pairs), the same final
adapter. The reference pass (adapter off, no autograd) runs inside DDP's forward on each rank."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from loralei.train import launch
from loralei.train.metrics import read_log

ROOT = Path(__file__).resolve().parents[3]
RTOL = 1e-5  # as tests/train/test_ddp.py: the runs differ only in the order of floating-point sums


def _dpo(tmp_path: Path, name: str, nproc: int | None, batch_size: int) -> Path:
    """The DPO quickstart for 4 steps, logging each, in ``nproc`` processes (None: one plain process)."""
    out = tmp_path / name
    runner = [sys.executable]
    if nproc is not None:
        runner += ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
    args = [
        "-m", "loralei.cli", str(ROOT / "examples" / "quickstart-dpo.yaml"), f"output_dir={out}",
        "training.max_steps=4", "training.logging_steps=1", f"training.batch_size={batch_size}",
        "training.report_to=none", "optimizer.warmup_steps=1",
        *(["training.distributed=ddp"] if nproc else []),
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in launch.TORCHRUN_VARIABLES}
    env |= {"PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    env["GLOO_SOCKET_IFNAME"] = "lo"  # every rank is on this machine
    proc = subprocess.run([*runner, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


def _logged(out: Path) -> list[dict]:
    return [r for r in read_log(out) if "loss" in r]


def test_two_processes_train_dpo_like_one_with_the_same_global_batch(tmp_path: Path) -> None:
    two, one = _dpo(tmp_path, "ddp", 2, 2), _dpo(tmp_path, "one", None, 4)
    got, want = _logged(two), _logged(one)
    assert len(got) == len(want) == 4
    keys = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies")
    for key in (*keys, "logits/chosen", "logits/rejected"):
        torch.testing.assert_close(
            torch.tensor([r[key] for r in got]), torch.tensor([r[key] for r in want]), rtol=RTOL, atol=1e-7,
            msg=key,
        )  # fmt: skip
    adapters = [load_file(next((out / "adapter").glob("*.safetensors"))) for out in (two, one)]
    assert adapters[1].keys() == adapters[0].keys() and adapters[1]
    for name, want_t in adapters[1].items():
        torch.testing.assert_close(adapters[0][name], want_t, rtol=10 * RTOL, atol=1e-6, msg=name)
    assert json.loads((two / "run_summary.json").read_text())["steps"] == 4
