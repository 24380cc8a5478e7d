"""The runner's own batches under ``cuda_graphs: auto`` without ``pad_to_max_length`` (GPU machine, a Hopper card):
on the quickstarts' tiny models (SFT, DPO, KTO) a micro batch is far too small for the GPU to set the pace, so
``auto`` pads every batch to the data's widest row and replays graphs, and the run trains as the eager one (its
batches at their own widths): losses to 1e-5 of themselves, each adapter tensor norm-wise to
``FP32_MEANINGFUL_BOUND``. The two runs add in other orders (the eager DPO run stores each prompt once, the padded one
runs both sequences whole), and Adam gives every element a step near the learning rate whatever its gradient's size,
so an element whose gradient is near 0 carries the rounding into the adapter at about the learning rate (one of
layer 0's up_proj lora_A elements once passed an element-wise atol of 1e-4); a lost or doubled term moves a whole
tensor by far more."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from loralei import cli
from saved_adapter import saved_adapter
from tolerances import FP32_MEANINGFUL_BOUND, rel_err

ROOT = Path(__file__).resolve().parents[2]
STEPS = 12
PADDED = "every batch padded to the data's widest row"


def _run(
    tmp_path: Path, example: str, graphs: str, settings: list[str], monkeypatch
) -> tuple[list, dict, list]:
    """``example`` for :data:`STEPS` steps with ``training.cuda_graphs`` set to ``graphs``: losses, adapter, notes."""
    monkeypatch.chdir(ROOT)
    out = tmp_path / f"{example}-{graphs}"
    args = [
        str(ROOT / "examples" / example), f"output_dir={out}", f"training.cuda_graphs={graphs}",
        f"training.max_steps={STEPS}", "optimizer.warmup_steps=2", "training.logging_steps=1",
        "training.report_to=none", *settings,
    ]  # fmt: skip
    assert cli.main(args) == 0
    records = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    adapter = saved_adapter(out / "adapter")
    summary = json.loads((out / "run_summary.json").read_text())
    notes = summary["setup_notes"] + summary["notes"]
    return [r["loss"] for r in records if "loss" in r], adapter, notes


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9, reason="needs a Hopper GPU"
)
@pytest.mark.parametrize(
    ("example", "settings"),
    [
        ("quickstart.yaml", []),
        ("quickstart.yaml", ["training.packing=false"]),
        ("quickstart-dpo.yaml", []),
        ("quickstart-dpo.yaml", ["training.packing=false"]),
        ("quickstart-kto.yaml", []),
    ],
    ids=["sft-packed", "sft", "dpo-packed", "dpo", "kto"],
)
def test_auto_pads_the_runners_batches_and_trains_as_the_eager_run(
    tmp_path, example, settings, monkeypatch
) -> None:
    want, want_adapter, _ = _run(tmp_path, example, "false", settings, monkeypatch)
    got, got_adapter, notes = _run(tmp_path, example, "auto", settings, monkeypatch)
    assert any(PADDED in note for note in notes), notes
    replays = [note for note in notes if note.startswith("CUDA graphs:")]
    assert replays and "0 micro batches replayed" not in replays[0], notes
    assert len(got) == len(want) == STEPS
    torch.testing.assert_close(
        torch.tensor(got, dtype=torch.float64), torch.tensor(want, dtype=torch.float64), rtol=1e-5, atol=1e-6
    )
    assert got_adapter.keys() == want_adapter.keys()
    errors = {name: rel_err(got_adapter[name], tensor) for name, tensor in want_adapter.items()}
    worst = max(errors, key=errors.get)
    assert errors[worst] <= FP32_MEANINGFUL_BOUND, f"{worst}: relative error {errors[worst]:.3e}"
