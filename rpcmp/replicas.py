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
as in DDP mode without SyncBatchNorm. One master drives every copy (rather than a master
per copy) so that there is one data order, one checkpoint writer and one place that names a
lost process; its cost is a thread per copy on the master.

Each stage's average starts on its owner as soon as the step's last micro-batch has left
the stage in the backward, while the stages before it still compute (one ``all_reduce``
per stage and step, asynchronous): see [Note: the average overlaps the backward] in
:mod:`rpcmp.reduce`, which also says how a parameter used by some copies only is refused
alike by all and how a failed step keeps the collectives paired.

The grid (:func:`grid_placement`): with ``placement="auto"`` the copies of a stage sit on one
node where a node has R free processes (their all_reduce stays on the node) and a copy's
stages on other nodes where they can; the ranks learn each other's nodes through the
launch's store before RPC starts (:func:`share_nodes`: torchrun's node rank, else the host
name). On one node, stage k's copies are on consecutive ranks. An explicit placement lists R x S
``process/device`` entries, copy by copy.
"""
from __future__ import annotations

import os
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from . import health
from .errors import JobError, PlacementError
from .network import launch_store
from .microbatch import batch_size
from .partition import Split, SplitAt
from .placement import Place, process_name, resolve_placement
from .served import current

__all__ = ["grid_placement", "stage_count", "this_node", "share_nodes", "join_stage_groups", "leave_stage_groups", "ReplicaSync",
           "Replicated", "shard", "unshard"]


def stage_count(job) -> int:
    return job.stages.count if isinstance(job.stages, (Split, SplitAt)) else len(job.stages)


def grid_placement(job, world_size: int, stages: int | None = None, nodes: list[str] | None = None) -> list[list[Place]]:
    """``[replica][stage]`` -> the :class:`Place` that owns that copy of that stage; ``nodes``: each
    rank's node (:func:`share_nodes`), for ``placement="auto"``."""
    s, r = stages or stage_count(job), job.replicas
    need = r * s
    if job.placement == "auto":
        if world_size < need:
            raise PlacementError(f"{r} replicas x {s} stages need {need} processes (or {need + 1}: the master holds no "
                                 f"stage then), got {world_size}: start {need + 1} processes (--local {need + 1})")
        first = 1 if world_size > need else 0  # with exactly R x S processes the master holds a stage too
        columns = _by_node(r, s, list(range(first, world_size)), nodes or ["one"] * world_size)
        return [[Place(process_name(columns[k][i])) for k in range(s)] for i in range(r)]
    if isinstance(job.placement, str) or len(job.placement) != need:
        raise PlacementError(f"with {r} replicas of {s} stages, placement must be 'auto' or {need} 'process/device' "
                             f"entries (replica 0's stages, then replica 1's, ...), got {job.placement!r}")
    flat = resolve_placement(list(job.placement), need, world_size)
    grid = [flat[i * s:(i + 1) * s] for i in range(r)]
    for k in range(s):
        copies = [grid[i][k].process for i in range(r)]
        if len(set(copies)) < r:
            raise PlacementError(f"the {r} copies of stage {k} must be on {r} different processes (their gradients are "
                                 f"averaged in a process group), got {copies}")
        kinds = {grid[i][k].device.split(":")[0] for i in range(r)}
        if len(kinds) > 1:
            raise PlacementError(f"the copies of stage {k} are on {sorted(str(grid[i][k]) for i in range(r))}: put them all "
                                 f"on CUDA devices (averaged over NCCL) or all on the CPU (gloo)")
    return grid


def _by_node(r: int, s: int, free: list[int], nodes: list[str]) -> list[list[int]]:
    """The ranks of each stage's R copies: R free ranks of one node where a node has them (their
    all_reduce stays on the node), a node no earlier stage took if one can (a copy's stages on other
    nodes), else the next R free ranks. On one node: stage k's copies on consecutive ranks."""
    columns, used = [], set()
    for _ in range(s):
        by_node: dict[str, list[int]] = {}
        for q in free:
            by_node.setdefault(nodes[q], []).append(q)
        fits = [(node, qs[:r]) for node, qs in by_node.items() if len(qs) >= r]
        node, ranks = next((f for f in fits if f[0] not in used), fits[0] if fits else (None, free[:r]))
        used.add(node)
        columns.append(ranks)
        free = [q for q in free if q not in ranks]
    return columns


def this_node() -> str:
    """The node this process runs on: torchrun's node rank, else the host's name."""
    return f"node {os.environ['GROUP_RANK']}" if "GROUP_RANK" in os.environ else socket.gethostname()


def share_nodes(rank: int, world_size: int, timeout: float) -> list[str]:
    """Every rank's node, the same list on every rank (through the launch's store, before RPC)."""
    store = launch_store(timeout)
    key = f"rpcmp/node/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
    store.set(key + str(rank), this_node())
    return [store.get(key + str(q)).decode() for q in range(world_size)]


def join_stage_groups(job, rank: int, world_size: int, served) -> None:
    """On every rank of a run with replicas: one process group over all ranks, and one per stage
    over the ranks that hold its copies (``served.stage_groups[k]``). Every rank must call this:
    creating a group is a collective of the whole world."""
    grid = grid_placement(job, world_size, nodes=served.nodes)
    timeout = timedelta(seconds=max(60.0, job.hang_timeout or 0))
    store = launch_store(timeout.total_seconds())
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    # The world's group is gloo whatever the devices (a master or a CPU stage has no GPU for NCCL);
    # the groups of CUDA stages are NCCL's.
    dist.init_process_group("gloo", store=dist.PrefixStore(f"rpcmp/pg/{attempt}", store),
                            rank=rank, world_size=world_size, timeout=timeout)
    groups = {}
    for k in range(len(grid[0])):
        ranks = sorted(grid[i][k].rank for i in range(len(grid)))
        backend = "nccl" if grid[0][k].device.startswith("cuda") else "gloo"
        group = dist.new_group(ranks, backend=backend, timeout=timeout)
        if rank in ranks:
            groups[k] = group
    served.stage_groups = groups
    dist.barrier()  # a rank outside a group passes new_group at once: no stage is used before every group exists


def leave_stage_groups(served) -> None:
    if served.stage_groups is not None and dist.is_initialized():
        dist.destroy_process_group()
    served.stage_groups = None


class ReplicaSync:
    """Where the copies of a step meet before their gradients are averaged: every copy brings its
    loss and leaves with the mean over the copies. A copy that failed earlier calls :meth:`abort`,
    and the others leave with ``threading.BrokenBarrierError`` instead of waiting."""

    def __init__(self, copies: int, timeout: float | None = None):
        self.copies, self._losses = copies, [None] * copies
        self._barrier = threading.Barrier(copies, timeout=timeout)

    def meet(self, index: int, loss: torch.Tensor) -> torch.Tensor:
        self._losses[index] = loss.detach()
        self._barrier.wait()
        mean = torch.stack(self._losses).mean(0)
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


class Replicated:
    """R :class:`~rpcmp.Pipeline` copies that train as one (see [Note: replicas of a pipeline]);
    what the trainer asks of a pipeline, it asks of this."""

    def __init__(self, job, world_size: int, pipeline_cls, status=None, sample: Any = None):
        self.job, self.copies = job, job.replicas
        grid = grid_placement(job, world_size, nodes=current().nodes)
        self.sync = ReplicaSync(self.copies, timeout=max(job.rpc_timeout, job.hang_timeout or 0) * 4)
        self._threads = ThreadPoolExecutor(self.copies, thread_name_prefix="rpcmp-replica")
        # One plan for every copy: the same cut points (Split(by="time") profiles once), and tracing
        # (torch.export) is not something two threads can do at once. The copies then build at once:
        # their stages are on different processes.
        specs = pipeline_cls.plan(job, sample)
        self.pipes = [f.result() for f in [self._threads.submit(pipeline_cls, job, world_size, places=grid[i],
                                                                replica=(i, self.sync), status=status, specs=specs)
                                           for i in range(self.copies)]]
        self.status = self.pipes[0].status
        self.status.stages = {}
        for i, pipe in enumerate(self.pipes):
            for owner, held in pipe._held().items():
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
        self.sync.reset()

        def step(i, pipe):
            try:
                return pipe.train_step(shard(x, i, self.copies), shard(y, i, self.copies), chunks)
            except BaseException:
                self.sync.abort()  # the others stop waiting for this copy
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
        if errors:
            self._all(lambda i, p: p.settle_reduce(wait=True))  # every collective of the step has ended
            raise errors[0]
        return torch.stack(losses).mean(0)

    @torch.no_grad()
    def predict(self, x: Any) -> Any:
        copies = min(self.copies, batch_size(x))
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

    # -- read from the first copy; the grid where it matters -------------------------------
    _FIRST = ("specs", "places", "lr", "last_grad_norm", "schedule", "microbatches", "batch_chunks", "whole_batch_bn",
              "scheduler", "skipped_steps", "overflow_steps", "hparams", "learning_rates", "optimizer")

    def __getattr__(self, name: str) -> Any:
        """What every copy holds alike is read from the first (the names in ``_FIRST``)."""
        if name not in Replicated._FIRST or "pipes" not in self.__dict__:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(self.__dict__["pipes"][0], name)

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
