"""The output directory: planning is read-only, a replaced run goes only once the new run has progressed, a failed
run leaves the directory as it found it, and a killed replacement is repaired (no torch, no training here)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loralei.errors import CheckpointError, ConfigError
from loralei.train import output_dir
from loralei.train.output_dir import REPLACED_DIR, claim, config_differences, plan_output_dir
from loralei.train.schema import validate_config


def make_cfg(out: Path, **top) -> object:
    training = top.pop("training", {})
    raw = {"model": {"name_or_path": "m"}, "data": {"path": "d"}, "output_dir": str(out), **top}
    return validate_config({**raw, "training": {"max_steps": 10, **training}})


def finished_run(out: Path) -> None:
    """What a finished run leaves: adapters, a log and its summary, beside a file of the user's."""
    (out / "adapter").mkdir(parents=True)
    (out / "adapter" / "loralei_adapter.safetensors").write_bytes(b"old adapter")
    (out / "log.jsonl").write_text('{"step": 1}\n')
    (out / "run_summary.json").write_text("{}\n")
    (out / "notes.txt").write_text("mine")


def unfinished_run(out: Path, cfg, step: int = 3) -> Path:
    """A run stopped after a checkpoint at ``step``, made with ``cfg``."""
    checkpoint = out / "checkpoints" / f"checkpoint-{step:06d}"
    checkpoint.mkdir(parents=True)
    meta = {"format_version": 2, "state": {"global_step": step}, "run_config": cfg.model_dump(mode="json")}
    (checkpoint / "trainer_state.json").write_text(json.dumps(meta))
    (out / "checkpoints" / "latest").write_text(checkpoint.name + "\n")
    (out / "log.jsonl").write_text('{"step": 1}\n')
    return checkpoint


def snapshot(root: Path) -> dict[str, bytes | None]:
    return {
        str(p.relative_to(root)): p.read_bytes() if p.is_file() else None for p in sorted(root.rglob("*"))
    }


def test_an_empty_or_missing_directory_starts_fresh_and_planning_creates_nothing(tmp_path):
    assert plan_output_dir(make_cfg(tmp_path / "new")).action == "fresh"
    assert not (tmp_path / "new").exists()
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    assert plan_output_dir(make_cfg(tmp_path / "mine")).action == "fresh"


def test_a_finished_run_is_replaced_only_with_overwrite_and_only_once_the_new_run_progressed(tmp_path):
    finished_run(tmp_path)
    before = snapshot(tmp_path)
    with pytest.raises(
        ConfigError, match=r"already holds a finished run \(adapter, run_summary.json, log.jsonl\)"
    ):
        plan_output_dir(make_cfg(tmp_path))
    plan = plan_output_dir(make_cfg(tmp_path, overwrite_output_dir=True))
    assert plan.action == "replace" and "waits in" in plan.note
    assert snapshot(tmp_path) == before  # planning, and failing to plan, change nothing
    held, _ = claim(make_cfg(tmp_path, overwrite_output_dir=True), plan)
    assert (tmp_path / REPLACED_DIR / "run_summary.json").is_file() and not (tmp_path / "adapter").exists()
    assert (tmp_path / "notes.txt").read_text() == "mine"
    (tmp_path / "log.jsonl").write_text('{"step": 1, "new": true}\n')
    held.checkpointed()  # an interruption's checkpoint: the replaced run still waits
    assert (tmp_path / REPLACED_DIR).is_dir()
    held.progressed()
    assert not (tmp_path / REPLACED_DIR).exists() and (tmp_path / "notes.txt").read_text() == "mine"


def test_a_replacing_run_that_fails_before_saving_puts_the_previous_run_back_byte_for_byte(tmp_path):
    finished_run(tmp_path)
    before = snapshot(tmp_path)
    cfg = make_cfg(tmp_path, overwrite_output_dir=True)
    held, _ = claim(cfg, plan_output_dir(cfg))
    (tmp_path / "log.jsonl").write_text('{"step": 1, "new": true}\n')
    (tmp_path / "checkpoints").mkdir()  # a checkpoint being written, not complete
    held.abandon()
    assert snapshot(tmp_path) == before


def test_a_fresh_run_that_fails_before_saving_leaves_nothing(tmp_path):
    cfg = make_cfg(tmp_path / "o")
    held, _ = claim(cfg, plan_output_dir(cfg))
    (tmp_path / "o" / "log.jsonl").write_text("{}\n")
    held.abandon()
    assert list((tmp_path / "o").iterdir()) == []


def test_a_run_that_saved_a_checkpoint_keeps_its_files_when_it_fails(tmp_path):
    cfg = make_cfg(tmp_path)
    held, _ = claim(cfg, plan_output_dir(cfg))
    unfinished_run(tmp_path, cfg)
    held.checkpointed()
    held.abandon()
    assert output_dir.latest_checkpoint(tmp_path) is not None and (tmp_path / "log.jsonl").is_file()


def test_an_unfinished_run_of_the_same_config_resumes_by_itself(tmp_path):
    cfg = make_cfg(tmp_path, overwrite_output_dir=True)
    checkpoint = unfinished_run(tmp_path, cfg)
    # settings that do not change the computation may differ
    again = make_cfg(tmp_path, overwrite_output_dir=False, training={"logging_steps": 3, "save_steps": 5})
    plan = plan_output_dir(again)
    assert plan.action == "resume" and plan.checkpoint == checkpoint
    assert plan.note == f"resuming the run in {tmp_path} from step 3 (training.resume_from_checkpoint: auto)"
    held, resume_from = claim(again, plan)
    assert resume_from == checkpoint
    held.abandon()  # a resumed run's files are its own checkpoints' run: a failure keeps them
    assert checkpoint.is_dir() and (tmp_path / "log.jsonl").is_file()


def test_an_unfinished_run_of_another_config_is_never_replaced_silently(tmp_path):
    unfinished_run(tmp_path, make_cfg(tmp_path))
    before = snapshot(tmp_path)
    other = make_cfg(tmp_path, overwrite_output_dir=True, optimizer={"lr": 0.003})
    with pytest.raises(ConfigError) as info:
        plan_output_dir(other)
    message = str(info.value)
    assert "holds an unfinished run (last checkpoint: step 3) that was made with another config" in message
    assert "optimizer.lr: 0.0002 -> 0.003" in message
    for choice in (
        "resume_from_checkpoint: true",
        "resume_from_checkpoint: false and overwrite_output_dir: true",
    ):
        assert choice in message
    assert snapshot(tmp_path) == before
    assert plan_output_dir(
        make_cfg(tmp_path, optimizer={"lr": 0.003}, training={"resume_from_checkpoint": True})
    )
    replace = {"resume_from_checkpoint": False}
    assert (
        plan_output_dir(make_cfg(tmp_path, overwrite_output_dir=True, training=replace)).action == "replace"
    )
    with pytest.raises(
        ConfigError, match=r"an unfinished run \(last checkpoint: step 3\).*resume_from_checkpoint: true"
    ):
        plan_output_dir(make_cfg(tmp_path, training=replace))


def test_a_checkpoint_without_its_config_is_not_resumed_by_auto(tmp_path):
    checkpoint = unfinished_run(tmp_path, make_cfg(tmp_path))
    meta = json.loads((checkpoint / "trainer_state.json").read_text())
    del meta["run_config"]  # written by an older loralei
    (checkpoint / "trainer_state.json").write_text(json.dumps(meta))
    with pytest.raises(ConfigError, match="did not record its config"):
        plan_output_dir(make_cfg(tmp_path))


def test_resume_true_without_a_checkpoint_and_a_bad_path_are_errors(tmp_path):
    with pytest.raises(CheckpointError, match="holds no complete checkpoint"):
        plan_output_dir(make_cfg(tmp_path, training={"resume_from_checkpoint": True}))
    with pytest.raises(CheckpointError, match="not a complete loralei checkpoint"):
        plan_output_dir(make_cfg(tmp_path, training={"resume_from_checkpoint": str(tmp_path)}))


def test_a_killed_replacement_is_undone_by_the_next_claim(tmp_path):
    """The process was killed (no exception handler ran) after setting the previous run aside and before its
    first checkpoint: the next run sees the previous run and puts it back before acting."""
    finished_run(tmp_path)
    before = snapshot(tmp_path)
    cfg = make_cfg(tmp_path, overwrite_output_dir=True)
    claim(cfg, plan_output_dir(cfg))
    (tmp_path / "log.jsonl").write_text('{"step": 1, "killed": true}\n')
    with pytest.raises(ConfigError, match="already holds a finished run"):
        plan_output_dir(make_cfg(tmp_path))  # what is seen is the set-aside finished run
    fresh_dir = make_cfg(tmp_path, overwrite_output_dir=True)
    held, _ = claim(fresh_dir, plan_output_dir(fresh_dir))
    held.abandon()
    assert snapshot(tmp_path) == before


def test_a_killed_run_that_had_saved_a_checkpoint_keeps_it_and_the_set_aside_run_goes(tmp_path):
    finished_run(tmp_path)
    cfg = make_cfg(tmp_path, overwrite_output_dir=True)
    claim(cfg, plan_output_dir(cfg))
    checkpoint = unfinished_run(tmp_path, cfg)  # then killed before the set-aside run was deleted
    plan = plan_output_dir(cfg)
    assert plan.action == "resume" and plan.checkpoint == checkpoint
    claim(cfg, plan)
    assert not (tmp_path / REPLACED_DIR).exists() and (tmp_path / "notes.txt").read_text() == "mine"


def test_config_differences_skip_settings_that_do_not_change_the_computation():
    saved = {
        "training": {"logging_steps": 1, "max_steps": 5, "report_to": [], "layer_offloading": False},
        "optimizer": {"lr": 0.1},
    }
    current = {
        "training": {
            "logging_steps": 7,
            "max_steps": 6,
            "report_to": ["tensorboard"],
            "layer_offloading": True,
        },
        "optimizer": {},
    }
    assert config_differences(saved, current) == [
        "optimizer.lr: 0.1 -> '(unset)'",
        "training.max_steps: 5 -> 6",
    ]
