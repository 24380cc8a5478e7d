"""Preference objectives with ``training.layer_offloading``: the reference pass (the adapter off, a reference
adapter swapped in, or precomputed before training), KTO's KL sequences and the evaluation run without autograd
through the layers' forward hooks, the policy's checkpointed pass through the streamed checkpoint function; every
layer loads its weights before it runs, whichever pass comes. A streamed run logs what the resident run logs and
saves the same adapter, bit for bit on the CPU (the weights are copies, the kernels the same)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from loralei import cli
from saved_adapter import saved_adapter

ROOT = Path(__file__).resolve().parents[3]
EXAMPLES = ROOT / "examples"
STEPS = [
    "training.max_steps=6",
    "training.logging_steps=1",
    "training.report_to=none",
    "optimizer.warmup_steps=1",
]
EVAL = ["data.split=train[:90%]", "data.eval_split=train[90%:]", "training.eval_steps=3"]
# what a record holds that is not computed from the weights
TIMING = "tokens_per_s"


def _run(config: str, out: Path, overrides: list[str], capsys: pytest.CaptureFixture) -> str:
    """Runs ``config`` with ``overrides`` into ``out``; returns what it printed."""
    assert cli.main([str(EXAMPLES / config), f"output_dir={out}", *STEPS, *overrides]) == 0, (
        capsys.readouterr().err
    )
    return capsys.readouterr().out


def _records(out: Path) -> list[dict]:
    records = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k != TIMING} for r in records]


CASES = {
    "dpo": ("quickstart-dpo.yaml", ["training.gradient_checkpointing=true"]),
    "dpo-offloaded-precomputed-eval": (
        "quickstart-dpo.yaml",
        ["training.gradient_checkpointing=offload", "preference.precompute_reference=true", *EVAL],
    ),
    "dpo-reference-adapter": ("quickstart-dpo.yaml", ["training.gradient_checkpointing=true"]),
    "orpo": ("quickstart-dpo.yaml", ["training.gradient_checkpointing=true", "training.objective=orpo"]),
    "kto-eval": ("quickstart-kto.yaml", ["training.gradient_checkpointing=true", *EVAL]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_preference_runs_train_the_same_with_layer_offloading(tmp_path, monkeypatch, capsys, case) -> None:
    monkeypatch.chdir(ROOT)
    config, overrides = CASES[case]
    if case == "dpo-reference-adapter":  # an earlier run's adapter starts the policy and is the reference
        _run(config, tmp_path / "start", ["training.max_steps=2"], capsys)
        overrides = [*overrides, f"preference.reference={tmp_path / 'start' / 'adapter'}"]
    _run(config, tmp_path / "resident", overrides, capsys)
    printed = _run(config, tmp_path / "streamed", [*overrides, "training.layer_offloading=true"], capsys)
    assert "training.layer_offloading: the frozen weights of 3 decoder layers" in printed
    streamed, resident = _records(tmp_path / "streamed"), _records(tmp_path / "resident")
    assert len(streamed) >= 6 and streamed == resident
    if "eval" in case:
        assert sum("eval_loss" in r for r in streamed) == 2
    got, want = (saved_adapter(tmp_path / run / "adapter") for run in ("streamed", "resident"))
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("checkpointing", ["true", "offload"])
def test_on_cuda_a_streamed_dpo_run_trains_as_the_resident_run(
    tmp_path, monkeypatch, capsys, checkpointing
) -> None:
    """On CUDA the layers come from pinned host memory on a side stream, each pass's layer waiting for its copy:
    in bf16 with ``training.deterministic`` (graphs off in both, which layer offloading turns off) the same bits."""
    monkeypatch.chdir(ROOT)
    overrides = [
        f"training.gradient_checkpointing={checkpointing}", "model.dtype=bfloat16", "training.deterministic=true",
        "training.cuda_graphs=false", *EVAL,
    ]  # fmt: skip
    _run("quickstart-dpo.yaml", tmp_path / "resident", overrides, capsys)
    printed = _run(
        "quickstart-dpo.yaml", tmp_path / "streamed", [*overrides, "training.layer_offloading=true"], capsys
    )
    assert "stream to cuda one layer ahead of use" in printed
    assert _records(tmp_path / "streamed") == _records(tmp_path / "resident")
    got, want = (saved_adapter(tmp_path / run / "adapter") for run in ("streamed", "resident"))
    assert all(torch.equal(got[name], tensor) for name, tensor in want.items())
