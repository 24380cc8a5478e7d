"""Tokenization workers: fresh interpreters, one per shard, that load the data modules and nothing else.

Importing the ``loralei`` package imports torch and the kernels (seconds and about half a GB a process), none of
which tokenization needs. A worker therefore registers bare ``loralei``, ``loralei.train`` and
``loralei.train.data`` packages (their directories, without running their ``__init__``) and imports
``loralei.train.data.shard`` from there: numpy, pyarrow, tokenizers and jinja2 are all it loads.

The workers run in their own session, so a Ctrl-C in the terminal reaches the main process alone: it kills them,
and the caller sees one ``KeyboardInterrupt``. A worker that fails makes the whole tokenization fail with one line.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

from . import progress
from .errors import DataError

PACKAGE_DIR = Path(__file__).resolve().parents[2]
# Registers the bare packages (argv[1]: the loralei package directory); what follows may import the data modules.
STUB_PACKAGES = """
import sys, types
root = sys.argv[1]
for name, sub in (("loralei", ""), ("loralei.train", "/train"), ("loralei.train.data", "/train/data")):
    package = types.ModuleType(name)
    package.__path__ = [root + sub]
    sys.modules[name] = package
"""
_BOOTSTRAP = STUB_PACKAGES + "from loralei.train.data.shard import main\nmain(sys.argv[2:])\n"


def worker_command(job_path: Path, shard: int) -> list[str]:
    """The command line of the worker for one shard."""
    return [sys.executable, "-c", _BOOTSTRAP, str(PACKAGE_DIR), str(job_path), str(shard)]


def run_workers(job_path: Path, shards: int, rows: int, directory: Path) -> None:
    """Runs one worker per shard of an ``EncodeJob`` and shows their progress; returns when all are done.

    Args:
        job_path: the job's JSON file.
        shards: how many shards (and workers).
        rows: the rows of all shards (the progress bar's total).
        directory: where the workers' logs go.

    Raises:
        DataError: a worker failed.
        KeyboardInterrupt: Ctrl-C (the workers are killed first).
    """
    # one tokenizer thread a worker: the workers already use every core
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    procs: list[subprocess.Popen] = []
    try:
        with _ctrl_c_deferred():  # a worker started but not yet in procs would be left running
            for shard in range(shards):
                with (directory / f"worker-{shard}.log").open("wb") as log:
                    procs.append(
                        subprocess.Popen(
                            worker_command(job_path, shard),
                            stdout=subprocess.PIPE,
                            stderr=log,
                            env=env,
                            start_new_session=True,
                        )
                    )
        _follow(procs, rows, directory)
        for shard in range(shards):
            (directory / f"worker-{shard}.log").unlink()
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            proc.stdout.close()


@contextlib.contextmanager
def _ctrl_c_deferred() -> Iterator[None]:
    """Holds Ctrl-C back until the block ends (then a Ctrl-C pressed meanwhile arrives).

    A Python handler that only notes the signal, not a blocked signal mask: the kernel gives a process's SIGINT to
    any thread that does not block it (pyarrow's and the tokenizers' pools), and Python then raises
    ``KeyboardInterrupt`` in the main thread wherever it is, e.g. inside ``Popen`` after the fork, which would
    leave that worker running. Outside the main thread (no handlers there) the block runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pressed: list[bool] = []
    previous = signal.signal(signal.SIGINT, lambda *_: pressed.append(True))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if pressed and callable(previous):
            previous(signal.SIGINT, None)
        elif pressed and previous == signal.SIG_DFL:
            signal.raise_signal(signal.SIGINT)


def _follow(procs: list[subprocess.Popen], rows: int, directory: Path) -> None:
    """Counts the rows the workers report until every one has finished; stops at the first that fails."""
    desc = f"tokenizing ({len(procs)} workers)"
    with selectors.DefaultSelector() as selector, progress.bar(total=rows, desc=desc, unit=" rows") as bar:
        pending = {}
        for shard, proc in enumerate(procs):
            selector.register(proc.stdout, selectors.EVENT_READ, shard)
            pending[shard] = b""
        while pending:
            for key, _ in selector.select():
                shard = key.data
                chunk = os.read(key.fileobj.fileno(), 1 << 16)
                if not chunk:  # the worker is done (or gone)
                    selector.unregister(key.fileobj)
                    del pending[shard]
                    if procs[shard].wait() != 0:
                        raise _failed(shard, procs[shard].returncode, directory / f"worker-{shard}.log")
                    continue
                *lines, pending[shard] = (pending[shard] + chunk).split(b"\n")
                bar.update(sum(int(line) for line in lines))


def _failed(shard: int, status: int, log: Path) -> DataError:
    lines = log.read_text(errors="replace").strip().splitlines()
    if status < 0:
        how = f"was killed by signal {-status}" + (" (out of memory?)" if status == -9 else "")
    else:
        how = f"failed ({lines[-1] if lines else f'exit status {status}'})"
    return DataError(
        f"training.preprocessing_num_workers: tokenization worker {shard} {how}; run again, or set "
        "preprocessing_num_workers: 1 to tokenize in this process"
    )
