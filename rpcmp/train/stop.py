"""Stop a pipeline run between two steps on SIGINT (Ctrl-C) or SIGTERM, losing nothing.

[Note: stopping a run]
The first SIGINT or SIGTERM to the master lets the step in flight finish, writes a checkpoint
(with ``--checkpoint-dir``), skips the held-out evaluation, shuts every process down cleanly and
exits ``128 + signal`` (130, 143): the run did not finish, and ``--resume`` continues it from that
step. A second signal to the master ends it at once, exit ``128 + signal``, its local workers with it
(an owner's handed on is none: the same ``kill`` to every process often reaches the master after an
owner's request). The signals are read on a thread of their own (``signal.set_wakeup_fd``), not by
Python's handler: that runs only when the main thread runs Python, and a master waiting inside torch
(a step's output, its backward) for a step that never ends never did, so neither Ctrl-C nor a second
one did anything. A stalled step ends the run once a stop is asked ([Note: a stalled step]). The master alone acts on it: an owner ignores
SIGINT (Ctrl-C in a terminal reaches every process of ``--local N``, which would otherwise lose a
stage mid-step) and waits for the master's word. An owner's first SIGTERM is handed to the master
as its own (:func:`forward_on_worker`): ``docker stop``, a Kubernetes pod's end, systemd and a
batch scheduler's preemption send SIGTERM to every process at once, and owners that died of it left
the master no stage to write its checkpoint with (the run failed, "stopped answering", nothing
saved). An owner's second SIGTERM, or one the master cannot take (it is not training), ends it.
A signal the master was started to ignore (``nohup``, a background job) stays ignored; where the
process already reads its signals so (an asyncio loop in the main thread), the handlers act as
Python's do, in the main thread. DDP mode,
where every rank trains and stopping would have to be agreed by a collective each step, keeps the
default handlers; so does a master that does not run in its process's main thread.
"""
from __future__ import annotations

import os
import signal
import sys
import threading

__all__ = ["StopRequest", "exit_status", "forward_on_worker", "requested"]

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopRequest:
    """``with StopRequest(enabled) as stop``: ``stop.signum`` is the first signal received, or None."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled and threading.current_thread() is threading.main_thread()
        self.signum: int | None = None
        self.own = False  # this process received a signal itself (not one an owner handed on: requested)
        self._old: dict[int, object] = {}
        self._wakeup: tuple[int, int, int] | None = None  # the pipe's write end, the fd it replaced, its read end
        self._lock = threading.Lock()

    @property
    def name(self) -> str | None:
        return None if self.signum is None else signal.Signals(self.signum).name

    def __enter__(self) -> "StopRequest":
        from ..core.served import current
        if self.enabled:  # a signal the process was started to ignore (nohup, a background job) stays ignored
            self._old = {s: signal.signal(s, self._in_main) for s in _SIGNALS if signal.getsignal(s) != signal.SIG_IGN}
            if self._old:
                self._read_on_a_thread()
            current().stop = self
        return self

    def __exit__(self, *exc) -> None:
        from ..core.served import current
        if current().stop is self:
            current().stop = None
        self._restore()

    def _read_on_a_thread(self) -> None:
        read, write = os.pipe()
        os.set_blocking(write, False)
        before = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        if before != -1:  # the process reads its signals already (asyncio): leave them to it, act in the main thread
            signal.set_wakeup_fd(before)
            os.close(read)
            os.close(write)
            return
        self._wakeup = (write, before, read)
        _READING.add(self)
        threading.Thread(target=self._reader, args=(read,), daemon=True, name="rpcmp-signals").start()

    def _reader(self, read: int) -> None:
        try:
            while data := os.read(read, 64):  # a byte per signal, written by the C handler whatever the main thread does
                for signum in data:
                    if signum in self._old:
                        self._received(signum)
        finally:
            os.close(read)

    def _restore(self) -> None:
        if self._wakeup is not None:
            write, before, _ = self._wakeup
            signal.set_wakeup_fd(before)
            os.close(write)  # the reader reads the end and stops
            self._wakeup = None
            _READING.discard(self)
        for s, handler in self._old.items():
            signal.signal(s, handler)
        self._old = {}

    def _in_main(self, signum, frame) -> None:
        if self._wakeup is None:  # no reader: Python's handler acts
            self._received(signum)

    def _received(self, signum: int) -> None:
        with self._lock:
            second, self.own = self.own, True
            if not second and self.signum is None:
                self._take(signum, "")
        if second:  # its second: at once
            end_now(signum)

    def _take(self, signum: int, where: str) -> None:
        self.signum = signum
        sys.stderr.write(f"\n{signal.Signals(signum).name}{where}: stopping after the step in flight (a checkpoint is "
                         f"written where --checkpoint-dir is set); send it again to stop at once\n")
        sys.stderr.flush()


_READING: set[StopRequest] = set()  # those whose signals a thread reads now


def _forked() -> None:
    """In a child forked while a run's signals are read on a thread (a user's own worker processes): the child's
    signals are its own again. Without this, each forked child's SIGINT (Ctrl-C reaches every process of the
    terminal's group) was written to the master's pipe and read as the master's second signal, and the child
    ignored SIGTERM."""
    for stop in list(_READING):
        _, _, read = stop._wakeup
        try:
            stop._restore()
            os.close(read)
        except (OSError, ValueError):  # nothing left to give back
            pass


os.register_at_fork(after_in_child=_forked)


def end_now(signum: int) -> None:
    """A second signal: end the master now, exit ``128 + signum``, and every local worker with it."""
    from ..core.health import end_run
    end_run(f"\n{signal.Signals(signum).name} again: stopping at once", 128 + signum)


def requested(signum: int, who: str) -> bool:
    """On the master, called by an owner that received ``signum``: stop as for the master's own signal. False when
    the master is not training (the owner then ends)."""
    from ..core.served import current
    stop = current().stop
    if stop is None:
        return False
    with stop._lock:
        if stop.signum is None:
            stop._take(signum, f" to {who}")
    return True


def forward_on_worker(me: str) -> None:
    """On an owner, in its main thread: its first SIGTERM goes to the master as a stop request (see [Note: stopping a
    run]); a second, or one the master does not take, ends this process as SIGTERM does."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) == signal.SIG_IGN:
        return

    def ask(signum: int) -> None:
        import torch.distributed.rpc as rpc
        try:
            taken = rpc.rpc_sync("master", requested, args=(signum, me), timeout=10)
        except Exception:  # noqa: BLE001 - no master to ask (not joined yet, or gone): end as SIGTERM does
            taken = False
        if not taken:
            os.kill(os.getpid(), signum)

    def received(signum, frame) -> None:
        signal.signal(signum, signal.SIG_DFL)  # a second one ends this process at once
        threading.Thread(target=ask, args=(signum,), daemon=True, name="rpcmp-sigterm").start()
    signal.signal(signal.SIGTERM, received)


def exit_status(result) -> int:
    """The process's exit code for a run's result: 0, or ``128 + signal`` for a run stopped early."""
    stopped = result.get("stopped") if isinstance(result, dict) else None
    return 0 if stopped is None else 128 + int(signal.Signals[stopped])
