"""``loralei-finetune --nproc-per-node N``: the run in N processes on this machine, through torch's elastic
launcher (what ``torchrun --standalone`` runs), reporting like a one-process run.

torchrun itself answers a Ctrl-C, a SIGTERM or a failed process with its own traceback and exit status 1. Here the
processes say what happened (rank 0, once), and the launcher's exit status is theirs: 0, 2 for a bad config or
input, 1 for a failed run, 130 / 143 for a run stopped by SIGINT / SIGTERM (after it saved a checkpoint).
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Sequence

# The command a person typed, for the resume line the processes print when stopped (see cli._resume_command).
COMMAND_ENV = "LORALEI_LAUNCH_COMMAND"
# The launcher's loggers: its banner, rendezvous details and failure reports; the processes report instead.
_QUIET_LOGGERS = ("torch.distributed.run", "torch.distributed.elastic", "torch.distributed.launcher")


def _exit_status(exitcode: int) -> int:
    """A process's exit code as a shell status: a death by signal N (negative code -N) is 128 + N."""
    return 128 - exitcode if exitcode < 0 else exitcode


def run_processes(nproc: int, argv: Sequence[str], command: str) -> int:
    """Runs ``python -m loralei.cli ARGV`` in ``nproc`` processes and waits for them.

    Args:
        nproc: processes to start (one per GPU on a CUDA machine).
        argv: the arguments of each process (the config file and its overrides).
        command: the command line a person would type to run this again (it resumes a stopped run).

    Returns:
        The exit status: 0 when every process finished, the first failed process's status, or 128 + a signal that
        stopped the launcher (after the processes saved a checkpoint and stopped).
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = parse_args(["--standalone", "--nproc_per_node", str(nproc), "--module", "loralei.cli", *argv])
    os.environ[COMMAND_ENV] = command
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, cores // nproc)))  # torchrun would say it set 1
    # each of the launcher's modules sets its own logger's level when imported (torch's elastic get_logger)
    for name in list(logging.root.manager.loggerDict):
        if name.startswith(_QUIET_LOGGERS):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        run(args)
    except SignalException as exc:  # the processes got the signal too, stopped and saved
        return 128 + int(exc.sigval)
    except ChildFailedError as exc:
        return _exit_status(exc.get_first_failure()[1].exitcode)
    return 0


def signal_name(status: int) -> str | None:
    """``SIGINT`` for 130, ``SIGTERM`` for 143, ...; None when ``status`` is not a death by signal."""
    try:
        return signal.Signals(status - 128).name if status > 128 else None
    except ValueError:
        return None
