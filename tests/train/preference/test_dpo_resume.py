"""A DPO run killed after a step resumes bit for bit: the logged losses and preference metrics and the final
adapter equal the uninterrupted run's. The run carries every piece of state a preference run adds to SFT's: a
reference adapter the policy starts from (swapped in for each reference pass), the reference log-probabilities
precomputed once before the first step (computed again on resume, from that adapter), a weighted list of loss
types (aot sorts the micro-batch's pairs), gradient accumulation over pairs. A KTO run likewise (last test): its
micro batches, and so its KL sequences, come back as they were."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from loralei import LoRAConfig, inject_lora, save_pretrained
from loralei.train.metrics import read_log
from loralei.train.result import RunResult
from loralei.train.run import train
from loralei.train.schema import RunConfig, validate_config

ROOT = Path(__file__).resolve().parents[3]
METRICS = ("loss", "rewards/margins", "rewards/accuracies", "logps/chosen", "logits/rejected")

pytestmark = pytest.mark.usefixtures("one_thread")


class Interrupt(Exception):
    """Simulates the process being killed."""


def _reference_adapter(directory: Path) -> Path:
    """An adapter of the run's shape with nonzero factors, saved as an SFT run would leave it."""
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_pretrained(ROOT / "examples" / "quickstart" / "model")
    config = LoRAConfig(r=16, lora_alpha=32, target_modules="all-linear", init_lora_weights=False)
    return save_pretrained(inject_lora(model, config), directory)


def _quickstart(
    example: str, data: str, out: Path, reference: Path, preference: dict, **training
) -> RunConfig:
    """``example`` on ``data`` (both in examples/), from ``reference``, 6 steps of 2 micro batches, checkpointed
    every 2 steps, logged every step."""
    raw = yaml.safe_load((ROOT / "examples" / example).read_text())
    raw["model"]["name_or_path"] = str(ROOT / "examples" / "quickstart" / "model")
    raw["data"]["path"] = str(ROOT / "examples" / "quickstart" / data)
    raw["training"].update(
        max_steps=6,
        save_steps=2,
        logging_steps=1,
        report_to="none",
        gradient_accumulation_steps=2,
        **training,
    )
    raw["optimizer"]["warmup_steps"] = 1
    raw["preference"].update(reference=str(reference), **preference)
    raw["output_dir"] = str(out)
    return validate_config(raw)


def _cfg(out: Path, reference: Path, **training) -> RunConfig:
    preference = {"precompute_reference": True, "loss_type": ["aot", "sft"], "loss_weights": [1.0, 0.3]}
    return _quickstart("quickstart-dpo.yaml", "preferences.jsonl", out, reference, preference, **training)


def _killed_and_resumed(tmp_path: Path, cfg) -> tuple[RunResult, RunResult]:
    """The run of ``cfg(out, **training)`` whole (in tmp_path/full), and killed after step 3 then resumed (in
    tmp_path/cut)."""
    full = train(cfg(tmp_path / "full"))

    def kill_after_step_3(state) -> None:
        if state.global_step == 3:  # step 3 is logged but not checkpointed: the resumed run does it again
            raise Interrupt

    with pytest.raises(Interrupt):
        train(cfg(tmp_path / "cut"), callbacks=[kill_after_step_3])
    return full, train(cfg(tmp_path / "cut", resume_from_checkpoint=True))


def _logged(out: Path) -> list[tuple[float, ...]]:
    return [tuple(r[key] for key in METRICS) for r in read_log(out) if "loss" in r]


def test_a_killed_dpo_run_resumes_bit_for_bit(tmp_path: Path) -> None:
    reference = _reference_adapter(tmp_path / "sft")
    full, resumed = _killed_and_resumed(tmp_path, lambda out, **training: _cfg(out, reference, **training))
    assert resumed.steps == full.steps == 6
    assert _logged(tmp_path / "cut") == _logged(tmp_path / "full")  # exact float equality
    margins = [record[1] for record in _logged(tmp_path / "full")]
    assert (
        len(margins) == 6 and margins[0] == 0.0 < margins[-1]
    )  # the policy starts at the reference, and learns
    a, b = (load_file(r.adapter_dir / "loralei_adapter.safetensors") for r in (full, resumed))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_killed_kto_run_resumes_bit_for_bit(tmp_path: Path) -> None:
    """KTO's micro batches (and so its KL sequences) come back as they were: the same logged losses, rewards and KL
    estimates, and the same adapter."""
    reference = _reference_adapter(tmp_path / "sft")

    def kto(out: Path, **training) -> RunConfig:  # the unpaired rows, 2 micro batches of 4 a step
        return _quickstart("quickstart-kto.yaml", "kto.jsonl", out, reference, {}, batch_size=4, **training)

    full, resumed = _killed_and_resumed(tmp_path, kto)
    keys = ("loss", "rewards/chosen", "rewards/rejected", "kl", "logps/chosen")
    logged = [
        [tuple(r[k] for k in keys) for r in read_log(tmp_path / run) if "loss" in r]
        for run in ("cut", "full")
    ]
    assert resumed.steps == full.steps == 6 and logged[0] == logged[1]  # exact float equality
    a, b = (load_file(r.adapter_dir / "loralei_adapter.safetensors") for r in (full, resumed))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
