"""Fast by default: ``training.liger_kernel: auto`` and ``training.loss: auto`` become the fastest exact path the
run's device and model allow, each choice with its reason; explicit values are kept."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from test_run import make_cfg, run

from loralei import LoRAConfig, inject_lora
from loralei.train import fast_path
from tiny_models import tiny_model

CUDA, CPU = torch.device("cuda"), torch.device("cpu")


@pytest.fixture
def liger_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: object() if name == "liger_kernel" else real(name, *a)
    )


@pytest.fixture
def liger_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "liger_kernel" else real(name, *a)
    )


def test_defaults_are_auto(tmp_path) -> None:
    t = make_cfg(tmp_path).training
    assert (t.liger_kernel, t.loss, t.fused_lora) == ("auto", "auto", True)


def test_on_cuda_liger_and_linear_cross_entropy(tmp_path, liger_installed) -> None:
    cfg, notes = fast_path.resolve_liger(make_cfg(tmp_path), CUDA)
    assert cfg.training.liger_kernel is True and notes == [
        "training.liger_kernel: auto -> on (RMSNorm, RoPE): CUDA and liger-kernel installed"
    ]
    cfg, notes = fast_path.resolve_loss(cfg, tiny_model("llama"), CUDA)
    assert cfg.training.loss == "linear_cross_entropy" and "never the full logits" in notes[0]


def test_without_liger_installed_it_says_how_to_get_it(tmp_path, liger_missing) -> None:
    cfg, notes = fast_path.resolve_liger(make_cfg(tmp_path), CUDA)
    assert cfg.training.liger_kernel is False and "pip install 'loralei[liger]'" in notes[0]


def test_on_the_cpu_the_plain_path(tmp_path, liger_installed) -> None:
    cfg, notes = fast_path.resolve_liger(make_cfg(tmp_path), CPU)
    cfg, loss_notes = fast_path.resolve_loss(cfg, tiny_model("llama"), CPU)
    assert (cfg.training.liger_kernel, cfg.training.loss) == (False, "cross_entropy")
    assert notes == ["training.liger_kernel: auto -> off: no CUDA device"]
    assert loss_notes == ["training.loss: auto -> cross_entropy (cpu: the plain head and loss)"]


@pytest.mark.parametrize(
    ("model", "reason"),
    [
        (lambda: tiny_model("llama", output_router_logits=True), "output_router_logits: true"),
        (lambda: inject_lora(tiny_model("llama"), LoRAConfig(r=2, target_modules=["lm_head"])), "LoRALinear"),
    ],
    ids=["router-loss", "adapted-head"],
)
def test_a_model_linear_cross_entropy_cannot_train_keeps_cross_entropy(tmp_path, model, reason) -> None:
    cfg, notes = fast_path.resolve_loss(make_cfg(tmp_path), model(), CUDA)
    assert cfg.training.loss == "cross_entropy" and reason in notes[0], notes


def test_explicit_values_are_kept(tmp_path, liger_installed) -> None:
    cfg = make_cfg(tmp_path, training={"liger_kernel": False, "loss": "lce"})
    cfg, notes = fast_path.resolve_liger(cfg, CUDA)
    cfg, loss_notes = fast_path.resolve_loss(cfg, tiny_model("llama"), CUDA)
    assert (cfg.training.liger_kernel, cfg.training.loss, notes, loss_notes) == (
        False,
        "linear_cross_entropy",
        [],
        [],
    )


def test_cut_cross_entropy_keeps_liger_off(tmp_path, liger_installed) -> None:
    cfg, notes = fast_path.resolve_liger(make_cfg(tmp_path, training={"loss": "cce"}), CUDA)
    assert cfg.training.liger_kernel is False and "cut_cross_entropy replaces Liger's loss" in notes[0]


def test_the_run_reports_what_auto_chose(tmp_path, capsys) -> None:
    out = tmp_path / "run"
    run(make_cfg(out))
    printed = capsys.readouterr()
    text = printed.out + printed.err
    assert "training.liger_kernel: auto -> off: no CUDA device" in text
    assert "training.loss: auto -> cross_entropy" in text
