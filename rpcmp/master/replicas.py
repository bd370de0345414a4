"""Pipeline x data parallel: ``Job(replicas=R)`` trains R copies of the S-stage pipeline on R x S
processes, each copy on its own share of every batch.

[Note: replicas of a pipeline]
The master drives every copy: it splits each global batch as ``DistributedSampler`` would
(replica r takes samples r, r + R, r + 2R, ... of the batch, which is exactly what R
samplers over the same shuffled order hand out), and runs the R pipelines' steps at once,
one thread each. Each owner averages its gradients with the copies of its stage (one
``all_reduce`` over one flat buffer per stage and step, in a process group per stage:
gloo on the CPU, NCCL for CUDA stages), and every copy then takes the same optimizer
step, so the copies stay identical. The policy decisions use the average too: the loss
that is checked for NaN is the mean over the copies (the copies meet at
:class:`ReplicaSync` when their backward is done), and clipping and fp16 loss scaling see
the averaged gradients, so every copy decides alike. A copy that fails aborts that meeting,
and its stages still take part in the step's ``all_reduce`` (with zeros), so nobody is
left inside a collective.
Each copy's loss is the mean over its own share, so the averaged gradient is the
gradient of the mean over the global batch, as with one copy (the float sums differ in
order, so equal at float32 tolerance, not bit-equal). BatchNorm sees each copy's share,
as in DDP mode without SyncBatchNorm, and every copy takes copy 0's running statistics after
each step, as DDP takes rank 0's ([Note: one copy's statistics] in :mod:`rpcmp.owner.reduce`).
One master drives every copy (rather than a master per copy) so that there is one data order,
one checkpoint writer and one place that names a lost process; its cost is a thread per copy on
the master.

Each stage's average starts on its owner as soon as the step's last micro-batch has left
the stage in the backward, while the stages before it still compute (one ``all_reduce``
per stage and step, asynchronous): see [Note: the average overlaps the backward] in
:mod:`rpcmp.owner.reduce`, which also says how a parameter used by some copies only is refused
alike by all and how a failed step keeps the collectives paired.

The grid is the run's :class:`~rpcmp.plan.topology.Topology` (see [Note: one topology per
run]); the ranks learn each other's nodes through the launch's store before RPC starts
(:func:`rpcmp.launch.groups.share_nodes`), and the stage groups are built there too.
"""
from __future__ import annotations

import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed.rpc as rpc
import torch.utils._pytree as pytree

from ..core import health
from ..core.futures import wait_all
from ..core.microbatch import batch_size
from ..core.served import current
from ..errors import JobError, WorkerLostError
from ..owner import live
from ..plan.placement import Place
from ..plan.topology import Topology
from . import move, recut
from .sync import ReplicaReduce

__all__ = ["ReplicaSync", "Replicated", "pipeline_for", "shard", "unshard"]


def pipeline_for(job, world_size: int, status=None):
    """What the master drives for ``job``: a :class:`~rpcmp.Pipeline`, or R copies of one as a :class:`Replicated`."""
    from .pipeline import Pipeline
    topology = Topology.for_run(job, world_size)
    spares = list(topology.spares)  # one takes an owner lost in the build: see rpcmp/master/building.py
    if topology.replicated:
        return Replicated(job, world_size, Pipeline, status=status, spares=spares)
    return Pipeline(job, world_size, status=status, spares=spares)


class ReplicaSync:
    """Where the copies of a step meet before their gradients are averaged: every copy brings its
    loss and leaves with the mean over the copies. A copy that failed earlier calls :meth:`abort`,
    and the others leave with ``threading.BrokenBarrierError`` instead of waiting."""

    def __init__(self, copies: int, timeout: float | None = None):
        self.copies, self._losses = copies, [None] * copies
        self._barrier, self.timeout = threading.Barrier(copies, timeout=timeout), timeout or 0.0
        self.mean: torch.Tensor | None = None  # of the last meeting: the step's loss

    def meet(self, index: int, loss: torch.Tensor) -> torch.Tensor:
        self._losses[index] = loss.detach()
        self._barrier.wait()
        mean = self.mean = torch.stack(self._losses).mean(0)
        self._barrier.wait()  # nobody overwrites a loss of this step before everyone has read them
        return mean

    def abort(self) -> None:
        self._barrier.abort()

    def reset(self) -> None:
        self._barrier.reset()


def shard(x: Any, index: int, copies: int) -> Any:
    """Replica ``index``'s share of batch ``x``: samples index, index + copies, ... (DistributedSampler's)."""
    return pytree.tree_map(lambda t: t[index::copies] if isinstance(t, torch.Tensor) else t, x)


def unshard(parts: list[Any]) -> Any:
    """The inverse of :func:`shard`: the parts' samples back in the batch's order."""
    def weave(*ts):
        if not isinstance(ts[0], torch.Tensor) or ts[0].dim() == 0:
            return ts[0]
        out = ts[0].new_empty((sum(t.shape[0] for t in ts), *ts[0].shape[1:]))
        for i, t in enumerate(ts):
            out[i::len(ts)] = t
        return out
    return pytree.tree_map(weave, *parts)


_REGROUPED = False  # this master has given stages' copies groups of their own (a move, a lost copy's rebuild)


def _first(name: str) -> property:
    return property(lambda self: getattr(self.pipes[0], name), doc=f"The first copy's ``{name}`` (every copy holds the same).")


class Replicated:
    """R :class:`~rpcmp.Pipeline` copies that train as one (see [Note: replicas of a pipeline]);
    what the trainer asks of a pipeline, it asks of this."""

    def __init__(self, job, world_size: int, pipeline_cls, status=None, sample: Any = None, spares: list[str] | None = None):
        self.job, self.copies = job, job.replicas
        grid = Topology.for_run(job, world_size).grid
        self.meeting = ReplicaSync(self.copies, timeout=max(job.call_timeout, job.hang_timeout or 0) * 4)
        self._threads = ThreadPoolExecutor(self.copies, thread_name_prefix="rpcmp-replica")
        # One plan for every copy: the same cut points (Split(by="time") profiles once), and tracing
        # (torch.export) is not something two threads can do at once. The copies then build at once:
        # their stages are on different processes.
        specs = pipeline_cls.plan(job, sample)
        self.pipes = [f.result() for f in [self._threads.submit(pipeline_cls, job, world_size, places=grid[i],
                                                                sync=ReplicaReduce(i, self.meeting), status=status,
                                                                specs=specs, spares=spares)
                                           for i in range(self.copies)]]
        self.status = self.pipes[0].status
        self.label_stages()
        self.taken: list[int] = []
        # a spare that took a lost owner's stages in the build is in none of the launch's groups
        moved = sorted({k for p, row in zip(self.pipes, grid) for k, (a, b) in enumerate(zip(p.places, row)) if a != b})
        if _REGROUPED or moved:  # the launch's groups no longer pair this grid's processes: pair them again
            self.regroup(list(range(len(specs))) if _REGROUPED else moved)

    def move_stage(self, index: int, target: str, replica: int = 0) -> float:
        """Move stage ``index`` of copy ``replica`` to process ``target`` between two steps (as
        :func:`rpcmp.master.move.move_stage` does for one pipeline), and give the stage's copies a new
        process group to average in; the seconds it took."""
        if not 0 <= replica < self.copies:
            raise JobError(f"move_stage: the pipeline has replicas 0..{self.copies - 1}, not {replica}")
        process = str(target).partition("/")[0]
        others = [i for i, p in enumerate(self.pipes) if i != replica and process in p.owners]
        if others:
            raise JobError(f"move_stage: {process} holds stages of replica {others[0]}; a process holds the stages of "
                           f"one copy (each averages with its copies in a group of its own): move to a spare")
        start = time.perf_counter()
        if move.move_stage(self.pipes[replica], index, target, copy_of=True) == 0.0:
            return 0.0
        self.regroup([index])
        self.label_stages()
        return time.perf_counter() - start

    def recut(self, cut) -> float:
        """Re-cut every copy alike between two steps (:func:`rpcmp.master.recut.recut`); the seconds it took.
        A re-cut moves layers, not stages: the copies of stage k stay on their processes and average in the
        group they had. One copy after the other: the master traces a ``SplitAt``'s new cut once."""
        start, specs, done = time.perf_counter(), self.pipes[0].specs, []
        was = specs[0].cut if specs[0].kind == "traced" else [s.stop - s.start for s in specs]
        for p in self.pipes:
            try:
                done.append(recut.recut(p, cut, copy_of=True))
            except Exception:  # this copy is as it was cut (an owner lost meanwhile): so are the ones before it again
                for q, moved in zip(self.pipes, done):
                    if moved:
                        recut.recut(q, was, copy_of=True)
                raise
        if not any(done):
            return 0.0
        self.label_stages()
        return time.perf_counter() - start

    def regroup(self, stages: list[int]) -> None:
        """The copies of each stage in ``stages`` average in a new process group, met through the launch's
        store under a prefix of its own: ``new_group`` over the world would wait for every rank of it, a lost
        one too (see [Note: recovery from a live copy] in rpcmp/master/livecopy.py). The world's processes
        then hold groups other than the launch made: a later pipeline of this world makes its own."""
        global _REGROUPED
        _REGROUPED = True
        seconds = max(60.0, self.job.hang_timeout or 0)
        futs, tag = [], uuid.uuid4().hex  # a prefix no other group of this store has used
        for k in stages:
            prefix = f"rpcmp/regroup/{current().attempt}/{tag}/{k}/"
            futs += [rpc.rpc_async(p.owners[k], live.regroup, args=(k, prefix, i, self.copies, p.places[k].device,
                                                                   seconds))
                     for i, p in enumerate(self.pipes)]
        wait_all(futs)

    def label_stages(self) -> None:
        """What failure messages say each process holds, from where the copies' stages are now."""
        self.status.stages = {}
        for i, pipe in enumerate(self.pipes):
            for owner, held in pipe.held().items():
                self.status.stages.setdefault(owner, []).extend(f"replica {i} stage {s.index} {s.name}" for s in held)

    # -- what differs: every copy works, on its share ------------------------------------
    def _all(self, fn) -> list:
        return [f.result() for f in [self._threads.submit(fn, i, p) for i, p in enumerate(self.pipes)]]

    def train_step(self, x: Any, y: Any, chunks: int | None = None) -> torch.Tensor:
        """One optimizer step of every copy, each on its share of ``(x, y)``; the mean loss over the copies."""
        if batch_size(x) % self.copies:
            raise JobError(f"a batch of {batch_size(x)} samples does not split evenly over {self.copies} replicas (each "
                           f"copy's loss is the mean over its share, and the copies' gradients are averaged): give "
                           f"batches of a multiple of {self.copies} samples")
        self.meeting.reset()
        self.taken = []  # the copies whose step ended: see [Note: a step some copies took] in rpcmp/master/livecopy.py
        for pipe in self.pipes:
            pipe.sync.reached = False

        def step(i, pipe):
            try:
                loss = pipe.train_step(shard(x, i, self.copies), shard(y, i, self.copies), chunks)
                self.taken.append(i)
                return loss
            except BaseException:
                self.meeting.abort()  # the others stop waiting for this copy
                pipe.settle_reduce(wait=False)  # nor does any of their stages' all_reduces
                raise
        futures = [self._threads.submit(step, i, p) for i, p in enumerate(self.pipes)]
        errors, losses = [], []
        for f in futures:
            try:
                losses.append(f.result())
            except threading.BrokenBarrierError:
                pass
            except BaseException as exc:  # noqa: BLE001 - the first real failure is re-raised
                errors.append(exc)
        if len(losses) < self.copies and not errors:  # every meeting broke, and no copy failed: it timed out
            errors.append(WorkerLostError(f"the {self.copies} copies did not all meet within {self.meeting.timeout:.0f} s "
                                          f"to average their gradients: a copy's step hung (--hang-timeout)"))
        if errors:
            self._all(lambda i, p: p.settle_reduce(wait=True))  # every collective of the step has ended
            raise errors[0]
        return torch.stack(losses).mean(0)

    @torch.no_grad()
    def predict(self, x: Any) -> Any:
        """Each copy predicts its share; copy 0 the whole batch where the model's samples meet (see [Note: samples
        that meet in the model] in rpcmp/plan/writes.py): the predictions are the unsplit model's."""
        copies = 1 if self.pipes[0].predicts_whole else min(self.copies, batch_size(x))
        parts = self._all(lambda i, p: p.predict(shard(x, i, copies)) if i < copies else None)
        return unshard(parts[:copies])

    def train(self, mode: bool = True) -> "Replicated":
        self._all(lambda i, p: p.train(mode))
        return self

    def eval(self) -> "Replicated":
        return self.train(False)

    # -- state: every copy holds the same values; the first one speaks for all -------------
    def state_dict(self) -> dict:
        return self.pipes[0].state_dict()

    def state_meta(self) -> dict:
        return self.pipes[0].state_meta()

    def optimizer_state(self) -> dict:
        return self.pipes[0].optimizer_state()

    def save_stage_files(self, directory: str, step: int, keep_last: int, run: str | None = None) -> list[dict]:
        return self.pipes[0].save_stage_files(directory, step, keep_last, run)  # written once, not R times

    def remove_incomplete(self, directory: str) -> list[tuple[str, int]]:
        return self.pipes[0].remove_incomplete(directory)  # the copy that writes the parts

    def load_files(self, files: list[str], optimizer: bool = True) -> None:
        self._all(lambda i, p: p.load_files(files, optimizer))

    def load_state_dict(self, state: dict) -> None:
        self._all(lambda i, p: p.load_state_dict(state))

    def init_from(self, path: str) -> None:
        self._all(lambda i, p: p.init_from(path))

    def rng_state(self) -> dict:
        return {"replicas": [p.rng_state() for p in self.pipes]}

    def load_rng_state(self, saved) -> bool:
        if not saved or len(saved.get("replicas", ())) != self.copies:
            return False
        return all([p.load_rng_state(s) for p, s in zip(self.pipes, saved["replicas"])])

    def scheduler_state(self) -> dict:
        return self.pipes[0].scheduler_state()

    def load_scheduler_state(self, state: dict) -> None:
        for p in self.pipes:
            p.load_scheduler_state(state)

    def set_hparams(self, fields: dict) -> None:
        for p in self.pipes:
            p.set_hparams(fields)

    # -- read from the first copy (every copy holds the same); the grid where it matters ----
    specs = _first("specs")
    places = _first("places")
    lr = _first("lr")
    last_grad_norm = _first("last_grad_norm")
    schedule = _first("schedule")
    microbatches = _first("microbatches")
    batch_chunks = _first("batch_chunks")
    whole_batch_bn = _first("whole_batch_bn")
    scheduler = _first("scheduler")
    skipped_steps = _first("skipped_steps")
    overflow_steps = _first("overflow_steps")
    hparams = _first("hparams")
    learning_rates = _first("learning_rates")
    optimizer = _first("optimizer")

    @property
    def loss_scale(self) -> float | None:
        return self.pipes[0].loss_scale

    @loss_scale.setter
    def loss_scale(self, value: float) -> None:
        for p in self.pipes:
            p.loss_scale = value

    @property
    def grid(self) -> list[list[Place]]:
        return [p.places for p in self.pipes]

    def stats(self) -> list[dict]:
        return [st for p in self.pipes for st in p.stats()]

    @property
    def rows(self) -> list[tuple]:
        """(replica, spec, place) for every process of the grid, for the run's summary."""
        return [(i, s, pl) for i, p in enumerate(self.pipes) for s, pl in zip(p.specs, p.places)]

    def explain(self, exc: BaseException) -> BaseException:
        owners = {pl.process for p in self.pipes for pl in p.places}
        return health.explain(exc, owners, self.status)

    def close(self) -> None:
        for p in self.pipes:
            p.close()
        self._threads.shutdown(wait=False)
