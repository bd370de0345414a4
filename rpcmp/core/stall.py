"""A training step that makes no progress while every process answers.

[Note: a stalled step]
The watchdog finds a process that stops answering (:mod:`rpcmp.core.health`). A deadlock answers:
every process is alive and idle, and the step waits forever (a stage's forward blocked on a lock, a
queue or a read that never returns; distributed autograd waiting for a gradient no stage sends). So
while the master is in a training step (``RunStatus.in_step``), the watchdog also reads each
process's CPU time (:func:`cpu_seconds`) every second; when no process, the master included, has
used more than ``IDLE`` of a core for ``Job.stall_timeout`` seconds (default: 3 x
``Job.hang_timeout``), the run says so once, naming the step and each process's id for ``py-spy
dump``. With ``Job.stall_timeout`` given, it then ends the run as for a hung worker (exit 3); by
default it only warns, since a forward may wait that long on purpose (an input from a slow service).
Once a stop is asked (SIGINT, SIGTERM: [Note: stopping a run] waits for the step in flight), a step
stalled for ``STOPPING_AFTER`` seconds ends the run at once, as ``Job.stall_timeout`` would: that step
will not end by itself, and ``timeout 600 rpcmp run ...`` or a scheduler's preemption must not wait
forever for it (the latest checkpoint is the one to resume from).
A gap in the readings longer than a few seconds (the whole job stopped with SIGSTOP and continued,
a suspended machine) starts the count again. The ``shm`` transport busy-polls, so under it no
process is ever idle and nothing is said.
"""
from __future__ import annotations

import os
import sys
import time
from typing import Callable

import torch.distributed.rpc as rpc

from .served import current

__all__ = ["IDLE", "STOPPING_AFTER", "Stalls", "cpu_seconds"]

IDLE = 0.02  # a process using less of a core than this is waiting, not working
STOPPING_AFTER = 5.0  # seconds of a stalled step that end the run once a stop is asked


def cpu_seconds() -> tuple[int, float]:
    """This process's id and the CPU time it has used (an RPC endpoint)."""
    return os.getpid(), time.process_time()


class Stalls:
    """The watchdog's reading of a stalled step: :meth:`look` each interval; see [Note: a stalled step]."""

    def __init__(self, hang_timeout: float, stall_timeout: float | None = None, interval: float = 1.0):
        self.after = stall_timeout if stall_timeout is not None else 3 * hang_timeout
        self.ends = stall_timeout is not None
        self.interval = interval
        self._last: tuple[float, dict[str, float]] | None = None
        self._idle_since: float | None = None
        self._said = False
        self.pids: dict[str, int] = {}

    def check(self, workers: list[str], status, end: Callable[[str], None]) -> None:
        """Warn once, or ``end`` the run, when the step has been stalled long enough (the watchdog, each interval)."""
        stalled = self.look(workers, status)
        if stalled == "stop":
            end("rpcmp: error: StallError: " + self.message(status, STOPPING_AFTER) + f"; a stop was asked ({_stop_asked()}) and "
                "waits for this step, which will not end: the run ends now (--resume continues from the latest "
                "checkpoint)")
        elif stalled == "end":
            end("rpcmp: error: StallError: " + self.message(status))
        elif stalled == "warn":
            print("rpcmp: warning: " + self.message(status), file=sys.stderr, flush=True)

    def look(self, workers: list[str], status) -> str | None:
        """``"warn"`` or ``"end"`` once the step has been stalled long enough (each once), ``"stop"`` once it has
        been for ``STOPPING_AFTER`` seconds after a stop was asked, else None."""
        if not status.in_step:
            self._last, self._idle_since, self._said = None, None, False
            return None
        now, cpu = time.monotonic(), self._read(workers)
        last, self._last = self._last, (now, cpu)
        if last is None or now - last[0] > 3 * self.interval + 2 or cpu.keys() != last[1].keys():
            self._idle_since = None  # the first reading, or after a gap: count again
            return None
        idle = all(cpu[p] - last[1][p] < IDLE * (now - last[0]) for p in cpu)
        self._idle_since = (self._idle_since or last[0]) if idle else None
        if self._idle_since is not None and now - self._idle_since >= STOPPING_AFTER and _stop_asked():
            return "stop"
        if self._idle_since is None or now - self._idle_since < self.after or self._said:
            return None
        self._said = not self.ends
        return "end" if self.ends else "warn"

    def message(self, status, after: float | None = None) -> str:
        ids = ", ".join(f"{p} pid {i}" for p, i in self.pids.items())
        what = (f"no process has worked for {after or self.after:.0f}s while the step waited, and every process answers: a "
                f"deadlock, not a lost worker (a stage's forward blocked on a lock, a queue or a read that never "
                f"returns? a gradient no stage sends?). `py-spy dump --pid PID` shows where each waits ({ids})")
        return status.say(what)

    def _read(self, workers: list[str]) -> dict[str, float]:
        futs = {w: rpc.rpc_async(w, cpu_seconds, timeout=max(1.0, 2 * self.interval)) for w in workers}
        out = {"master": time.process_time()}
        self.pids["master"] = os.getpid()
        for w, fut in futs.items():
            try:
                self.pids[w], out[w] = fut.wait()
            except Exception:  # noqa: BLE001 - a worker that does not answer is the pings' to report
                pass
        return out


def _stop_asked() -> str | None:
    """The signal of a stop asked on this master (see [Note: stopping a run]), or None."""
    stop = current().stop
    return None if stop is None else stop.name
