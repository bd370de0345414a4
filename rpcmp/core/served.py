"""What one process serves in a run, as one object: :class:`Served`, made by :mod:`rpcmp.launch.runtime`.

[Note: one object per process]
RPC calls a plain function by its module and name on the receiving process, so an
endpoint (``rpcmp.owner.stage.forward``, ``rpcmp.master.inbox.deliver``) must find what it acts on
from nothing but its arguments. That is the one place a process-wide reference is
needed: :func:`current` returns the :class:`Served` object that :func:`serve` made when
the process joined the run, and everything mutable lives on it (the stages this process
hosts, the master's inbox, the outcome the master sent, a DDP rank's device and
heartbeats, the pipeline counter) and on its :class:`RunStatus`. Nothing else in rpcmp
keeps state in a module, so a second run in one process starts from a fresh object (the
old one cannot leak stages or awaited outputs into it) and a unit test builds a
``Served`` of its own. What the run is doing (:class:`RunStatus`: step, last checkpoint,
stages, task) is handed to failure handling explicitly (:mod:`rpcmp.core.health`).
"""
from __future__ import annotations

import itertools
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed.rpc as rpc

__all__ = ["RunStatus", "Awaited", "Served", "serve", "current"]


@dataclass
class RunStatus:
    """What the run is doing, for the messages that name a lost worker (set by the pipeline,
    the trainer and prediction; ``task``: what the run does if it is not training)."""

    step: int = 0
    checkpoint: str | None = None
    checkpoint_dir: str | None = None  # where the run saves (Job.checkpoint_dir), for a run that has saved nothing yet
    stages: dict[str, list[str]] = field(default_factory=dict)  # process -> what it holds
    task: str | None = None
    in_step: bool = False  # the master is in a training step (see [Note: a stalled step] in rpcmp/core/stall.py)

    def stepping(self, step: Callable[..., Any], *args) -> Any:
        """``step(*args)``, a training step, with ``in_step`` set while it runs."""
        self.in_step = True
        try:
            return step(*args)
        finally:
            self.in_step = False

    def describe(self, lost: list[str], how: str) -> str:
        """One sentence naming the ``lost`` processes, what they held, when, and what to do."""
        who = ", ".join(f"{p} ({', '.join(self.stages.get(p, ['no stage']))})" for p in lost)
        return self.say(f"{who} {how}. Look at that process's log or node (killed? out of memory? network?)")

    def say(self, what: str) -> str:
        """``what`` happened: with the task, or the step and the checkpoint to resume from."""
        if self.task:
            return f"{self.task}: {what}"
        ckpt = (f"The last checkpoint is {self.checkpoint}: rerun with --resume to continue from it"
                if self.checkpoint else f"No checkpoint was written in {self.checkpoint_dir} yet"
                if self.checkpoint_dir else "No checkpoint was written yet (--checkpoint-dir DIR to keep progress)")
        when = f"at step {self.step}" if self.step else "before the first step"
        return f"{when}: {what}. {ckpt}"


class Awaited:
    """Futures by key, each settled once, from whichever thread brings its value."""

    def __init__(self):
        self._futures: dict[Any, torch.futures.Future] = {}
        self._lock = threading.Lock()

    def expect(self, key) -> torch.futures.Future:
        out = torch.futures.Future()
        with self._lock:
            self._futures[key] = out
        return out

    def settle(self, key, value: Any) -> bool:
        """Complete ``key``'s future with ``value`` (an exception fails it); False if none waits."""
        with self._lock:
            out = self._futures.pop(key, None)
        if out is None:  # settled already (a later error in the answers back) or dropped
            return False
        if isinstance(value, Exception):
            out.set_exception(value)
        else:
            out.set_result(value)
        return True

    def drop(self, keys) -> None:
        """Stop waiting for ``keys``: their values, if they come, are thrown away."""
        with self._lock:
            for key in keys:
                self._futures.pop(key, None)

    def fail(self, pids: set[int], error: Exception) -> None:
        """Fail every future still waited for of pipelines ``pids`` (keys ``(pid, seq)``): an owner of theirs
        was lost (see [Note: a death seen at once] in .health)."""
        with self._lock:
            waiting = [self._futures.pop(k) for k in [k for k in self._futures if k[0] in pids]]
        for out in waiting:
            out.set_exception(error)

    def __len__(self) -> int:
        return len(self._futures)


class Served:
    """Everything one process of a run holds across calls (see [Note: one object per process])."""

    def __init__(self, job=None):
        self.job = job  # the job this process imported (an owner builds its stages from it)
        self.hosts: dict[tuple[int, int], Any] = {}  # (pipeline id, stage index) -> rpcmp.owner.stage.StageHost
        self.build_lock = threading.Lock()  # the global RNG is per process: one stage build at a time
        self.inbox = Awaited()  # the master's: outputs of the last stage by (pipeline id, seq); see rpcmp.master.inbox
        self.status = RunStatus()
        self.outcome: bool | None = None  # on a worker: whether the master said the run ended normally
        self.graceful = True  # on a worker: whether the master said every process takes part in the shutdown
        self.told = threading.Event()  # on a worker: set when the master has said how the run ended
        self.leave_by = None  # on a worker told the end: set it once left, or the process leaves by itself (.runtime)
        self.device = None  # DDP mode: this rank's device
        self.heartbeats = None  # DDP mode: this rank's rpcmp.core.health.Heartbeats
        self.stop = None  # on the master while it trains: its rpcmp.train.stop.StopRequest (a worker's SIGTERM reaches it)
        self.stage_groups: dict | None = None  # Job(replicas=R): stage index -> process group of its copies
        self.nodes: list[str] | None = None  # Job(replicas=R): every rank's node, for the grid
        self.topology = None  # the run's rpcmp.plan.topology.Topology, computed once at start
        self.device_maps: dict[str, dict[str, str]] = {}  # Job(device_maps=True): the maps this process joined RPC with
        self.store_address: tuple[str, int] | None = None  # the launch's store (rpcmp.core.store), from the launcher
        self.refused: list[str] = []  # the processes that refused this one's pipes as the world formed (.pipes)
        self.pipes_open = threading.Event()  # set once this process has opened its pipes (rpcmp/core/pipes.py)
        # Under torchrun: this attempt's number, the run an earlier attempt trained (None: none did) and how
        # to tell a later attempt which run this one trains (see [Note: a restart resumes by itself]).
        self.attempt = 0
        # Job(snapshot_every=N): this owner's own snapshots ((pid, stage) -> {step: data}), the neighbours' it keeps
        # (the same, the latest last), the step of one a recovery is reading ((pid, stage) -> step) and its
        # shipment on the way, per pipeline (rpcmp/owner/snapshot.py)
        self.snapshots: dict = {}
        self.buddy_snapshots: dict = {}
        self.buddy_pins: dict = {}
        self.shipping: dict = {}
        self.marks: dict = {}  # Job(replicas=R, spares=K): pid -> the buffers and generators of its step's start (rpcmp/owner/live.py)
        # on the master: processes that left the run early, lost and replaced in place (rpcmp/master/recovery.py)
        # or drained (rpcmp/launch/drain.py); and, in a daemon job, the drain requests to look at between steps
        self.lost: set[str] = set()
        self.buried: list = []  # on the master: handles of things on lost processes, never let go (see keep_lost)
        # this process's local optimizer of each pipeline (see [Note: no handle of a third process] in rpcmp/owner/state.py)
        self.optimizers: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self.step_gates: dict = {}  # pid -> its steps taken in the backward here, cancelled by a rollback (owner/stepping.py)
        self.ended: set[str] = set()  # on the master: the workers that heard the run end normally (see [Note: an end told])
        self.watches: list = []  # on a worker: the master's watch calls, pending (see [Note: a death seen at once])
        self.watching: dict[str, set[int]] = {}  # on the master: the processes it watches, and for which pipelines
        self.control = None
        self.previous_run: str | None = None
        self.keep_run = None
        self._pipeline_ids = itertools.count()
        self._workers: dict[str, Any] = {}
        self._me: str | None = None

    def keep_lost(self, handles) -> None:
        """Hold on to the RRefs in ``handles`` whose owner the run lost. [Note: handles on a lost process]: an
        RRef whose last reference goes tells its owner, and to a lost owner that message fails and is sent again
        (half a second to seconds apart, each failure a TensorPipe warning): a recovered run logged tens of them
        for seconds after the recovery. Kept, they are never sent; the handles go with the process."""
        self.buried += [h for h in handles if h.owner().name in self.lost]

    def next_pipeline_id(self) -> int:
        return next(self._pipeline_ids)

    @property
    def me(self) -> str:
        """This process's name in the RPC world, looked up once per run."""
        if self._me is None:
            self._me = rpc.get_worker_info().name
        return self._me

    def worker(self, name: str):
        """Process ``name``'s RPC ``WorkerInfo``, looked up once per run (``rpc_async`` given a name looks it up
        on every call: about 30 us, on each hop of each micro-batch)."""
        info = self._workers.get(name)
        if info is None:
            info = self._workers[name] = rpc.get_worker_info(name)
        return info

    def host(self, pid: int, index: int):
        """The stage ``index`` of pipeline ``pid`` that this process hosts."""
        return self.hosts[(pid, index)]

    def hosts_of(self, pid: int) -> list:
        """Pipeline ``pid``'s stages served here, in stage order."""
        return sorted((h for (p, _), h in self.hosts.items() if p == pid), key=lambda h: h.spec.index)


_CURRENT: list[Served] = []  # the one process-wide slot: see [Note: one object per process]


def serve(job=None, store_address: tuple[str, int] | None = None) -> Served:
    """Start serving a run in this process: a fresh :class:`Served` replaces any earlier one."""
    served = Served(job)
    served.store_address = store_address
    _CURRENT[:] = [served]
    return served


def current() -> Served:
    """The :class:`Served` of the run this process is part of (one is made on first use outside a
    run, so that library code driven by hand, a notebook's Pipeline, still finds one)."""
    if not _CURRENT:
        serve()
    return _CURRENT[0]
