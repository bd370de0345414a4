"""The local launcher: N processes of one job on this machine, bound to loopback only,
with a free port chosen by the parent; a child that fails to start ends the run at once."""
from __future__ import annotations

import gc
import io
import os
import sys
import threading
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed.rpc as rpc

from ..core.served import current
from ..errors import LaunchError, RpcmpError, RunAbortedError
from ..job import Job, load_job
from .network import bound_store
from .server import process_context
from ..plan.placement import process_name
from ..plan.topology import Topology
from .runtime import reserve_ports, run_rank

__all__ = ["launch_local"]


def _watch_parent(parent: int) -> None:
    """A local worker exits if its launcher dies, so nothing is left behind (its parent is the
    fork server, which exits with the launcher: either going away ends the worker)."""
    server = os.getppid()

    def loop():
        while True:
            try:
                os.kill(parent, 0)
            except ProcessLookupError:
                os._exit(3)
            except PermissionError:
                pass
            if os.getppid() != server:
                os._exit(3)
            time.sleep(0.5)
    threading.Thread(target=loop, daemon=True, name="rpcmp-parent-watch").start()


# A local run talks on loopback only, whatever RPCMP_IFACE / --iface say (they are for multi-node runs).
_LOCAL_ENV = {"RPCMP_IFACE": "lo", "TP_SOCKET_IFNAME": "lo", "GLOO_SOCKET_IFNAME": "lo", "TORCHELASTIC_USE_AGENT_STORE": "True"}


def _name_process(name: str) -> None:
    """Show the rank in ``ps`` / ``top`` / ``pgrep`` (a forked rank's command line is the fork server's)."""
    try:
        import ctypes
        ctypes.CDLL(None).prctl(15, f"rpcmp-{name}"[:15].encode(), 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):  # not Linux
        pass


def _local_child(job_path, rank, world_size, port, overrides, main, results, parent, started, env, held=None):
    gc.freeze()  # see [Note: what a fork inherits, frozen] in .server
    if held is not None:
        os.close(held)  # the launcher's rendezvous port, inherited by the fork: the launcher's alone
    _watch_parent(parent)
    _name_process(process_name(rank))
    os.environ.clear()
    os.environ.update(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **_LOCAL_ENV)
    try:
        # Said once, by the parent: a job that fails to import in this process (a LaunchError naming it),
        # and the job's own mistakes (the same on every rank), as is: a setting refused (--snapshot-every -1,
        # --rebalance on stages that cannot move), a world that cannot hold the stages.
        try:
            job = load_job(job_path, overrides=overrides)  # fails here, not in the RPC rendezvous: see _wait_started
        except Exception as exc:  # noqa: BLE001
            imported = exc.__cause__ is None  # load_job raises an import's failure from it
            started.put((rank, f"{type(exc).__name__}: {exc}", _input_mistake(exc) if imported else None))
            sys.exit(1)
        try:
            if job.mode != "ddp":  # DDP: the whole model on every rank, no stages to place
                Topology.of(job, world_size)
        except Exception as exc:  # noqa: BLE001
            started.put((rank, f"{type(exc).__name__}: {exc}", _input_mistake(exc)))
            sys.exit(1)
        started.put((rank, None, None))
        try:
            out = run_rank(job_path, rank, world_size, main, overrides, local_procs=world_size)
        except RunAbortedError:
            sys.exit(1)  # the master's own error is what the parent reports
        if results is not None:
            buf = io.BytesIO()
            torch.save(out, buf)  # bytes, not shared-memory handles that die with this process
            results.put(("ok", (buf.getvalue(), sorted(current().lost), sorted(current().ended))))
    except BaseException as exc:
        if results is not None:
            results.put(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        raise


def launch_local(job_path: str, nprocs: int, main: Callable[[Job, int], Any], overrides: dict | None = None,
                 timeout: float | None = None, master_in_process: bool = True, fork_here: bool = False) -> Any:
    """Run a job on ``nprocs`` processes of this machine; return ``main``'s result.

    The master runs in this process by default (so progress shows in this terminal);
    with ``master_in_process=False`` it runs in a child too and its result comes back
    through a queue (tests use this so every test gets fresh processes). ``fork_here``: the caller
    has computed nothing yet (the command line): the ranks may fork from this process (see
    [Note: forked from a warm server]).
    """
    master_in_process = master_in_process and not _rpc_used_here()  # see [Note: one RPC world per process]
    ctx = process_context(job_path, fork_here=fork_here and master_in_process)
    started = ctx.Queue()
    held = reserve_ports("127.0.0.1")[0]  # bound until the store takes it over, after the forks
    port = held.getsockname()[1]
    forked = held.fileno() if ctx.get_start_method() == "fork" else None  # a child forked here holds it too
    results = None if master_in_process else ctx.Queue()
    first = 1 if master_in_process else 0
    procs = []
    for rank in range(first, nprocs):
        p = ctx.Process(target=_local_child, name=process_name(rank),
                        args=(job_path, rank, nprocs, port, overrides, main,
                              results if rank == 0 else None, os.getpid(), started, dict(os.environ), forked))
        p.start()
        procs.append(p)
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        # The rendezvous store listens on loopback only; every rank joins it as a client (and waits for it).
        # Made after the forks: its thread must not run in this process when a rank forks from it.
        store = bound_store("127.0.0.1", port, sock=held)  # noqa: F841 - lives as long as the run
        _wait_started(started, procs, deadline)
        if master_in_process:
            result = _master_here(job_path, nprocs, port, main, overrides, procs, deadline, timeout)
            lost, ended = current().lost, current().ended
        else:
            result, lost, ended = _wait_result(results, procs, deadline)
        for p in sorted(procs, key=lambda p: p.name in lost):  # a lost one is no part of the run: it does not hold up its end
            _end_lost(p) if p.name in lost else p.join(None if deadline is None else max(1.0, deadline - time.monotonic()))
        # a process the master lost and replaced in place (rpcmp/master/recovery.py) ended as it did; so did one
        # that heard the run end normally (see [Note: an end told] in .ending)
        for p in procs:
            if p.exitcode not in (0, None) and p.name in ended - lost:
                print(f"rpcmp: {p.name} exited with {p.exitcode} after the run had ended normally; the run is complete",
                      file=sys.stderr, flush=True)
        bad = [(p.name, p.exitcode) for p in procs if p.exitcode not in (0, None) and p.name not in lost | ended]
        if bad:
            raise RuntimeError(f"local processes exited with errors: {bad}")
        if any(p.is_alive() for p in procs):
            raise TimeoutError(f"local processes still running after {timeout}s: "
                               f"{[p.name for p in procs if p.is_alive()]}")
        return result
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)


def _master_here(job_path, nprocs, port, main, overrides, procs, deadline, timeout) -> Any:
    """Rank 0 in this process, on loopback, its children killed if it outlives ``timeout``."""
    saved = {k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT", *_LOCAL_ENV)}
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **_LOCAL_ENV)
    watch = _Deadline(deadline, procs)
    try:
        result = run_rank(job_path, 0, nprocs, main, overrides, local_procs=nprocs)
    except Exception as exc:
        if watch.fired:  # the master's error is what killing the workers caused
            raise TimeoutError(f"the run outlived timeout={timeout}s: its processes were killed") from exc
        raise
    finally:
        watch.cancel()
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    if watch.fired:
        raise TimeoutError(f"the run outlived timeout={timeout}s: its processes were killed")
    return result


def _input_mistake(exc: BaseException) -> BaseException | None:
    """``exc`` if it is a mistake in the job (an rpcmp input error: ValueError) that survives pickling."""
    import pickle
    if not isinstance(exc, RpcmpError) or not isinstance(exc, ValueError):
        return None
    try:
        return pickle.loads(pickle.dumps(exc)) and exc
    except Exception:  # noqa: BLE001 - said as text then
        return None


def _wait_started(started, procs, deadline) -> None:
    """Wait until every child has imported the job; raise at once, naming the rank and its
    error, if one dies first (instead of the others waiting out the RPC rendezvous)."""
    import queue
    waiting = {int(p.name.removeprefix("worker")) if p.name != "master" else 0: p for p in procs}
    while waiting:
        try:
            rank, error, mistake = started.get(timeout=0.2)
        except queue.Empty:
            dead = [(r, p.exitcode) for r, p in waiting.items() if p.exitcode is not None]
            if dead and started.empty():  # (a child that said why before exiting is reported by what it said)
                rank, code = dead[0]
                raise LaunchError(f"{process_name(rank)} (rank {rank}) exited with code {code} while starting, "
                                  f"before joining the job") from None
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"{[process_name(r) for r in waiting]} did not start in time") from None
            continue
        if mistake is not None:
            raise mistake  # the job's own mistake (JobError, PlacementError, ...), as the master would have said it
        if error is not None:
            raise LaunchError(f"{process_name(rank)} (rank {rank}) failed while starting, before joining the job: {error}")
        waiting.pop(rank, None)


def _rpc_used_here() -> bool:
    """Whether this process has joined an RPC world before.

    [Note: one RPC world per process]
    ``torch.distributed.rpc`` numbers what it does per process: the store prefix of each
    ``init_rpc`` (``rpc_prefix_{n}``), the rounds of its internal all-gather, and (in C++,
    out of reach) the barriers of a graceful shutdown (``READY_ID_{n}``). Fresh children
    count from 0; a process that already ran a master counts on, so a second
    :func:`launch_local` with the master in this process (a notebook) waits forever on
    keys no child writes. The second and later calls run the master in a child of its own.
    """
    return getattr(rpc, "_init_counter", 0) > 0


class _Deadline:
    """Kills the children when a master in this process outlives the run's timeout, so every
    wait of the master (RPC calls to them, the shutdown) ends with an error instead of hanging."""

    def __init__(self, deadline: float | None, procs: list):
        self.fired = False
        self._timer = None
        if deadline is not None:
            self._timer = threading.Timer(max(0.0, deadline - time.monotonic()), self._fire, args=(procs,))
            self._timer.daemon = True
            self._timer.start()

    def _fire(self, procs: list) -> None:
        self.fired = True
        for p in procs:
            if p.is_alive():
                p.kill()

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()


def _end_lost(p, grace: float = 5.0) -> None:
    """A process the run lost (stopped, hung, drained) that has not exited a few seconds after the others: kill it
    (a SIGSTOPped one held the launcher's join forever)."""
    p.join(grace)
    if p.is_alive():
        print(f"rpcmp: {p.name}, lost by the run, still there after it ended: killed", file=sys.stderr, flush=True)
        p.kill()
        p.join(grace)


def _wait_result(results, procs, deadline):
    import queue
    while True:
        try:
            status, value = results.get(timeout=0.5)
        except queue.Empty:
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError("the master did not finish in time; processes were killed") from None
            dead = [(p.name, p.exitcode) for p in procs if p.exitcode not in (None, 0)]
            if procs[0].exitcode is not None and results.empty():
                raise RuntimeError(f"the master exited with code {procs[0].exitcode} without a result; others: {dead}")
            continue
        if status == "error":
            raise RuntimeError(f"the master failed:\n{value}")
        data, lost, ended = value
        return torch.load(io.BytesIO(data), weights_only=False), set(lost), set(ended)
