"""Failure detection with a bound, and errors that say which worker, stage and step.

A worker that dies is noticed by the transport at once (its connections close) and the
master's pending call fails; :func:`explain` then pings every owner to name the one
that is gone. A worker that hangs (SIGSTOP, a deadlock, a swapped-out node) answers
nothing and closes nothing: the :class:`Watchdog` pings every worker each second and,
when one has not answered for ``Job.hang_timeout`` seconds, prints what happened and
ends the master with exit code 3 (the launcher or torchrun then stops the others). A worker
whose ping fails at once has died: that is the master's pending call to report (exit 1, naming
the step), and the watchdog ends the run only when that has not happened within ``GRACE`` seconds.

With spares (``Job(spares=K)``, ``fence=True``) the watchdog does not end the run: it
*fences* a silent worker instead, killing it when it runs on this machine (a process of
``--local`` or of another network namespace of this host: the same host and boot id, and
the process id it said at start), so that its connections close, the step in flight fails
at once and the master replaces it (see [Note: recovery from a lost owner] in
:mod:`rpcmp.master.recovery`). A silent worker on another host cannot be killed from here:
its calls fail when the RPC timeout (``Job.rpc_timeout``: 60 s with spares) runs out, and the same recovery follows.
"""
from __future__ import annotations

import contextlib
import multiprocessing
import os
import re
import signal
import socket
import sys
import threading
import time
from functools import partial
from typing import Any

import torch
import torch.distributed.rpc as rpc

from ..errors import CallTimeoutError, StageError, WorkerLostError
from .served import RunStatus, current
from .stall import Stalls

__all__ = ["WorkerLostError", "Watchdog", "Heartbeats", "end_run", "explain", "explained", "unless_lost", "unresponsive", "watch",
           "answer_watches"]

GRACE = 10.0  # seconds the master has to report a dead worker before the watchdog does


def _ping() -> int:
    return os.getpid()


def _host_id() -> str:
    try:
        boot = open("/proc/sys/kernel/random/boot_id").read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def _identity() -> tuple[int, str]:
    """This process's id and its host's, for a watchdog that may have to fence it."""
    return os.getpid(), _host_id()


def _pings(processes, timeout: float, again: bool = True) -> dict[str, str | None]:
    """Ping each process: None when it answered within ``timeout`` seconds, ``"silent"`` when it did
    not answer in time (hung, stopped, unreachable), ``"gone"`` when the call failed before that (its
    connections closed: the process died). A ping that failed well after its deadline was not seen to
    fail: this process was stopped meanwhile (see [Note: a paused job goes on] in rpcmp/job.py), and its
    deadline ran out while it was; it is sent again, once."""
    sent = time.monotonic()
    done: dict[str, float] = {}
    futs = {}
    for p in processes:
        futs[p] = rpc.rpc_async(p, _ping, timeout=timeout)
        futs[p].add_done_callback(lambda _f, p=p: done.setdefault(p, time.monotonic()))
    out = {}
    for p, fut in futs.items():
        try:
            fut.wait()
            out[p] = None
        except Exception:  # noqa: BLE001 - any failure to answer is the finding
            took = done.get(p, time.monotonic()) - sent
            out[p] = "gone" if took < 0.9 * timeout else "paused" if again and took > 1.5 * timeout + 2.0 else "silent"
    paused = [p for p, why in out.items() if why == "paused"]
    return {**out, **_pings(paused, timeout, again=False)} if paused else out


# [Note: a death seen at once]
# A dead worker's connections close at once, but the master learns it only from a call to it, and while a
# step's work is upstream of the lost stage (the encoder computing the micro-batch it will send to the lost
# decoder) there is none: the step wound down first (the demo Unet's encoder: 75-85 ms), then failed. So the
# master keeps one call pending on every owner (:func:`watch`), which the owner answers only when it leaves
# the run (:func:`answer_watches`); it fails the moment the owner dies, and the master fails the micro-batches
# it waits for at once: the recovery (or the run's error) starts while the survivors finish what they compute.
# A survivor's rollback waits for its stage's forward (rpcmp.owner.move.fill_stage holds the stage's lock).

@rpc.functions.async_execution
def _watched() -> torch.futures.Future:
    fut = torch.futures.Future()
    current().watches.append(fut)
    return fut


def answer_watches(served) -> None:
    """On a worker leaving the run: answer the master's watch calls (a pending call holds up a graceful exit)."""
    for fut in served.watches:
        if not fut.done():
            fut.set_result(None)


def watch(processes, pid: int | None) -> None:
    """On the master: keep a call pending on each of ``processes``, the owners of pipeline ``pid`` now (or, with
    ``pid`` None, the spares), not yet watched (see [Note: a death seen at once]); the master's own process is
    not. A process that no longer owns a stage of ``pid`` (a move, a re-cut) no longer fails its steps."""
    served = current()
    now = {p for p in processes if p != served.me and p not in served.lost}
    for name, pids in list(served.watching.items()):  # a watch call may fail meanwhile (_lost pops its entry)
        if name not in now:
            pids.discard(pid)
    for name in now:
        pids = served.watching.get(name)
        if pids is None:
            pids = served.watching[name] = set()
            rpc.rpc_async(served.worker(name), _watched, timeout=0).add_done_callback(partial(_lost, name))
        if pid is not None:
            pids.add(pid)


def _lost(name: str, fut: torch.futures.Future) -> None:
    """A watch call ended: answered (the process left the run as it should), or failed (its connection closed: it
    died or was fenced). A dead owner fails its pipelines' steps; a dead process that holds no stage (a spare)
    has left the run (``Served.lost``), and the trainer says so between two steps."""
    served = current()
    pids = served.watching.pop(name, set())
    try:
        fut.wait()
    except Exception as exc:  # noqa: BLE001 - the finding
        if name in served.lost:
            return
        if pids:
            served.inbox.fail(pids, WorkerLostError(f"the connection to {name} closed ({reason(exc)})"))
        else:
            served.lost.add(name)


def reason(exc: BaseException) -> str:
    """An error's first line, short, without where in TensorPipe it arose: for a line that names a loss."""
    return (str(exc).splitlines() or [""])[0].split(" (this error originated")[0][:100]


_CLOSED = re.compile(r"EOF|ECONNRESET|EPIPE|[Cc]onnection (reset|closed|refused)|[Bb]roken pipe")  # a lost peer's words


def loss_cause(error: BaseException, gone: str | None) -> str:
    """What a recovery line says ended the step that lost ``gone``: one wording for a closed connection, whichever
    call saw it first (the watch call's WorkerLostError, or a transport error from a call in flight)."""
    text = reason(error)
    if isinstance(error, WorkerLostError) or gone is None:
        return text
    if _CLOSED.search(text):
        return f"the connection to {gone} closed ({text})"
    return f"{type(error).__name__}: {text}"


def unresponsive(processes, timeout: float) -> list[str]:
    """The processes that do not answer a ping within ``timeout`` seconds (a dead one fails at once)."""
    return [p for p, why in _pings(processes, timeout).items() if why]


def unless_lost(call, processes, default=None) -> tuple[Any, list[str]]:
    """``(call(), [])``; where it fails and some of ``processes`` no longer answer, ``(default, those)``: a call
    between two steps that met a lost owner, which the next step meets too (and, with spares, recovers from).
    A failure with every process answering is re-raised."""
    try:
        return call(), []
    except Exception:  # noqa: BLE001 - see the docstring
        gone = unresponsive(sorted(set(processes)), timeout=3.0)
        if not gone:
            raise
        return default, gone


def explain(exc: BaseException, processes, status: RunStatus, timeout: float = 3.0) -> BaseException:
    """Turn a transport error into a :class:`WorkerLostError` naming the lost workers and what
    ``status`` says the run was doing."""
    if isinstance(exc, StageError) and not isinstance(exc, WorkerLostError):
        exc.step = status.step  # shown after the stage's traceback (rpcmp.cli.commands.report)
        if not _CLOSED.search(str(exc)):  # else a neighbour's loss, which the lost one's name says better
            return exc
    try:
        lost = unresponsive([p for p in processes if p != rpc.get_worker_info().name], timeout)
    except Exception:  # noqa: BLE001 - the agent itself may be going down
        lost = []
    if not lost:
        ran = re.search(r"ran for more than set timeout \((\d+) ms\)", str(exc))
        return exc if ran is None else CallTimeoutError(status.say(
            f"a call between processes ran past its timeout ({int(ran[1]) / 1000:.0f} s, Job.rpc_timeout), yet every "
            f"process answers: the job was stopped and continued (SIGSTOP, Ctrl-Z, a frozen container) for longer "
            f"than that, or a call waited that long. A larger Job.rpc_timeout lets a paused job go on"))
    return WorkerLostError(status.describe(lost, f"stopped answering ({type(exc).__name__}: {str(exc).splitlines()[0]})"))


@contextlib.contextmanager
def explained(explain):
    """Re-raise a failure in the block as ``explain(exc)`` names it (a :class:`WorkerLostError`
    for a lost worker), or as it was: wherever the loss is noticed (a training step, a held-out
    evaluation, a checkpoint save, a prediction), the error names the worker and the step or task."""
    try:
        yield
    except Exception as exc:
        better = explain(exc)
        if better is exc:
            raise
        raise better from exc


def end_run(line: str, code: int = 3) -> None:  # say it; this process ends now, every local worker with it
    print(line, file=sys.stderr, flush=True)
    for child in multiprocessing.active_children():  # even a stopped one
        child.kill()
    os._exit(code)


class Watchdog(threading.Thread):
    """Ping every worker; end the master if one stays silent for ``timeout`` seconds."""

    def __init__(self, workers: list[str], timeout: float, status: RunStatus, interval: float = 1.0,
                 fence: bool = False, gone: set[str] | None = None, stalls: Stalls | None = None):
        super().__init__(daemon=True, name="rpcmp-watchdog")
        self.workers, self.timeout, self.status, self.interval, self.stalls = workers, timeout, status, interval, stalls
        self._halt = threading.Event()
        self.fence, self.fenced, self.identities = fence, set(), {}
        self.gone = gone if gone is not None else set()  # left the run on purpose or replaced: not watched
        if fence:  # who each worker is, while every one answers: see the module's docstring
            futs = {w: rpc.rpc_async(w, _identity, timeout=30) for w in workers}
            self.identities = {w: f.wait() for w, f in futs.items()}

    def run(self) -> None:
        gone_since: dict[str, float] = {}
        while not self._halt.wait(self.interval):
            pings = _pings([w for w in self.workers if w not in self.fenced and w not in self.gone], self.timeout)
            if self.stalls is not None and not self._halt.is_set():  # see [Note: a stalled step] in rpcmp/core/stall.py
                self.stalls.check([w for w, why in pings.items() if not why], self.status, end_run)
            if self.fence:
                for w in [w for w, why in pings.items() if why and not self._halt.is_set()]:
                    self._fence(w)
                continue
            # A dead worker (its ping failed at once) is the master's to report: its pending call fails
            # at once too, naming the step (exit 1). One that hangs, and one dead for GRACE seconds
            # with the run still going (a call waiting on it elsewhere), are ended here.
            now = time.monotonic()
            gone_since = {w: gone_since.get(w, now) for w, why in pings.items() if why == "gone"}
            silent = [w for w, why in pings.items() if why == "silent"]
            dead = [w for w, since in gone_since.items() if now - since >= min(self.timeout, GRACE)]
            if (silent or dead) and not self._halt.is_set():
                why = [] if not silent else [self.status.describe(
                    silent, f"did not answer for {self.timeout:.0f}s (hung or unreachable; Job.hang_timeout)")]
                why += [] if not dead else [self.status.describe(
                    dead, "exited (its connections closed)")]
                end_run("rpcmp: error: WorkerLostError: " + "; ".join(why))

    def _fence(self, worker: str) -> None:
        self.fenced.add(worker)
        pid, host = self.identities.get(worker, (None, None))
        if pid is None or host != _host_id():
            print(f"rpcmp: warning: {worker} did not answer for {self.timeout:.0f}s and runs on another host: its "
                  f"calls fail when the RPC timeout runs out, then a spare takes over", file=sys.stderr, flush=True)
            return
        try:
            if open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z":
                return  # it died already (a zombie not yet reaped): nothing to fence
            os.kill(pid, signal.SIGKILL)
        except (OSError, IndexError):
            return  # it had died already: the step in flight has failed or will, and a spare takes over
        print(f"rpcmp: warning: {worker} (pid {pid}) did not answer for {self.timeout:.0f}s (hung or stopped; "
              f"Job.hang_timeout): killed it so that a spare takes over its stage", file=sys.stderr, flush=True)

    def stop(self) -> None:
        self._halt.set()


class Heartbeats(threading.Thread):
    """DDP mode has no RPC to ping with: every rank counts its beats in the rendezvous store
    each second; rank 0 ends the job when another has been silent for ``timeout`` seconds, and
    every other rank ends itself when rank 0 has (nothing else would: a collective may wait
    Job.call_timeout). After a collective fails, :meth:`explain` names the ranks that went silent.

    [Note: heartbeats without wall clocks]
    A beat is a counter, not a time stamp: each rank notes, on its own monotonic clock,
    when it last saw another rank's counter move. Stamps of ``time.time()`` compared
    across nodes made a clock skew above ``hang_timeout`` end a healthy job. A store
    error does not end the thread on rank 0: it is said once and the beats go on when the
    store answers again (the other ranks: see :meth:`_round`)."""

    def __init__(self, rank: int, world_size: int, timeout: float, store, status: RunStatus, interval: float = 1.0,
                 store_timeout: float = 30.0):
        super().__init__(daemon=True, name="rpcmp-heartbeats")
        self.rank, self.world, self.timeout, self.store, self.interval = rank, world_size, timeout, store, interval
        self.store_timeout = store_timeout  # how long one call to ``store`` may wait
        self._pending = None  # the call to the store out now: (its end, what it found)
        self.status = status
        self._halt = threading.Event()
        self._seen: dict[int, tuple[int, float]] = {}  # rank -> (its count, when it last moved, monotonic)
        self.store_errors = 0
        status.stages = {f"worker{r}" if r else "master": ["DDP replica"] for r in range(world_size)}

    def _beat(self) -> None:
        self.store.add(f"rpcmp/hb/{self.rank}", 1)

    def silent(self, limit: float, ranks=None) -> list[int]:
        """The ranks (other than this one) whose count has not moved for ``limit`` seconds."""
        now, out = time.monotonic(), []
        for r in (range(self.world) if ranks is None else ranks):
            if r == self.rank:
                continue
            count = self.store.add(f"rpcmp/hb/{r}", 0)
            seen, since = self._seen.get(r, (None, now))
            if count != seen:
                self._seen[r] = (count, now)
            elif now - since > limit:
                out.append(r)
        return out

    def run(self) -> None:
        last = self._answered = time.monotonic()
        while not self._halt.wait(self.interval):
            now = time.monotonic()
            if now - last > 3 * self.interval + 2.0:  # this process was stopped: so may the others have been
                self._fresh(now)
            lost, how = self._round(now)
            last = time.monotonic()  # a round may wait for the store: only the wait between rounds is a gap
            if lost and not self._halt.is_set():
                names = [f"worker{r}" if r else "master" for r in lost]
                end_run("rpcmp: error: WorkerLostError: " + self.status.describe(names, how))

    def _fresh(self, now: float) -> None:
        """Every rank, and the store, get a whole ``timeout`` from ``now`` (this process was stopped)."""
        self._seen = {r: (count, now) for r, (count, _) in self._seen.items()}
        self._answered = now

    def _round(self, now: float) -> tuple[list[int], str]:
        """One beat and one look: the ranks this one finds silent (rank 0 looks at every rank, the others at rank
        0), and how. The store is rank 0's process in a local run: on the other ranks, a store that has not answered
        for ``timeout`` is rank 0 silent too."""
        try:
            lost = self._look()
            self._answered = time.monotonic()
            return lost, f"did not answer for {self.timeout:.0f}s (hung or unreachable; Job.hang_timeout)"
        except Exception as exc:  # noqa: BLE001 - said once; the beats resume when the store answers
            if time.monotonic() - now > 1.5 * self.store_timeout + 2.0:  # stopped while the call was out
                self._fresh(time.monotonic())
                return [], ""
            if self.rank and self.timeout and time.monotonic() - self._answered > self.timeout:
                return [0], (f"did not answer for {self.timeout:.0f}s, nor did the store it serves (hung or "
                             f"unreachable; Job.hang_timeout)")
            self.store_errors += 1
            if self.store_errors == 1 and not self._halt.is_set():
                print(f"rpcmp: warning: rank {self.rank}: the heartbeat store did not answer ({type(exc).__name__}: "
                      f"{exc}); retrying every {self.interval:.0f}s", file=sys.stderr, flush=True)
            return [], ""

    def _look(self) -> list[int]:
        """Beat and look at the others (:meth:`silent`) on a thread of its own, waited for ``store_timeout``: a
        store whose process is frozen keeps a call waiting whatever its timeout says, and the call is not made
        again until it returns."""
        if self._pending is None:
            done, box = threading.Event(), {}

            def call():
                try:
                    self._beat()
                    box["lost"] = self.silent(self.timeout, ranks=None if self.rank == 0 else [0]) if self.timeout else []
                except Exception as exc:  # noqa: BLE001 - raised on the heartbeat thread below
                    box["error"] = exc
                done.set()
            self._pending = (done, box)
            threading.Thread(target=call, daemon=True, name="rpcmp-heartbeat-call").start()
        done, box = self._pending
        if not done.wait(self.store_timeout):
            raise TimeoutError(f"no answer in {self.store_timeout:.0f}s")
        self._pending = None
        if "error" in box:
            raise box["error"]
        return box["lost"]

    def explain(self, exc: BaseException) -> BaseException:
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            try:
                lost = self.silent(2.0)
            except Exception:  # noqa: BLE001
                break
            if lost:
                return WorkerLostError(self.status.describe([f"worker{r}" if r else "master" for r in lost],
                                                f"stopped answering ({type(exc).__name__}: {str(exc).splitlines()[0]})"))
            time.sleep(0.25)
        return exc

    def stop(self) -> None:
        self._halt.set()
