"""SIGINT and SIGTERM: stop a run without losing its work.

Before training starts nothing in the output directory has changed, so either signal stops the run at once: it
raises :class:`RunInterrupted` wherever the process is. While the loop runs, the first signal only asks for a
stop (:attr:`StopSignals.requested`): the loop ends after the step in progress (every rank at the same step, see
``loop.window_counts``), the run saves a checkpoint, and ``train`` raises :class:`RunInterrupted` carrying the
step and the checkpoint, which the command line turns into one line and the exit status 128 + the signal number
(130 for SIGINT, 143 for SIGTERM). A second signal stops one process at once, without saving. Under torchrun,
which passes every signal it receives on to the ranks (a Ctrl-C reaches them twice), later signals are ignored:
torchrun kills the ranks itself if they take more than its 30 s.
"""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from types import FrameType, TracebackType

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class RunInterrupted(KeyboardInterrupt):
    """A run stopped by SIGINT or SIGTERM.

    Attributes:
        signum: the signal.
        started: whether training had begun (before, nothing in the output directory had changed).
        step: the last finished step, when the run stopped after it.
        checkpoint: the checkpoint saved at that step (None when the run stopped at once, without saving).
    """

    def __init__(
        self, signum: int, started: bool, step: int | None = None, checkpoint: Path | None = None
    ) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum, self.started, self.step, self.checkpoint = signum, started, step, checkpoint

    @property
    def exit_status(self) -> int:
        """The shell's convention for a process ended by a signal: 128 + its number."""
        return 128 + self.signum


def stop_now(signum: int, _frame: FrameType | None) -> None:
    """A signal handler that stops the process at once (before a run has begun, nothing is lost)."""
    raise RunInterrupted(signum, started=False)


class StopSignals:
    """Installs the handlers for a run (in the main thread; elsewhere the signals keep their handlers) and
    restores the previous ones on exit.

    Args:
        repeats_ignored: ignore signals after the first stop request (under torchrun).
    """

    def __init__(self, repeats_ignored: bool = False) -> None:
        self.repeats_ignored = repeats_ignored
        self.requested: int | None = None  # the signal that asked for a stop
        self._graceful = False
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for signum in SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def graceful(self) -> None:
        """From now on, a first signal asks for a stop after the current step instead of stopping at once."""
        self._graceful = True

    def stop_requested(self) -> bool:
        """Whether a signal asked for a stop (polled by the loop before every step)."""
        return self.requested is not None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if not self._graceful:
            stop_now(signum, frame)
        if self.requested is None:
            self.requested = signum
        elif not self.repeats_ignored:
            raise RunInterrupted(signum, started=True)
