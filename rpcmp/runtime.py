"""Process roles and the RPC world: one place that starts and stops it.

Every process runs :func:`run_rank`: it imports the job, sets its thread count,
joins the TensorPipe RPC world as ``master`` (rank 0) or ``worker{rank}``, and then
either drives (rank 0 calls ``main(pipeline_factory)``) or serves stages until the
master shuts the world down. :func:`launch_local` starts N such processes on this
machine, bound to loopback only, with a free port chosen by the parent.
"""
from __future__ import annotations

import io
import math
import multiprocessing as mp
import os
import socket
import sys
import threading
import time
import traceback
import warnings
from typing import Any, Callable

import torch
import torch.distributed.rpc as rpc

from . import stage as _stage
from .errors import LaunchError, RunAbortedError, StageError
from .health import Watchdog, WorkerLostError
from .job import Job, load_job
from .network import bound_store, preflight
from .partition import Split
from .placement import device_maps_for, process_name, resolve_placement

__all__ = ["run_rank", "launch_local", "free_port", "default_threads", "usable_cpus"]

_SHUTDOWN_TIMEOUT = 30.0


def _one_malloc_arena() -> None:
    """One glibc malloc arena per process, unless ``MALLOC_ARENA_MAX`` says otherwise
    (:func:`launch_local` sets it for its children; under torchrun this limits the arenas
    of threads started from here on).

    [Note: one malloc arena]
    A stage process allocates from many threads: RPC threads receive activations and
    gradients, the compute thread runs forwards, autograd threads run backwards and
    recomputations. glibc gives each thread its own arena and keeps every arena's peak,
    so a process's resident memory is the sum of the threads' high-water marks. One
    arena lets them reuse each other's freed memory: on the split Unet (batch 16 of
    256x256, M = 4, recompute) the largest stage process peaked at 1530-1560 MiB instead
    of 1863 MiB, at the same step time (1.62 vs 1.58 s, within this machine's noise).
    Under torchrun, where only ``mallopt`` from here can set it, the same run peaked at
    1535 MiB, and at 1648 MiB with ``MALLOC_ARENA_MAX=1`` exported before torchrun: the
    threads that allocate the activations all start after this call.
    """
    if "MALLOC_ARENA_MAX" in os.environ or not sys.platform.startswith("linux"):
        return
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").mallopt(-8, 1)  # M_ARENA_MAX
    except (OSError, AttributeError):  # not glibc
        pass


def default_threads(local_procs: int) -> int:
    """Intra-op threads per process: the cores this process may use, shared by the node's processes."""
    return max(1, usable_cpus() // max(1, local_procs))


def usable_cpus(cgroup_root: str = "/sys/fs/cgroup") -> int:
    """The cores this process may run on: its CPU affinity (SLURM's ``--cpus-per-task``, taskset),
    capped by a cgroup CPU quota (containers, Kubernetes limits), not the machine's core count."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = _cgroup_quota(cgroup_root)
    return max(1, min(cpus, math.ceil(quota))) if quota else max(1, cpus)


def _cgroup_quota(root: str) -> float | None:
    """The CPU quota of this process's cgroup, in cores (v2 ``cpu.max``, v1 ``cpu.cfs_quota_us``), or None."""
    try:
        own = [line.split(":", 2) for line in open("/proc/self/cgroup").read().splitlines()]
    except OSError:
        own = []
    v2 = next((path for hid, _, path in own if hid == "0"), "/")
    v1 = next((path for _, ctrl, path in own if "cpu" in ctrl.split(",")), "/")
    for folder in (os.path.join(root, v2.lstrip("/")), root):
        try:
            quota, period = open(os.path.join(folder, "cpu.max")).read().split()
            return None if quota == "max" else int(quota) / int(period)
        except (OSError, ValueError):
            pass
    for folder in (os.path.join(root, "cpu", v1.lstrip("/")), os.path.join(root, "cpu")):
        try:
            quota = int(open(os.path.join(folder, "cpu.cfs_quota_us")).read())
            period = int(open(os.path.join(folder, "cpu.cfs_period_us")).read())
            return None if quota <= 0 else quota / period
        except (OSError, ValueError):
            pass
    return None


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _quiet() -> None:
    # DistributedOptimizer's functional optimizers warn on every construction with a forced
    # "always" filter (torch/distributed/optim/_deprecation_warning.py); drop just that line.
    show = warnings.showwarning
    if getattr(show, "_rpcmp", False):
        return

    def showwarning(message, category, filename, lineno, file=None, line=None):
        if "support for functional optimizers is deprecated" not in str(message):
            show(message, category, filename, lineno, file, line)

    showwarning._rpcmp = True
    warnings.showwarning = showwarning
    warnings.filterwarnings("ignore", message=".*as a ProcessGroup.*")
    warnings.filterwarnings("ignore", message=".*Creating the optimizer.*")


def _backend_options(job: Job, world_size: int) -> rpc.TensorPipeRpcBackendOptions:
    # Threads: each in-flight micro-batch may hold one RPC thread per stage while it waits its turn.
    threads = max(16, 4 * job.microbatches + 8)
    return rpc.TensorPipeRpcBackendOptions(
        num_worker_threads=threads,
        rpc_timeout=job.rpc_timeout,
        _transports=[job.transport],
        # "basic" moves tensor bytes over the transport itself; measured against "cma" and
        # "mpt_uv" on the 2-stage MLP it was as fast or faster, and it works across nodes.
        _channels=["basic"],
    )


def run_rank(job_path: str, rank: int, world_size: int, main: Callable[[Job, int], Any] | None = None,
             overrides: dict | None = None, local_procs: int | None = None) -> Any:
    """Run one process of a job and return ``main(job, world_size)``'s result on rank 0.

    Pipeline mode: rank 0 calls ``main``, the other ranks serve stages. DDP mode: every
    rank calls ``main``.

    ``MASTER_ADDR`` / ``MASTER_PORT`` must be set (torchrun and :func:`launch_local` do).
    """
    _quiet()
    _one_malloc_arena()
    job = load_job(job_path, overrides=overrides)
    preflight(rank, int(os.environ.get("GROUP_WORLD_SIZE", "1")))
    local = local_procs or int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    torch.set_num_threads(job.threads or default_threads(local))
    if job.mode == "ddp":
        return _run_ddp_rank(job, rank, world_size, main)
    _stage.set_job(job)
    _fresh_store_prefix()
    options = _backend_options(job, world_size)
    if job.device_maps:
        count = job.stages.count if isinstance(job.stages, Split) else len(job.stages)
        places = resolve_placement(job.placement, count, world_size)
        for peer, mapping in device_maps_for(places, process_name(rank)).items():
            options.set_device_map(peer, mapping)
    _OUTCOME["ok"] = None
    rpc.init_rpc(process_name(rank), rank=rank, world_size=world_size, rpc_backend_options=options)
    result, error, watchdog = None, None, None
    try:
        if rank == 0 and main is not None:
            if world_size > 1 and job.hang_timeout:
                watchdog = Watchdog([process_name(r) for r in range(1, world_size)], job.hang_timeout)
                watchdog.start()
            result = main(job, world_size)
    except BaseException as exc:  # shut the world down, then re-raise
        error = exc
    finally:
        if watchdog is not None:
            watchdog.stop()
        if rank == 0:
            _tell_outcome([process_name(r) for r in range(1, world_size)], error is None)
        # A stage's own failure leaves every process answering: leave as after success (no transport noise).
        left = _shutdown(graceful=error is None or (isinstance(error, StageError) and not isinstance(error, WorkerLostError)))
    if error is not None:
        raise error
    if rank != 0 and not (left and _OUTCOME["ok"]):
        raise RunAbortedError(f"{process_name(rank)}: the master " + ("ended with an error (its log says which)" if left
                              else "stopped answering before the job ended") + "; this rank exits 1")
    return result


# [Note: every rank says how the job ended]
# A worker serves until the master shuts the world down; that shutdown succeeds after a
# master's failure too (a stage error) or fails (the master died). Either way the worker
# used to exit 0, and torchrun took its node for finished: under --max-restarts the
# restarted master then waited for nodes that had gone home. The master now tells every
# worker whether the run ended normally; a worker that was not told so exits 1.
_OUTCOME: dict = {"ok": None}  # set on a worker by the master, through _outcome


def _outcome(ok: bool) -> None:
    _OUTCOME["ok"] = ok


def _tell_outcome(workers: list[str], ok: bool) -> None:
    futs = []
    for w in workers:
        try:
            futs.append(rpc.rpc_async(w, _outcome, args=(ok,), timeout=5))
        except Exception:  # noqa: BLE001 - a worker that is gone cannot be told
            pass
    for fut in futs:
        try:
            fut.wait()
        except Exception:  # noqa: BLE001 - it then exits 1, as it should
            pass


def _run_ddp_rank(job: Job, rank: int, world_size: int, main) -> Any:
    """DDP mode: no RPC; every rank runs ``main`` (the trainer) in one process group."""
    from .ddp import join, leave
    join(rank, world_size, job.hang_timeout)
    try:
        result = main(job, world_size) if main is not None else None
    finally:
        leave()
    return result if rank == 0 else None


def _fresh_store_prefix() -> None:
    """[Note: RPC after a torchrun restart]
    init_rpc namespaces its store keys as ``rpc_prefix_{n}`` with n counting calls in this
    process, so every fresh process uses ``rpc_prefix_0``. torchrun's agent store outlives
    a restart (``--max-restarts``), so the restarted ranks read the dead ranks' addresses
    and gloo fails with "connection refused". Starting the count at the restart number
    gives each attempt keys of its own.
    """
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if attempt and hasattr(rpc, "_init_counter"):
        with rpc._init_counter_lock:
            rpc._init_counter = max(rpc._init_counter, attempt * 1000)


def _shutdown(graceful: bool) -> bool:
    """Leave the RPC world; return whether every peer took part."""
    try:
        rpc.shutdown(graceful=graceful, timeout=_SHUTDOWN_TIMEOUT) if graceful else rpc.shutdown(graceful=False)
        return True
    except Exception as exc:  # noqa: BLE001 - a peer already gone must not hang or mask the real error
        print(f"rpcmp: RPC shutdown: {exc}", file=sys.stderr)
        return False


def _watch_parent(parent: int) -> None:
    """A local worker exits if its launcher dies, so nothing is left behind."""
    def loop():
        while True:
            if os.getppid() != parent:
                os._exit(3)
            time.sleep(0.5)
    threading.Thread(target=loop, daemon=True, name="rpcmp-parent-watch").start()


# A local run talks on loopback only, whatever RPCMP_IFACE / --iface say (they are for multi-node runs).
_LOCAL_ENV = {"RPCMP_IFACE": "lo", "TP_SOCKET_IFNAME": "lo", "GLOO_SOCKET_IFNAME": "lo", "TORCHELASTIC_USE_AGENT_STORE": "True"}


def _local_child(job_path, rank, world_size, port, overrides, main, results, parent, started):
    _watch_parent(parent)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **_LOCAL_ENV)
    try:
        try:
            load_job(job_path, overrides=overrides)  # fails here, not in the RPC rendezvous: see _wait_started
        except Exception as exc:  # noqa: BLE001 - reported by the parent, once
            started.put((rank, f"{type(exc).__name__}: {exc}"))
            sys.exit(1)
        started.put((rank, None))
        try:
            out = run_rank(job_path, rank, world_size, main, overrides, local_procs=world_size)
        except RunAbortedError:
            sys.exit(1)  # the master's own error is what the parent reports
        if results is not None:
            buf = io.BytesIO()
            torch.save(out, buf)  # bytes, not shared-memory handles that die with this process
            results.put(("ok", buf.getvalue()))
    except BaseException as exc:
        if results is not None:
            results.put(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        raise


def launch_local(job_path: str, nprocs: int, main: Callable[[Job, int], Any], overrides: dict | None = None,
                 timeout: float | None = None, master_in_process: bool = True) -> Any:
    """Run a job on ``nprocs`` processes of this machine; return ``main``'s result.

    The master runs in this process by default (so progress shows in this terminal);
    with ``master_in_process=False`` it runs in a child too and its result comes back
    through a queue (tests use this so every test gets fresh processes).
    """
    ctx = mp.get_context("spawn")
    master_in_process = master_in_process and not _rpc_used_here()  # see [Note: one RPC world per process]
    started = ctx.Queue()
    port = free_port()
    # The rendezvous store listens on loopback only; every rank joins it as a client.
    store = bound_store("127.0.0.1", port)  # noqa: F841 - lives as long as the run
    results = None if master_in_process else ctx.Queue()
    first = 1 if master_in_process else 0
    procs = []
    user_arenas = os.environ.get("MALLOC_ARENA_MAX")
    os.environ["MALLOC_ARENA_MAX"] = user_arenas or "1"  # glibc reads it as each child starts: [Note: one malloc arena]
    try:
        for rank in range(first, nprocs):
            p = ctx.Process(target=_local_child, name=process_name(rank),
                            args=(job_path, rank, nprocs, port, overrides, main,
                                  results if rank == 0 else None, os.getpid(), started))
            p.start()
            procs.append(p)
    finally:
        if user_arenas is None:
            del os.environ["MALLOC_ARENA_MAX"]
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        _wait_started(started, procs, deadline)
        if master_in_process:
            saved = {k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT", *_LOCAL_ENV)}
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **_LOCAL_ENV)
            watch = _Deadline(deadline, procs)
            try:
                result = run_rank(job_path, 0, nprocs, main, overrides, local_procs=nprocs)
            finally:
                watch.cancel()
                for k, v in saved.items():
                    os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
            if watch.fired:
                raise TimeoutError(f"the run outlived timeout={timeout}s: its processes were killed")
        else:
            result = _wait_result(results, procs, deadline)
        for p in procs:
            p.join(None if deadline is None else max(1.0, deadline - time.monotonic()))
        bad = [(p.name, p.exitcode) for p in procs if p.exitcode not in (0, None)]
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


def _wait_started(started, procs, deadline) -> None:
    """Wait until every child has imported the job; raise at once, naming the rank and its
    error, if one dies first (instead of the others waiting out the RPC rendezvous)."""
    import queue
    waiting = {int(p.name.removeprefix("worker")) if p.name != "master" else 0: p for p in procs}
    while waiting:
        try:
            rank, error = started.get(timeout=0.2)
        except queue.Empty:
            dead = [(r, p.exitcode) for r, p in waiting.items() if p.exitcode is not None]
            if dead and started.empty():  # (a child that said why before exiting is reported by what it said)
                rank, code = dead[0]
                raise LaunchError(f"{process_name(rank)} (rank {rank}) exited with code {code} while starting, "
                                  f"before joining the job") from None
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"{[process_name(r) for r in waiting]} did not start in time") from None
            continue
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
        return torch.load(io.BytesIO(value), weights_only=False)
