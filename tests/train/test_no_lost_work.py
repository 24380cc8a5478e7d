"""A user's finished or interrupted run is never lost: bad inputs leave it byte for byte, SIGINT / SIGTERM stop a
run after a step with a checkpoint and one line, and the same command resumes it (the quickstart through
``loralei-finetune``, in process and as a real process receiving the signal)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launching import child_env
from loralei import cli

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = str(ROOT / "examples" / "quickstart.yaml")
SRC = ROOT / "src"
FAST = ["training.logging_steps=1", "optimizer.warmup_steps=1"]


def snapshot(root: Path) -> dict[str, bytes | None]:
    return {
        str(p.relative_to(root)): p.read_bytes() if p.is_file() else None for p in sorted(root.rglob("*"))
    }


@pytest.fixture
def finished(tmp_path, monkeypatch, capsys) -> Path:
    """A finished 2-step quickstart run with a checkpoint, in tmp_path/out (the config has overwrite on)."""
    monkeypatch.chdir(ROOT)
    out = tmp_path / "out"
    args = [QUICKSTART, *FAST, "training.max_steps=2", "training.save_steps=1", f"output_dir={out}"]
    assert cli.main(args) == 0, capsys.readouterr().err
    capsys.readouterr()
    assert (out / "run_summary.json").is_file()
    return out


def _bad_inputs(tmp_path: Path) -> dict[str, list[str]]:
    no_messages = tmp_path / "no_messages.jsonl"
    no_messages.write_text('{"prompt": "hi", "answer": "ho"}\n' * 8)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    return {
        "mistyped data.path": ["data.path=examples/quickstart/data.jsnol"],
        "rows without the messages column": [f"data.path={no_messages}"],
        "empty data file": [f"data.path={empty}"],
        "no module matches": ["lora.target_modules=[nonexistent_proj]"],
        "warm-up longer than the run": ["training.max_steps=5", "optimizer.warmup_steps=30"],
        "missing chat template file": ["data.chat_template=templates/chatml.jinja"],
        "missing model directory": ["model.name_or_path=./models/nope"],
        "batch larger than the data": ["training.batch_size=100000"],
        "resume from a missing checkpoint": ["training.resume_from_checkpoint=./nowhere"],
    }


def test_bad_inputs_leave_a_finished_run_byte_for_byte(finished, tmp_path, capsys):
    before = snapshot(finished)
    for name, overrides in _bad_inputs(tmp_path).items():
        status = cli.main([QUICKSTART, *FAST, "training.max_steps=2", f"output_dir={finished}", *overrides])
        err = capsys.readouterr().err
        assert status == 2, (name, err)
        assert "Traceback" not in err and ("\n" + err).count("\nloralei-finetune: ") == 1, (name, err)
        assert snapshot(finished) == before, name


def test_nf4_blocks_that_do_not_fit_leave_a_finished_run_byte_for_byte(finished, capsys):
    pytest.importorskip("torchao")
    before = snapshot(finished)
    nf4 = ["lora.quantize_base=true", "lora.nf4_block_size=64", "lora.nf4_scaler_block_size=256"]
    assert cli.main([QUICKSTART, *FAST, f"output_dir={finished}", *nf4]) == 2
    assert "nf4_block_size" in capsys.readouterr().err
    assert snapshot(finished) == before


def test_a_replaced_run_waits_until_the_new_run_has_progressed(finished, monkeypatch, capsys):
    before = snapshot(finished)
    args = [QUICKSTART, *FAST, "training.max_steps=3", f"output_dir={finished}"]
    seen = {}

    def interrupt_at_step_1(state) -> None:
        if state.global_step == 1:
            seen["aside"] = snapshot(finished / ".loralei-replaced")
            os.kill(os.getpid(), signal.SIGINT)

    from loralei.train import run as run_module

    train = run_module.train
    monkeypatch.setattr(run_module, "train", lambda cfg: train(cfg, callbacks=[interrupt_at_step_1]))
    assert cli.main(args) == 130
    err = capsys.readouterr().err
    assert "stopped by SIGINT after step 1" in err and "Traceback" not in err
    # the interrupted run may have been a mistake: the finished run it replaces still waits aside, whole
    assert seen["aside"] == before == snapshot(finished / ".loralei-replaced")
    monkeypatch.setattr(run_module, "train", train)
    assert cli.main(args) == 0  # the same command resumes it; once it finishes, the replaced run goes
    assert "resuming the run in" in capsys.readouterr().out
    assert not (finished / ".loralei-replaced").exists()
    assert json.loads((finished / "run_summary.json").read_text())["steps"] == 3


def _launch(args: list[str], **kwargs) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    env.pop("RANK", None)
    return subprocess.Popen(
        [sys.executable, "-m", "loralei.cli", *args],
        cwd=ROOT,
        env={**env, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kwargs,
    )


def _wait_for_steps(log: Path, steps: int, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and process.poll() is None:
        if log.is_file() and len(log.read_text().splitlines()) >= steps:
            return
        time.sleep(0.05)
    pytest.fail(f"no {steps} logged steps: {process.communicate()[1][-3000:]}")


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_stops_after_the_step_saves_and_the_same_command_resumes(tmp_path, signum):
    out = tmp_path / "o"
    args = [QUICKSTART, *FAST, "training.max_steps=100000", f"output_dir={out}"]
    process = _launch(args)
    _wait_for_steps(out / "log.jsonl", 3, process)
    process.send_signal(signum)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 128 + signum, err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("loralei-finetune:")]
    assert len(lines) == 1, err
    name = signal.Signals(signum).name
    step = json.loads((out / "log.jsonl").read_text().splitlines()[-1])["step"]
    assert f"stopped by {name} after step {step}; saved {out}/checkpoints/checkpoint-{step:06d}." in lines[0]
    assert lines[0].endswith(f"Resume with: python -m loralei.cli {' '.join(args)}")
    assert (out / "checkpoints" / f"checkpoint-{step:06d}" / "trainer_state.json").is_file()
    resumed = _launch(args)  # the same command again
    _wait_for_steps(out / "log.jsonl", step + 2, resumed)
    resumed.send_signal(signal.SIGINT)
    stdout, err = resumed.communicate(timeout=120)
    assert resumed.returncode == 130, err
    assert f"resuming the run in {out} from step {step} (training.resume_from_checkpoint: auto)" in stdout


def test_a_second_ctrl_c_stops_at_once_and_a_fresh_run_leaves_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    out = tmp_path / "o"

    def twice(state) -> None:
        if state.global_step == 2:
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)

    from loralei.train import run as run_module

    train = run_module.train
    monkeypatch.setattr(run_module, "train", lambda cfg: train(cfg, callbacks=[twice]))
    assert cli.main([QUICKSTART, *FAST, "training.max_steps=10", f"output_dir={out}"]) == 130
    err = capsys.readouterr().err
    assert "stopped at once by a second SIGINT, without saving" in err and "Traceback" not in err
    assert list(out.iterdir()) == []  # nothing was saved, so nothing of the run is left


def _two_processes(args: list[str], launcher: str = "loralei") -> subprocess.Popen:
    """The quickstart in 2 processes on the CPU (gloo): through ``--nproc-per-node`` or plain torchrun, in a
    session of its own, so that a signal can reach the whole process group as a Ctrl-C in a terminal does."""
    env = child_env()
    runner = ["-m", "loralei.cli", "--nproc-per-node", "2"]
    if launcher == "torchrun":
        runner = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "loralei.cli"]
    return subprocess.Popen(
        [sys.executable, *runner, *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def _said(err: str) -> list[str]:
    return [line for line in err.splitlines() if "loralei-finetune: " in line]


@pytest.mark.parametrize("launcher", ["loralei", "torchrun"])
def test_an_error_in_every_process_is_printed_once(tmp_path, launcher):
    process = _two_processes(
        [QUICKSTART, "lora.target_modules=[nope]", f"output_dir={tmp_path / 'o'}"], launcher
    )
    _, err = process.communicate(timeout=300)
    said = _said(err)
    assert len(said) == 1 and "lora.target_modules: no module matches" in said[0], err
    assert "[rank1]" not in err and not (tmp_path / "o").exists()
    if launcher == "loralei":  # torchrun adds its own report and status
        assert process.returncode == 2 and "Traceback" not in err, err


def test_ctrl_c_under_several_processes_stops_every_rank_and_rank_0_saves(tmp_path):
    out = tmp_path / "o"
    args = [QUICKSTART, *FAST, "training.max_steps=100000", f"output_dir={out}"]
    process = _two_processes(args)
    _wait_for_steps(out / "log.jsonl", 3, process)
    os.killpg(process.pid, signal.SIGINT)  # what a Ctrl-C in the terminal does
    _, err = process.communicate(timeout=120)
    assert process.returncode == 130 and "Traceback" not in err, err
    said = _said(err)
    assert len(said) == 1, err
    step = json.loads((out / "log.jsonl").read_text().splitlines()[-1])["step"]
    assert f"stopped by SIGINT after step {step}; saved {out}/checkpoints/checkpoint-{step:06d}." in said[0]
    assert said[0].endswith(f"Resume with: python -m loralei.cli --nproc-per-node 2 {' '.join(args)}")
    meta = json.loads((out / "checkpoints" / f"checkpoint-{step:06d}" / "trainer_state.json").read_text())
    assert meta["state"]["global_step"] == step and meta["data_layout"]["world_size"] == 2
