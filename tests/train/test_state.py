"""Checkpoints: atomic writes, a crash during a save, pruning, resume checks."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from loralei import LoRAConfig, inject_lora, lora_state_dict
from loralei.errors import CheckpointError
from loralei.train import state as state_module
from loralei.train.output_dir import complete_checkpoints, latest_checkpoint
from loralei.train.state import RunIdentity, Trainables, TrainState, load_checkpoint, save_checkpoint
from tiny_models import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

LORA = LoRAConfig(r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
IDENT = RunIdentity(LORA, {"data.num_samples": 10, "training.batch_size": 2})


def trainables(seed: int = 0, lora: LoRAConfig = LORA, **model_kw) -> Trainables:
    torch.manual_seed(seed)
    model = inject_lora(tiny_model("llama", **model_kw), lora)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    return Trainables(model, opt, sched)


def take_step(objs: Trainables) -> None:
    ids = torch.randint(0, 128, (2, 6))
    objs.model(input_ids=ids, labels=ids).loss.backward()
    objs.optimizer.step()
    objs.scheduler.step()
    objs.optimizer.zero_grad()


def test_round_trip_restores_everything(tmp_path):
    objs = trainables()
    take_step(objs)
    saved = TrainState(global_step=1, epoch=0, batch_in_epoch=3, skipped_steps=1)
    path = save_checkpoint(tmp_path, objs, saved, IDENT)
    expected_rand = torch.rand(3)
    fresh = trainables(seed=1)
    restored = load_checkpoint(path, fresh, IDENT)
    assert restored == saved
    assert torch.equal(torch.rand(3), expected_rand)  # torch RNG restored
    a, b = lora_state_dict(objs.model), lora_state_dict(fresh.model)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert fresh.scheduler.get_last_lr() == objs.scheduler.get_last_lr()
    assert fresh.optimizer.state_dict()["state"][0]["step"] == 1


def test_a_one_process_save_and_load_raise_no_warning(tmp_path, recwarn):
    """torch.distributed.checkpoint warns at every call without a process group; the bar must not show it."""
    objs = trainables()
    take_step(objs)
    path = save_checkpoint(tmp_path, objs, TrainState(global_step=1), IDENT)
    load_checkpoint(path, trainables(seed=1), IDENT)
    assert [str(w.message) for w in recwarn] == []


def test_crash_during_save_keeps_previous_checkpoint(tmp_path, monkeypatch):
    objs = trainables()
    first = save_checkpoint(tmp_path, objs, TrainState(global_step=1), IDENT)
    take_step(objs)
    real_save = torch.save

    def failing_save(obj, path, *args, **kwargs):
        if str(path).endswith("scheduler.pt"):
            raise OSError("disk full (injected)")
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(state_module.torch, "save", failing_save)
    with pytest.raises(OSError, match="injected"):
        save_checkpoint(tmp_path, objs, TrainState(global_step=2), IDENT)
    monkeypatch.undo()
    assert latest_checkpoint(tmp_path) == first
    assert complete_checkpoints(tmp_path) == [first]
    leftovers = [p.name for p in (tmp_path / "checkpoints").iterdir() if p.name not in {first.name, "latest"}]
    assert leftovers == []
    assert load_checkpoint(first, trainables(seed=3), IDENT).global_step == 1


def test_marker_pointing_at_missing_dir_falls_back_to_newest_complete(tmp_path):
    objs = trainables()
    save_checkpoint(tmp_path, objs, TrainState(global_step=1), IDENT)
    second = save_checkpoint(tmp_path, objs, TrainState(global_step=2), IDENT)
    (tmp_path / "checkpoints" / "latest").write_text("checkpoint-000099\n")
    assert latest_checkpoint(tmp_path) == second


def test_save_total_limit_prunes_oldest(tmp_path):
    objs = trainables()
    for step in range(1, 5):
        save_checkpoint(tmp_path, objs, TrainState(global_step=step), IDENT, keep=2)
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["checkpoint-000003", "checkpoint-000004"]


def test_resume_into_another_model_or_lora_shape_is_refused(tmp_path):
    path = save_checkpoint(tmp_path, trainables(), TrainState(global_step=1), IDENT)
    with pytest.raises(
        CheckpointError, match=r"num_hidden_layers=2, but this run's model has num_hidden_layers=3"
    ):
        load_checkpoint(path, trainables(num_hidden_layers=3), IDENT)
    other = LoRAConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    with pytest.raises(CheckpointError, match=r"lora.r=2, but this run has lora.r=4"):
        load_checkpoint(path, trainables(lora=other), RunIdentity(other, IDENT.data_layout))


def test_resume_with_another_data_layout_is_refused(tmp_path):
    path = save_checkpoint(tmp_path, trainables(), TrainState(global_step=1), IDENT)
    moved = RunIdentity(LORA, {"data.num_samples": 10, "training.batch_size": 4})
    with pytest.raises(
        CheckpointError, match=r"training.batch_size=2, but this run has training.batch_size=4"
    ):
        load_checkpoint(path, trainables(), moved)


def test_corrupt_checkpoint_is_reported(tmp_path):
    path = save_checkpoint(tmp_path, trainables(), TrainState(global_step=1), IDENT)
    (path / "trainer_state.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="incomplete or corrupt"):
        load_checkpoint(path, trainables(), IDENT)
    (path / "trainer_state.json").write_text('{"format_version": 1}')
    with pytest.raises(CheckpointError, match="has no 'state' object"):
        load_checkpoint(path, trainables(), IDENT)


def test_checkpoint_of_format_1_still_loads(tmp_path):
    """Format 1 kept the optimizer in optimizer.pt and the factors in adapter/ (no state/ directory)."""
    objs = trainables()
    take_step(objs)
    path = save_checkpoint(tmp_path, objs, TrainState(global_step=1), IDENT)
    torch.save(objs.optimizer.state_dict(), path / "optimizer.pt")
    shutil.rmtree(path / "state")
    meta = json.loads((path / "trainer_state.json").read_text())
    (path / "trainer_state.json").write_text(json.dumps(meta | {"format_version": 1}))
    fresh = trainables(seed=1)
    assert load_checkpoint(path, fresh, IDENT).global_step == 1
    a, b = lora_state_dict(objs.model), lora_state_dict(fresh.model)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert fresh.optimizer.state_dict()["state"][0]["step"] == 1
