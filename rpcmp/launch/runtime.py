"""Process roles and the RPC world: one place that starts and stops it.

Every process runs :func:`run_rank`: it imports the job, sets its thread count,
joins the TensorPipe RPC world as ``master`` (rank 0) or ``worker{rank}``, and then
either drives (rank 0 calls ``main(pipeline_factory)``) or serves stages until the
master shuts the world down (how it leaves the world: :mod:`rpcmp.launch.ending`).
:func:`rpcmp.launch.local.launch_local` starts N such processes on this machine.
"""
from __future__ import annotations

import math
import os
import signal
import socket
import sys
import threading
import warnings
from typing import Any, Callable

import torch
import torch.distributed.rpc as rpc

from ..errors import NetworkError, RunAbortedError
from ..core.health import Watchdog
from ..core.stall import Stalls
from ..job import Job, load_job
from ..core.store import launch_store
from ..core.pipes import check_refused, open_pipes
from .network import preflight
from ..plan.placement import device_maps_for, process_name
from ..plan.topology import Topology
from .env import LaunchEnv
from .groups import join_stage_groups, share_nodes
from ..core.served import serve
from .ending import leave_world, serve_until_told
from ..train.stop import forward_on_worker

__all__ = ["run_rank", "free_port", "reserve_ports", "default_threads", "usable_cpus"]



_MALLOPT = {  # what a user may export (or set in GLIBC_TUNABLES) instead: (that tunable, mallopt's parameter, value)
    "MALLOC_ARENA_MAX": ("glibc.malloc.arena_max", -8, 1),  # M_ARENA_MAX
    "MALLOC_MMAP_THRESHOLD_": ("glibc.malloc.mmap_threshold", -3, 32 << 20),  # M_MMAP_THRESHOLD: glibc's largest
    "MALLOC_TRIM_THRESHOLD_": ("glibc.malloc.trim_threshold", -1, 2**31 - 1),  # M_TRIM_THRESHOLD: never trim
}


def _malloc_settings() -> None:
    """One glibc malloc arena per process, unless ``MALLOC_ARENA_MAX`` says otherwise (this
    limits the arenas of the threads started from here on, in every kind of launch); and freed
    memory of up to 32 MiB kept for the next step, unless ``MALLOC_MMAP_THRESHOLD_`` or
    ``MALLOC_TRIM_THRESHOLD_`` say otherwise (or ``GLIBC_TUNABLES``' ``glibc.malloc.*`` of the same names).

    [Note: one malloc arena]
    A stage process allocates from many threads: RPC threads receive activations and
    gradients, the compute thread runs forwards, autograd threads run backwards and
    recomputations. glibc gives each thread its own arena and keeps every arena's peak,
    so a process's resident memory is the sum of the threads' high-water marks. One
    arena lets them reuse each other's freed memory, at the same step time. ``mallopt`` from
    here does as well as ``MALLOC_ARENA_MAX=1`` exported before the process started: the threads that allocate the activations all start after
    this call (figures: benchmarks/PERFORMANCE.md, design measurements).

    Every step allocates the same buffers again (activations, weight gradients: 4 MiB for a
    Linear(1024, 1024)) and frees them; glibc's default hands the top of the heap back to the
    kernel once more than twice its mmap threshold is free there, and the next step faults every
    page of it in again, zeroed (a MLP step of 8 micro-batches: 2,000-10,000 page faults per
    process, against a few hundred with what is kept). So blocks up to 32 MiB (glibc's largest
    threshold, which its default reaches on its own after the first such block is freed) come
    from the heap, and the heap is not trimmed: the process keeps its peak, which is what it
    needs again each step; larger blocks are mapped and unmapped as before.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc
        return
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    told = {name for name, (tunable, _, _) in _MALLOPT.items() if name in os.environ or f"{tunable}=" in tunables}
    if told & {"MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"}:  # either one set fixes the other where it is
        told |= {"MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"}  # (glibc stops moving it): both or neither
    for name, (_, param, value) in _MALLOPT.items():
        if name not in told:
            try:
                libc.mallopt(param, value)
            except AttributeError:  # not glibc
                return


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


def free_port(host: str = "127.0.0.1", count: int = 1) -> int:
    """A port free on ``host`` (with the ``count - 1`` after it), for a server that binds it later."""
    socks = reserve_ports(host, count)
    port = socks[0].getsockname()[1]
    for s in socks:
        s.close()
    return port


def reserve_ports(host: str = "127.0.0.1", count: int = 1) -> list[socket.socket]:
    """``count`` consecutive ports bound on ``host``, held until the caller passes them on.

    [Note: ports below the ephemeral range]
    The kernel gives every ``bind(port 0)`` (a TensorPipe listener, a Gloo pair) and every outgoing
    connection a port from its ephemeral range (``/proc/sys/net/ipv4/ip_local_port_range``). A port
    picked there and bound seconds later can meanwhile become another process's listener: the
    rendezvous then fails with "Address already in use", and ranks that join it as clients connect
    to that stranger (a TensorPipe listener hit so closed itself: its run failed with ECONNREFUSED).
    Ports are picked at random below that range (or above it), where the kernel never hands one out
    by itself, and held bound until the server takes them over.
    """
    import random
    try:
        low, high = map(int, open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[:2])
    except (OSError, ValueError):
        low, high = 32768, 60999
    # below the range (from half its start), else above it
    spans = [(a, b) for a, b in ((max(1024, low // 2), low - count), (high + 1, 65536 - count)) if a <= b]
    if not spans:  # the range is the whole port space: the kernel's pick, one port
        if count == 1:
            return _bound(host, 0, 1)
        raise OSError(f"no room outside the ephemeral range {low}-{high} for {count} consecutive ports")
    for _ in range(200):
        port = random.randint(*spans[0])
        try:
            return _bound(host, port, count)
        except OSError:  # taken
            continue
    raise OSError(f"no {count} free consecutive port(s) on {host} outside the ephemeral range {low}-{high}")


def _bound(host: str, port: int, count: int) -> list[socket.socket]:
    socks = []
    try:
        for i in range(count):
            s = socket.socket()  # no SO_REUSEADDR: nobody else binds it while held
            socks.append(s)
            s.bind((host, port + i))
    except OSError:
        for s in socks:
            s.close()
        raise
    return socks


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
        rpc_timeout=job.call_timeout,
        _transports=[job.transport],
        # "basic" moves tensor bytes over the transport itself; measured against "cma" and
        # "mpt_uv" on the 2-stage MLP it was as fast or faster, and it works across nodes.
        # Device maps need a CUDA channel as well: CUDA IPC on one node, else through host memory.
        _channels=["cuda_ipc", "cuda_basic", "basic"] if job.device_maps and torch.cuda.is_available() else ["basic"],
    )


def run_rank(job_path: str, rank: int, world_size: int, main: Callable[[Job, int], Any] | None = None,
             overrides: dict | None = None, local_procs: int | None = None) -> Any:
    """Run one process of a job and return ``main(job, world_size)``'s result on rank 0.

    Pipeline mode: rank 0 calls ``main``, the other ranks serve stages. DDP mode: every rank calls ``main``.
    ``MASTER_ADDR`` / ``MASTER_PORT`` must be set (torchrun and :func:`launch_local` do).
    """
    _quiet()
    _malloc_settings()
    job = load_job(job_path, overrides=overrides)
    env = LaunchEnv.read()
    preflight(rank, env.nodes)
    torch.set_num_threads(job.threads or default_threads(local_procs or env.local_world_size or world_size))
    attempt = _agree_on_attempt(world_size, env)
    served = serve(job, env.store_address)  # what this process serves, fresh for this run: [Note: one object per process]
    _remember_runs(served, attempt, env, rank)
    if job.mode == "ddp":
        return _run_ddp_rank(job, rank, world_size, main, env.local_rank)
    if rank != 0 and threading.current_thread() is threading.main_thread():  # Ctrl-C is the master's to act on:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # see [Note: stopping a run] in rpcmp/train/stop.py
        forward_on_worker(process_name(rank))  # and so is SIGTERM
    topology = _join_rpc(job, rank, world_size, served, attempt, env)
    result, error, watchdog = None, None, None
    try:
        if rank == 0:  # every pipe is open, or the run ends here: see rpcmp/core/pipes.py
            check_refused([process_name(r) for r in range(world_size)])
        if topology.replicated:
            join_stage_groups(topology, rank, job.hang_timeout, served, attempt)  # see [Note: replicas of a pipeline]
        if rank == 0 and main is not None:
            if world_size > 1 and job.hang_timeout:
                watchdog = Watchdog([process_name(r) for r in range(1, world_size)], job.hang_timeout, served.status,
                                    fence=bool(job.spares), gone=served.lost,
                                    stalls=Stalls(job.hang_timeout, job.stall_timeout))
                watchdog.start()
            result = main(job, world_size)
        elif rank != 0:
            serve_until_told(served, job.call_timeout)  # see [Note: a worker serves until the master's word] in .ending
    except BaseException as exc:  # shut the world down, then re-raise
        error = exc
    finally:
        if watchdog is not None:
            watchdog.stop()
        left = leave_world(served, rank, world_size, error)
    if error is not None:
        raise error
    # The master's word decides: a shutdown that fails after it said "ended normally" (the master
    # left first and took the rendezvous store with it) is no failure of the job.
    if rank != 0 and not served.outcome:
        raise RunAbortedError(f"{process_name(rank)}: the master " + ("ended with an error (its log says which)" if left
                              else "stopped answering before the job ended") + "; this rank exits 1")
    return result


def _join_rpc(job: Job, rank: int, world_size: int, served, attempt: int, env: LaunchEnv) -> Topology:
    """Join the run's RPC world (pipeline mode); return the run's topology."""
    _fresh_store_prefix(attempt)
    options = _backend_options(job, world_size)
    if Topology.needs_nodes(job):  # the grid follows the nodes: see [Note: replicas of a pipeline]
        served.nodes = share_nodes(rank, world_size, max(60.0, job.rpc_timeout or 0.0), attempt, env.node_rank)
    topology = served.topology = Topology.of(job, world_size, nodes=served.nodes)  # [Note: one topology per run]
    for peer, mapping in ((p, m) for places in topology.grid if job.device_maps
                          for p, m in device_maps_for(places, process_name(rank)).items()):
        options.set_device_map(peer, mapping)
        served.device_maps.setdefault(peer, {}).update(mapping)
    _init_rpc(process_name(rank), rank, world_size, options)
    open_pipes([process_name(r) for r in range(world_size)])  # see rpcmp/core/pipes.py
    return topology


def _init_rpc(name: str, rank: int, world_size: int, options) -> None:
    """``rpc.init_rpc``; a connection refused while the world forms is said as what it is (see rpcmp/core/pipes.py),
    not as torch's "timed out in _all_gather after 1800 seconds", which it reports at once."""
    try:
        rpc.init_rpc(name, rank=rank, world_size=world_size, rpc_backend_options=options)
    except RuntimeError as exc:
        if "ECONNREFUSED" not in str(exc):
            raise
        raise NetworkError(
            f"the run's processes could not all connect as it started ({name}: {str(exc).splitlines()[0][:300]}): a "
            f"process refused a connection, because it died while the run started, or because something reached its "
            f"RPC port and left (a port scan, a health probe: TensorPipe then stops listening for good). Nothing was "
            f"built or trained: run it again; if this recurs, keep scanners and probes off the run's ports") from None


def _run_ddp_rank(job: Job, rank: int, world_size: int, main, local_rank: int | None) -> Any:
    """DDP mode: no RPC; every rank runs ``main`` (the trainer) in one process group."""
    from ..train.ddp import join, leave
    join(rank, world_size, job.hang_timeout, job.call_timeout, rank if local_rank is None else local_rank)
    try:
        result = main(job, world_size) if main is not None else None
    finally:
        leave()
    return result if rank == 0 else None


def _agree_on_attempt(world_size: int, env: LaunchEnv) -> int:
    """[Note: one attempt number for every node]
    Under torchrun, ``TORCHELASTIC_RESTART_COUNT`` numbers the store keys of each attempt
    (``env://`` rendezvous: ``/worker/attempt_{n}``; rpcmp's RPC prefix below). But it is
    per node: the node whose rank failed counts a restart, a node that restarts because the
    membership changed does not. After rank 0 was killed, node 0 joined attempt 1 while the
    others read attempt 0's keys, with the dead master's address in them, and failed with
    "connection refused". The agent store outlives every attempt, so each process counts
    itself in there once at start: the n-th process to arrive belongs to attempt
    (n - 1) // world_size, the same number on every node (for a fixed world size). The number is
    returned, and handed to everything of rpcmp that namespaces keys by attempt; it is also
    written back to ``TORCHELASTIC_RESTART_COUNT`` for torch's own ``env://`` rendezvous (DDP mode).
    """
    if not env.under_torchrun:
        return env.restart  # launch_local and daemons: a fresh store per run
    attempt = (launch_store(60, env.store_address).add("rpcmp/arrived", 1) - 1) // world_size
    os.environ["TORCHELASTIC_RESTART_COUNT"] = str(attempt)
    return attempt


def _remember_runs(served, attempt: int, env: LaunchEnv, rank: int) -> None:
    """[Note: a restart resumes by itself]
    Under ``torchrun --max-restarts``, every process of a failed attempt is started again. The
    attempt that follows continues the run the one before trained, without ``--resume`` on the
    command line: the master of each attempt writes its run id into torchrun's agent store, which
    outlives the attempts (key ``rpcmp/run``), and an attempt after the first reads it back, so the
    trainer resumes from that run's latest complete checkpoint (not another run's that happens to be
    newer in a reused folder), or starts that run again from step 0 when none was written. Local runs
    and worker daemons have no agent to restart them: nothing is read or written there."""
    served.attempt = attempt
    if not env.under_torchrun:
        return
    store = launch_store(60)
    if attempt and store.check(["rpcmp/run"]):
        served.previous_run = store.get("rpcmp/run").decode()
    if rank == 0:
        served.keep_run = lambda run: store.set("rpcmp/run", run)


def _fresh_store_prefix(attempt: int) -> None:
    """[Note: RPC after a torchrun restart]
    init_rpc namespaces its store keys as ``rpc_prefix_{n}`` with n counting calls in this
    process, so every fresh process uses ``rpc_prefix_0``. torchrun's agent store outlives
    a restart (``--max-restarts``), so the restarted ranks read the dead ranks' addresses
    and gloo fails with "connection refused". Starting the count at the restart number
    gives each attempt keys of its own.
    """
    if attempt and hasattr(rpc, "_init_counter"):
        with rpc._init_counter_lock:
            rpc._init_counter = max(rpc._init_counter, attempt * 1000)
