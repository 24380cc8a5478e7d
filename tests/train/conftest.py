"""Fixtures of the runner tests: tiny in-memory data, and an optimizer stand-in until loralei.train.optim lands."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ holds tiny_models.py


def _torch_optimizer(cfg, model, steps):
    """torch AdamW + linear warmup/decay: the same call shape as loralei.train.optim's builders."""
    o = cfg.optimizer
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)
    warmup = o.warmup_steps

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        return max(0.0, 1.0 - (step - warmup) / max(steps - warmup, 1))

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


@pytest.fixture
def optimizers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Uses loralei.train.optim when present, else torch AdamW with a linear schedule."""
    if importlib.util.find_spec("loralei.train.optim") is None:
        from loralei.train import build

        monkeypatch.setattr(build, "build_optimizer", _torch_optimizer)


@pytest.fixture
def one_thread():
    """Runs a test on one intra-op thread: on a busy 2-core machine, tiny ops are ~100x slower with 2."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
