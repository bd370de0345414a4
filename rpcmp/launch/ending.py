"""How a run's processes leave it: the master's word on how the run ended, the workers' wait for it,
and the shutdown of the RPC world, bounded when a peer is gone (see the notes below)."""
from __future__ import annotations

import contextlib
import datetime
import logging
import os
import sys
import time

import torch.distributed.rpc as rpc

from ..core.health import answer_watches, unresponsive
from ..errors import (CheckpointError, JobError, MicroBatchError, NonFiniteLossError, PartitionError, PlacementError,
                      StageError, WorkerLostError)
from ..core.served import current
from ..owner.move import leave_after, leave_soon
from ..plan.placement import MASTER, process_name
from .groups import leave_stage_groups

__all__ = ["leave_world", "serve_until_told"]

_SHUTDOWN_TIMEOUT = 30.0
_TOLD_SHUTDOWN_TIMEOUT = 10.0  # see [Note: an end told]
_TOLD_LEAVE_S = 15.0
# errors after which every process still answers
_ALL_ANSWER = (StageError, JobError, PartitionError, PlacementError, MicroBatchError, NonFiniteLossError, CheckpointError)


def leave_world(served, rank: int, world_size: int, error: BaseException | None) -> bool:
    """Leave the run's RPC world (the master first says how the run ended); return whether every peer took part."""
    # A stage's own failure, or a job the master refuses (a split, a placement, a batch, a loss), leaves every
    # process answering: leave as after success (no transport noise); a process lost and replaced in place
    # (rpcmp/master/recovery.py) takes no part in a graceful shutdown. The master's choice is the workers'
    # (a worker in a graceful shutdown the master skips waits out its timeout).
    if rank == 0 and error is None:
        _note_gone_at_end(served, world_size)
    graceful = served.graceful and not served.lost and (
        error is None or (isinstance(error, _ALL_ANSWER) and not isinstance(error, WorkerLostError)))
    with contextlib.ExitStack() as muted:
        if not graceful:
            muted.enter_context(native_log_muted())
        if rank == 0:
            workers = [w for w in map(process_name, range(1, world_size)) if w not in served.lost]
            told = _tell_outcome(workers, error is None, graceful=graceful)
            if error is None:  # see [Note: an end told]
                served.ended.update(told if graceful else workers)  # told to leave at once, they may not answer first
                _name_gone_at_end(served, [w for w in workers if w not in told] if graceful else [])
            if graceful and len(told) < len(workers):  # the barriers would wait for the silent ones: leave at once
                graceful = False
                muted.enter_context(native_log_muted())
                _tell_outcome(sorted(told), error is None, graceful=False)
        elif not graceful and served.told.is_set():
            time.sleep(0.2)  # the answer to the master's word on its way first
        answer_watches(served)
        left = _shutdown(graceful, _TOLD_SHUTDOWN_TIMEOUT if rank == 0 or served.told.is_set() else _SHUTDOWN_TIMEOUT)
    if served.leave_by is not None:
        served.leave_by.set()  # left in time
    leave_stage_groups(served)  # after the RPC world: a worker's stages average gradients until the master leaves
    return left


# [Note: every rank says how the job ended]
# A worker serves until the master shuts the world down; that shutdown succeeds after a
# master's failure too (a stage error) or fails (the master died). Either way the worker
# used to exit 0, and torchrun took its node for finished: under --max-restarts the
# restarted master then waited for nodes that had gone home. The master now tells every
# worker whether the run ended normally (rpcmp.core.served.Served.outcome); a worker that was not
# told so exits 1.
def _outcome(ok: bool, graceful: bool = True) -> None:
    served = current()
    served.outcome, served.graceful = ok, graceful
    answer_watches(served)
    # The rendezvous store of a run through worker daemons lives in the master's process: leave the
    # stage groups while it is up (a destroy after the master left waited for it until killed).
    try:
        leave_stage_groups(served)
    finally:
        served.told.set()
    if not graceful:  # see [Note: leaving a world with a lost peer]
        mute_native_log()  # for good: the process leaves within the second
        leave_soon(0 if ok else 1)
    else:  # at the latest when a peer gone since holds up the shutdown's barriers (see [Note: an end told])
        served.leave_by = leave_after(0 if ok else 1, _TOLD_LEAVE_S)


# [Note: leaving a world with a lost peer]
# A worker leaves through a graceful ``rpc.shutdown``, whose barrier counts every rank of the
# world: after a peer was lost and replaced in place (rpcmp/master/recovery.py) or drained, it
# would wait out the store's timeout (60 s) for the one gone. The master says so with the
# outcome; the worker then leaves at once, with the exit code of the run, once its answer is on its way.


# [Note: a worker serves until the master's word]
# A worker runs nothing of its own: it answers the master's calls until the master says how the run
# ended (``_outcome``). It used to wait inside a graceful ``rpc.shutdown``, whose barrier gives up after
# its timeout (30 s) and goes on to tear the agent down: after torch's wait for the RRefs the master
# still held (100 s) and the agent's join, every worker of a run longer than about three minutes left,
# mid-step (the master then failed with EPIPE). The worker now waits for the master's word without a
# bound and pings the master every few seconds, so that it still leaves when the master is gone: a
# killed master fails the ping at once, a stopped one after Job.rpc_timeout (30 minutes without spares,
# so that a paused job goes on: [Note: a paused job goes on] in rpcmp/job.py). Only then does it enter
# the shutdown, whose barrier the master reaches within moments (or which fails, and the worker
# exits 1: [Note: every rank says how the job ended]).
def serve_until_told(served, timeout: float, every: float = 2.0) -> None:
    """On a worker: return when the master has said how the run ended, or stops answering a ping."""
    while not served.told.wait(every):
        if unresponsive([MASTER], timeout):
            return


def _note_gone_at_end(served, world_size: int) -> None:
    """A worker lost after the run's last step (its checkpoint written) takes nothing from the run: it is named
    and counted as lost, and the others leave without waiting for it (they waited out the shutdown's timeout,
    and the local launcher called its exit a failure)."""
    try:
        gone = unresponsive([w for w in map(process_name, range(1, world_size)) if w not in served.lost], timeout=3.0)
    except Exception:  # noqa: BLE001 - the agent itself may be going down: the shutdown says what it finds
        gone = []
    _name_gone_at_end(served, gone)


def _name_gone_at_end(served, gone: list[str]) -> None:
    for w in gone:
        print(f"rpcmp: {w} stopped answering after the run's last step; the run is complete", file=sys.stderr, flush=True)
    served.lost.update(gone)


def _tell_outcome(workers: list[str], ok: bool, graceful: bool = True) -> set[str]:
    """Tell every worker how the run ended; return the ones that answered."""
    futs = {}
    for w in workers:
        try:
            futs[w] = rpc.rpc_async(w, _outcome, args=(ok, graceful), timeout=5)
        except Exception:  # noqa: BLE001 - a worker that is gone cannot be told
            pass
    told = set()
    for w, fut in futs.items():
        try:
            fut.wait()
            told.add(w)
        except Exception:  # noqa: BLE001 - it then exits 1, as it should
            pass
    return told


# [Note: an end told]
# Once the master has told the workers how the run ended, nothing is left to do but leave, and
# every process enters the shutdown within moments. A worker killed in that window (as it answers,
# or inside the shutdown's barriers) used to fail a complete run after minutes: the others waited
# out the barriers (30 s for the gather of ``rpc.shutdown``, the store's timeout, 60 s, in the
# agent's join, then 100 s for RRef deletions the master, its gather failed, never sent), and the
# local launcher called the -9 a failure. Now the barriers of a told end are bounded at 10 s (the
# store's timeout too), a told worker leaves by itself 15 s after the word at the latest (with the
# run's exit code), and after a run that ended normally a worker that did not answer the word is
# named as gone after the last step (and the others are told to leave without the barriers), while
# one that answered (``Served.ended`` on the master) may end as it will: the run's result and
# checkpoint stand, and the local launcher names it instead of failing.


# [Note: a quiet end after a loss]
# Without every peer, the survivors leave the RPC world without its barriers (graceful=False), and
# TensorPipe logs each connection that closes under it (a line per pair of processes: 16 after a
# 5-process run lost one) and every RRef whose deletion was not confirmed ("Detected RRef Leaks",
# a dump per process). None of it says more than the run has said (what was lost, and when, at
# the time), and it buried the run's last lines. So a shutdown without the barriers runs with the
# process's native log (file descriptor 2, where TensorPipe writes) sent to /dev/null, while
# Python's own output (sys.stderr, rpcmp's messages) still reaches the terminal. The lines at the
# moment of a loss are left as they are, and TORCH_CPP_LOG_LEVEL set in the environment keeps them all.
@contextlib.contextmanager
def native_log_muted():
    """Native code's writes to stderr go nowhere for the block; Python's still go out: see [Note: a quiet end
    after a loss]."""
    restore = mute_native_log()
    try:
        yield
    finally:
        restore()


def mute_native_log():
    """Send file descriptor 2 to /dev/null and ``sys.stderr`` to where it went; returns what undoes it. Nothing
    where TORCH_CPP_LOG_LEVEL is set (asked for the native log) or where it is muted already."""
    if "TORCH_CPP_LOG_LEVEL" in os.environ or _MUTED:
        return lambda: None
    sys.stderr.flush()
    python_stderr, real = sys.stderr, os.dup(2)
    try:
        through_fd = python_stderr.fileno() == 2  # else (captured, redirected) the mute does not reach it
    except (AttributeError, OSError, ValueError):
        through_fd = False
    if through_fd:
        sys.stderr = os.fdopen(os.dup(real), "w", buffering=1)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    os.close(null)
    _MUTED.append(real)

    def restore():
        sys.stderr.flush()
        os.dup2(real, 2)
        os.close(real)
        if through_fd:
            sys.stderr.close()
            sys.stderr = python_stderr
        _MUTED.remove(real)
    return restore


_MUTED: list[int] = []


def _shutdown(graceful: bool, timeout: float) -> bool:
    """Leave the RPC world, waiting at most ``timeout`` in each of a graceful shutdown's barriers; return
    whether every peer took part."""
    if not graceful:
        try:
            rpc.shutdown(graceful=False)
            return True
        except Exception as exc:  # noqa: BLE001 - as below
            print(f"rpcmp: RPC shutdown: {exc}", file=sys.stderr)
            return False
    try:  # the store's timeout bounds the agent's join
        rpc.api._get_current_rpc_agent().store.set_timeout(datetime.timedelta(seconds=timeout))
    except Exception:  # noqa: BLE001 - another agent: its own timeouts hold
        pass
    quiet = logging.getLogger("torch.distributed.rpc.api")  # it logs a traceback for what is said below
    level = quiet.level
    try:
        quiet.setLevel(logging.CRITICAL)
        rpc.shutdown(graceful=True, timeout=timeout)
        return True
    except Exception as exc:  # noqa: BLE001 - a peer already gone must not hang or mask the real error
        print(f"rpcmp: RPC shutdown: {exc}", file=sys.stderr)
        return False
    finally:
        quiet.setLevel(level)
