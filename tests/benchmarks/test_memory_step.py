"""benchmarks/memory_step.py on the CPU: the runner's step at the tiny shape, by category. Without the CUDA
allocator's counter the activations come from a census of the saved tensors (checkpointing off only); a
stand-in for the counter (the bytes of the live storages that ops created) runs the CUDA path's readings."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_runner
import memory_step
from bench_rows import SHAPES, build_model

from loralei.train import build
from loralei.train.schema import validate_config

ARGV = ["--shape", "tiny", "--dtype", "float32", "--warmup", "1"]
ACTIVATIONS = ("activations_layers", "activations_loss_logits", "activations_other")


class LiveStorages(TorchDispatchMode):
    """Stands in for the CUDA allocator's counters on the CPU: the bytes of the storages that ops created
    while the mode was on and are still alive (so the model must be built under it), and their maximum."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.max = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                self.live[storage._cdata] = (StorageWeakRef(storage), storage.nbytes())
        self.max = max(self.max, self.allocated())
        return out

    def allocated(self) -> int:
        self.live = {key: entry for key, entry in self.live.items() if not entry[0].expired()}
        return sum(nbytes for _, nbytes in self.live.values())

    def peaks(self) -> tuple[int, int]:
        return self.max, self.max

    def reset_peaks(self) -> None:
        self.max = self.allocated()


def run(tmp_path: Path, checkpointing: str) -> dict[str, Any]:
    out = tmp_path / f"memory-{checkpointing}.json"
    result = memory_step.main([*ARGV, "--checkpointing", checkpointing, "--out", str(out)])
    assert json.loads(out.read_text()) == result
    return result


def run_with_counter(tmp_path: Path, checkpointing: str, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    counter = LiveStorages()
    monkeypatch.setattr(memory_step, "device_memory", lambda device: counter)
    with counter:
        return run(tmp_path, checkpointing)


def parameter_bytes(tmp_path: Path) -> int:
    """The parameters' bytes of the tiny model as the runner trains it (LoRA injected, fused)."""
    args = memory_step.parse_args([*ARGV, "--out", str(tmp_path / "unused.json")])
    cfg = validate_config(bench_runner.run_config(memory_step.runner_args(args), tmp_path / "run"))
    model = build_model("tiny", torch.device("cpu"), torch.float32)
    build.prepare_model(model, cfg, torch.device("cpu"))
    return sum(p.nbytes for p in model.parameters())


def hidden_state_bytes() -> int:
    _, cfg, batch, seq = SHAPES["tiny"]
    return batch * seq * cfg["hidden_size"] * 4  # float32


def test_census_gives_every_category_with_checkpointing_off(tmp_path: Path) -> None:
    result = run(tmp_path, "off")
    parts, saved = result["categories"], result["saved_activations"]
    assert list(parts) == list(memory_step.CATEGORIES)
    assert parts["weights_frozen_base"] + parts["weights_lora"] == parameter_bytes(tmp_path)
    measured = {key: value for key, value in parts.items() if value is not None}
    assert set(parts) - set(measured) == {"step_start_other", "other_at_peak"}  # they need the allocator
    assert all(value >= 0 for value in measured.values())
    assert parts["gradients"] == parts["weights_lora"]  # float32 LoRA factors, every gradient alive
    assert parts["optimizer_state"] >= 2 * parts["weights_lora"]  # AdamW's two moments
    assert saved["method"] == memory_step.CENSUS_METHOD
    assert len(saved["per_layer_bytes"]) == 2 and all(b > 0 for b in saved["per_layer_bytes"])
    _, cfg, batch, seq = SHAPES["tiny"]
    assert saved["loss_logits_bytes"] >= batch * seq * cfg["vocab_size"] * 4  # the log-probabilities
    assert result["peak"]["allocated_bytes"] is None


@pytest.mark.parametrize("checkpointing", ["on", "offload"])
def test_checkpointed_activations_are_not_measured_on_the_cpu(tmp_path: Path, checkpointing: str) -> None:
    result = run(tmp_path, checkpointing)
    assert result["saved_activations"]["method"] == memory_step.NO_METHOD
    assert all(result["categories"][key] is None for key in ACTIVATIONS)
    assert result["categories"]["weights_lora"] > 0 and result["categories"]["optimizer_state"] > 0


def test_allocator_readings_agree_with_the_census(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    census = run(tmp_path, "off")["saved_activations"]
    result = run_with_counter(tmp_path, "off", monkeypatch)
    saved, parts = result["saved_activations"], result["categories"]
    assert saved["method"] == memory_step.CUDA_METHOD
    # the same bytes, but for the loss itself (kept by the loop, saved by nothing)
    assert 0 <= saved["forward_total_bytes"] - census["forward_total_bytes"] <= 8
    assert all(b > hidden_state_bytes() for b in saved["per_layer_bytes"])
    assert sum(parts.values()) == result["peak"]["allocated_bytes"]
    assert all(parts[key] >= 0 for key in parts if key != "other_at_peak")


def test_checkpointed_layers_keep_only_their_output(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    saved = run_with_counter(tmp_path, "on", monkeypatch)["saved_activations"]
    assert saved["per_layer_bytes"] == [hidden_state_bytes()] * 2


def test_the_measured_run_replays_no_cuda_graphs(tmp_path: Path) -> None:
    """A replayed graph runs no module hooks: the probe would see nothing of the step (on a GPU, where the
    runner's default turns graphs on)."""
    args = memory_step.parse_args([*ARGV, "--out", str(tmp_path / "unused.json")])
    cfg = bench_runner.run_config(memory_step.runner_args(args), tmp_path / "run")
    assert cfg["training"]["cuda_graphs"] is False
