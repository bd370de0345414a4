"""Stop a pipeline run between two steps on SIGINT (Ctrl-C) or SIGTERM, losing nothing.

[Note: stopping a run]
The first SIGINT or SIGTERM to the master lets the step in flight finish, writes a checkpoint
(with ``--checkpoint-dir``), skips the held-out evaluation, shuts every process down cleanly and
exits ``128 + signal`` (130, 143): the run did not finish, and ``--resume`` continues it from that
step. A second signal stops at once, as before. The master alone acts on it: an owner ignores
SIGINT (Ctrl-C in a terminal reaches every process of ``--local N``, which would otherwise lose a
stage mid-step) and waits for the master's word. A signal the master was started to ignore (``nohup``,
a background job) stays ignored. DDP mode, where every rank trains and stopping
would have to be agreed by a collective each step, keeps the default handlers; so does a master
that does not run in its process's main thread.
"""
from __future__ import annotations

import signal
import sys
import threading

__all__ = ["StopRequest", "exit_status"]

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopRequest:
    """``with StopRequest(enabled) as stop``: ``stop.signum`` is the first signal received, or None."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled and threading.current_thread() is threading.main_thread()
        self.signum: int | None = None
        self._old: dict[int, object] = {}

    @property
    def name(self) -> str | None:
        return None if self.signum is None else signal.Signals(self.signum).name

    def __enter__(self) -> "StopRequest":
        if self.enabled:  # a signal the process was started to ignore (nohup, a background job) stays ignored
            self._old = {s: signal.signal(s, self._received) for s in _SIGNALS if signal.getsignal(s) != signal.SIG_IGN}
        return self

    def __exit__(self, *exc) -> None:
        self._restore()

    def _restore(self) -> None:
        for s, handler in self._old.items():
            signal.signal(s, handler)
        self._old = {}

    def _received(self, signum, frame) -> None:
        if self.signum is not None:  # the second: stop at once, the way the handler before would have
            old = self._old.get(signum, signal.SIG_DFL)
            self._restore()
            if callable(old):
                old(signum, frame)
            else:
                signal.raise_signal(signum)
            return
        self.signum = signum
        sys.stderr.write(f"\n{signal.Signals(signum).name}: stopping after the step in flight (a checkpoint is "
                         f"written where --checkpoint-dir is set); send it again to stop at once\n")
        sys.stderr.flush()


def exit_status(result) -> int:
    """The process's exit code for a run's result: 0, or ``128 + signal`` for a run stopped early."""
    stopped = result.get("stopped") if isinstance(result, dict) else None
    return 0 if stopped is None else 128 + int(signal.Signals[stopped])
