"""Who holds what in a run: R replicas x S stages over the world's processes, computed once.

[Note: one topology per run]
Whether a run has replicas, where each copy of each stage sits, which ranks average whose
gradients and whether the ranks must learn each other's nodes first used to be decided at
every place that needed the answer (``job.replicas > 1`` in six files, the grid computed at
five call sites). :class:`Topology` decides it once, the way torchtitan's ``ParallelDims``
checks the parallel degrees once and answers ``pp_enabled`` / ``dp_enabled`` everywhere
else: a rank computes it at start (:func:`rpcmp.launch.runtime.run_rank`, after the nodes
are known) and keeps it in its served object; the master's code reads it from there
(:meth:`Topology.for_run`), and planning code without processes computes its own.

The grid (``placement="auto"``): the copies of a stage sit on one node where a node has R
free processes (their all_reduce stays on the node) and a copy's stages on other nodes
where they can; on one node, stage k's copies are on consecutive ranks. An explicit
placement lists R x S ``process/device`` entries, copy by copy.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..core.served import current
from ..errors import JobError, PlacementError
from .partition import Split, SplitAt
from .placement import Place, process_name, resolve_placement

__all__ = ["Topology", "stage_count", "stage_world", "check_replicas"]


def stage_count(job) -> int:
    return job.stages.count if isinstance(job.stages, (Split, SplitAt)) else len(job.stages)


@dataclass(frozen=True)
class Topology:
    """R copies x S stages: ``grid[replica][stage]`` is the :class:`Place` that owns that copy."""

    replicas: int
    stages: int
    world_size: int
    grid: tuple[tuple[Place, ...], ...]
    spares: tuple[str, ...] = ()  # the last ranks, which hold no stage (Job.spares)

    @classmethod
    def of(cls, job, world_size: int, stages: int | None = None, nodes: list[str] | None = None) -> "Topology":
        """The job's topology on ``world_size`` processes; ``nodes``: each rank's node, for ``placement="auto"``
        with replicas (:func:`rpcmp.launch.groups.share_nodes`). Raises :class:`PlacementError` for a grid the
        world cannot hold."""
        s = stages or stage_count(job)
        holding = stage_world(job, world_size)
        rows = (_grid(job, holding, s, nodes[:holding] if nodes else None, world_size - holding) if job.replicas > 1
                else [resolve_placement(job.placement, s, holding, world_size - holding)])
        spares = tuple(process_name(r) for r in range(holding, world_size))
        return cls(job.replicas, s, world_size, tuple(tuple(row) for row in rows), spares)

    @classmethod
    def for_run(cls, job, world_size: int) -> "Topology":
        """The one this process computed at start (:func:`rpcmp.launch.runtime.run_rank`), else a fresh one."""
        topo = current().topology
        if (topo is not None and topo.world_size == world_size and topo.replicas == job.replicas
                and len(topo.spares) == job.spares):
            return topo
        return cls.of(job, world_size, nodes=current().nodes)

    @staticmethod
    def needs_nodes(job) -> bool:
        """Whether the ranks must learn each other's nodes before the grid can be drawn."""
        return job.replicas > 1 and job.placement == "auto"

    @property
    def replicated(self) -> bool:
        return self.replicas > 1

    def copies(self, k: int) -> list[Place]:
        """Where the copies of stage ``k`` are (one per replica)."""
        return [row[k] for row in self.grid]

    def describe(self) -> str:
        text = f"{self.replicas} replicas x {self.stages} stages" if self.replicated else f"{self.stages} stages"
        return text + (f", spares: {', '.join(self.spares)}" if self.spares else "")


def stage_world(job, world_size: int) -> int:
    """The processes that may hold stages: the world but its last ``Job.spares`` ranks."""
    spares = getattr(job, "spares", 0)
    if spares and world_size - spares < 1:
        raise PlacementError(f"Job.spares={spares} leaves no process for the stages of {world_size}: start more processes "
                             f"(--local {spares + stage_count(job) + 1}) or fewer spares")
    return world_size - spares


def check_replicas(job) -> None:
    """What ``Job(replicas=R)`` requires of the other fields (called by :class:`rpcmp.Job`)."""
    if job.replicas == 1:
        return
    if job.mode != "pipeline":
        raise JobError(f"Job.replicas={job.replicas} copies a pipeline of stages; DDP mode copies the whole model "
                       f"on every rank already: drop replicas, or use mode='pipeline'")
    if job.batch_size % job.replicas or job.batch_size // job.replicas < job.microbatches:
        raise JobError(f"Job.batch_size ({job.batch_size}) is the global batch, split over {job.replicas} replicas "
                       f"into {job.microbatches} micro-batches each: make it a multiple of {job.replicas} of at "
                       f"least {job.replicas * job.microbatches}")
    if job.trace_file:
        raise JobError("Job.trace_file draws the timeline of one pipeline: trace with replicas=1 (the copies run alike)")


def _grid(job, world_size: int, s: int, nodes: list[str] | None, spares: int = 0) -> list[list[Place]]:
    r = job.replicas
    need = r * s
    if job.placement == "auto":
        if world_size < need:
            besides = f" besides {spares} spare{'s' if spares > 1 else ''} (--spares)" if spares else ""
            raise PlacementError(f"{r} replicas x {s} stages need {need} processes (or {need + 1}: the master holds no "
                                 f"stage then), got {world_size}{besides}: start {need + 1 + spares} processes "
                                 f"(--local {need + 1 + spares})")
        first = 1 if world_size > need else 0  # with exactly R x S processes the master holds a stage too
        columns = _by_node(r, s, list(range(first, world_size)), nodes or ["one"] * world_size)
        return [[Place(process_name(columns[k][i])) for k in range(s)] for i in range(r)]
    if isinstance(job.placement, str) or len(job.placement) != need:
        raise PlacementError(f"with {r} replicas of {s} stages, placement must be 'auto' or {need} 'process/device' "
                             f"entries (replica 0's stages, then replica 1's, ...), got {job.placement!r}")
    flat = resolve_placement(list(job.placement), need, world_size, spares)
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
