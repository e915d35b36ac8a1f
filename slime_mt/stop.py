"""Stopping a run between steps: Ctrl-C (SIGINT) or SIGTERM (what a scheduler sends before it kills a
job, Slurm's and Kubernetes' alike) asks every rank to finish the step it is in, save and stop; the run
then exits 128 + the signal's number (130, 143), as a shell reports a process the signal ended."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
SIGNAL_NAMES = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM"}


class StopRequest(threading.Event):
    """Set when a stop signal arrives; ``signum`` is the first one's."""

    def __init__(self):
        super().__init__()
        self.signum = signal.SIGINT

    def request(self, signum: int) -> None:
        if not self.is_set():
            self.signum = signum
            self.set()

    @property
    def exit_code(self) -> int:
        return 128 + int(self.signum)

    @property
    def signal_name(self) -> str:
        return SIGNAL_NAMES.get(self.signum, signal.Signals(self.signum).name)


@contextlib.contextmanager
def on_stop_signals(handler: Callable[[int, object], None]) -> Iterator[None]:
    """``handler`` for SIGINT and SIGTERM while the block runs (only in the main thread, where Python
    delivers signals: a Ray actor's task runs elsewhere); the previous handlers come back after it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, handler) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
