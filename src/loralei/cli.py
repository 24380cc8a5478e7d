"""``loralei-finetune``: run or validate a fine-tuning job described by a YAML file.

Usage::

    loralei-finetune config.yaml [dotted.key=value ...]
    loralei-finetune validate config.yaml [dotted.key=value ...]
    loralei-finetune --nproc-per-node N config.yaml [dotted.key=value ...]

Exit status: 0 when done, 1 when training failed, 2 for a bad config or input, 130 / 143 when SIGINT / SIGTERM
stopped the run (after saving a checkpoint once training had begun). Under torchrun every process prints a
config or data error the same way, so only rank 0 prints it.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

from .errors import LoraleiError

_EPILOG = """examples:
  loralei-finetune examples/quickstart.yaml
  loralei-finetune examples/quickstart.yaml training.max_steps=50 optimizer.lr=5e-3
  loralei-finetune validate examples/quickstart.yaml
  loralei-finetune --nproc-per-node 2 config.yaml       # 2 processes (GPUs) on this machine, via torchrun
overrides are dotted keys with YAML values: lora.target_modules=[q_proj,v_proj] wandb.project=demo
exit status: 0 done, 1 training failed, 2 bad config or input, 130 / 143 stopped by SIGINT / SIGTERM"""
PROG = "loralei-finetune"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="LoRA fine-tuning of a Hugging Face causal LM from one YAML file.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--nproc-per-node",
        "--nproc_per_node",
        type=int,
        metavar="N",
        help="train in N processes on this machine (one per GPU), started by torch's elastic launcher",
    )
    parser.add_argument("args", nargs="+", metavar="[validate] CONFIG [KEY=VALUE ...]")
    return parser


def _say(message: str) -> None:
    """Prints to stderr on rank 0 only: every rank meets the same config and data problems."""
    if os.environ.get("RANK", "0") == "0":
        print(f"{PROG}: {message}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``loralei-finetune``.

    Args:
        argv: the arguments after the program name (default: ``sys.argv[1:]``).

    Returns:
        The exit status (see the module docstring).
    """
    parser = _parser()
    parsed = parser.parse_args(argv)
    args = list(parsed.args)
    command = "validate" if args[0] == "validate" else "train"
    if command == "validate":
        args = args[1:]
    if not args:
        parser.error("the config file is missing: loralei-finetune validate CONFIG")
    if parsed.nproc_per_node is not None and (command == "validate" or parsed.nproc_per_node < 1):
        parser.error("--nproc-per-node takes a whole number >= 1 and trains (validate runs in one process)")
    from .train.interrupt import stop_now

    main_thread = threading.current_thread() is threading.main_thread()
    # SIGTERM stops like a Ctrl-C until a run installs its own handlers (signals reach the main thread only)
    previous = signal.signal(signal.SIGTERM, stop_now) if main_thread else None
    try:
        return _run(command, args, parsed.nproc_per_node)
    except KeyboardInterrupt as exc:  # while the config was read: nothing was loaded or changed
        _say("interrupted before training started; nothing in output_dir was changed")
        return getattr(exc, "exit_status", 130)
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)


def _run(command: str, args: list[str], nproc: int | None) -> int:
    # Imported here, and torch only after the config passed its checks: `--help`, config errors and missing paths
    # answer without loading torch or Transformers.
    from .train.loading import load_config
    from .train.preflight import preflight

    config_path, overrides = args[0], args[1:]
    try:
        cfg = load_config(config_path, overrides)
        preflight(cfg)
    except LoraleiError as exc:
        _say(str(exc))
        return 2
    if nproc is not None:
        from .train.spawn import run_processes

        return run_processes(nproc, args, _launch_command(nproc, args))
    try:
        return _train_or_validate(command, cfg)
    except KeyboardInterrupt as exc:
        return _interrupted(exc, args, str(cfg.training.resume_from_checkpoint))


def _train_or_validate(command: str, cfg: object) -> int:
    from .errors import TrainingError
    from .train.run import train, validate

    try:
        if command == "validate":
            print(validate(cfg))
        elif (result := train(cfg)) is not None:  # None on processes other than the main one
            print(result.summary())
    except TrainingError as exc:
        _say(f"training stopped: {exc}")
        return _failed(1)
    except LoraleiError as exc:
        _say(str(exc))
        return _failed(2)
    return 0


def _interrupted(exc: KeyboardInterrupt, args: list[str], resume_setting: str) -> int:
    """One line for a run stopped by SIGINT / SIGTERM, and the exit status 128 + the signal number."""
    from .train.interrupt import RunInterrupted

    if not isinstance(exc, RunInterrupted) or not exc.started:
        _say("interrupted before training started; nothing in output_dir was changed")
        return _failed(getattr(exc, "exit_status", 130))
    if exc.checkpoint is None:
        _say(
            f"stopped at once by a second {exc.args[0]}, without saving; the steps since the last checkpoint are lost"
        )
    else:
        command = _resume_command(args, resume_setting)
        _say(
            f"stopped by {exc.args[0]} after step {exc.step}; saved {exc.checkpoint}. Resume with: {command}"
        )
    return _failed(exc.exit_status)


def _program() -> list[str]:
    """How this process was started, as a person would type it: ``loralei-finetune`` when that console script
    is on the PATH, else its path, or ``python -m loralei.cli``."""
    script = Path(sys.argv[0])
    if script.name != PROG:
        return ["python", "-m", "loralei.cli"]
    on_path = shutil.which(PROG)
    return [PROG if on_path and Path(on_path).resolve() == script.resolve() else sys.argv[0]]


def _launch_command(nproc: int, args: list[str]) -> str:
    return shlex.join([*_program(), "--nproc-per-node", str(nproc), *args])


def _resume_command(args: list[str], resume_setting: str) -> str:
    """The command that continues a stopped run: the one that started it (under ``--nproc-per-node``, the
    launcher's; under torchrun, torchrun's own command line), with ``training.resume_from_checkpoint=auto``
    unless the run's config resumes by itself (``resume_setting``: its value, as a string)."""
    from .train.spawn import COMMAND_ENV

    command = os.environ.get(COMMAND_ENV) or _torchrun_command() or shlex.join([*_program(), *args])
    if resume_setting.lower() in ("auto", "true"):
        return command
    return f"{command} training.resume_from_checkpoint=auto"


def _torchrun_command() -> str | None:
    """torchrun's command line, read from the parent process (Linux), when torchrun started this process."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return None
    try:
        parts = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().decode().split("\0")
    except OSError:
        return None
    return shlex.join(part for part in parts if part) or None


def _failed(status: int) -> int:
    """``status``; a rank of a multi-process run exits with it at once (see ``launch.exit_failed``)."""
    from .train import exit_failed

    exit_failed(status)
    return status


if __name__ == "__main__":
    sys.exit(main())
