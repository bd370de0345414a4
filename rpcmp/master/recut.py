"""Re-cut a pipeline while it trains: ``pipe.recut([3, 3, 2])`` (a ``Split``), ``pipe.recut(SplitAt("h.2",
"h.4"))`` (a traced split), and ``Job(rebalance=True)``, which re-cuts by itself when the stages it
measures are out of balance.

[Note: re-cutting a pipeline]
Between two steps, every stage whose layers change is built again on its owner (the same
process: a re-cut moves layers, not stages), empty, and takes each tensor it now holds from
the old stage that held it, by the unsplit model's name (parameters, every buffer, optimizer
state; a parameter the model holds under two names, a tied head, by either): the keys of a
resume under another split, from memory instead of files. A stage of a ``Split`` whose layers
stay is kept as it is; every stage of a traced split is built again, since one that keeps its
bounds may send its values on to other stages than before. The re-cut pipeline has a new id on
every process, so the old stages and the new ones never mix while tensors travel; the old ones
are dropped after, and a new DistributedOptimizer takes over the old local optimizers' state (as
:mod:`rpcmp.master.move` does). The math is the unsplit model's before and after, so a run with
a re-cut equals one without (dropout aside: a layer that changes process draws its masks from
the other process's generator).

A traced split is cut again by the master from the export its first plan made, marked at every block
(see [Note: one export for every cut among siblings] in :mod:`rpcmp.plan.marks`), and its new plan
carries each stage's graphs to its owner (:mod:`rpcmp.plan.shipped`): nothing is exported or traced
again. Most of a re-cut is then pipelining's split of that export and the plan's checks on it (a
4-block GPT-2 over three owners on two cores: 1.9-3.1 s, against 5.2-6.6 s when the master exported
the model again for the new points; figures: benchmarks/PERFORMANCE.md).

``Job(rebalance=True)`` (:class:`Rebalancer`): after a warm-up, it measures each stage's busy
time over a window of steps (its owner's CPU time when the stage has the process to itself,
its forward time otherwise), spreads it over the stage's units by their weights (the layers of a
``Split`` by parameter count, the blocks a ``SplitAt`` cuts between by the parameters of their
products: :class:`rpcmp.plan.balance.Units`), and cuts those costs as evenly as it can
(:func:`rpcmp.plan.balance.partition_costs`).
It re-cuts when the predicted slowest stage is at least 5 % faster, then measures again;
it never returns to a balance it has had.
"""
from __future__ import annotations

import dataclasses
import time

import torch.distributed.rpc as rpc

from ..core.futures import wait_all
from ..core.health import unless_lost
from ..core.served import current
from ..errors import JobError, RpcmpError
from ..owner import move as owner_move
from ..owner import stage
from ..plan.balance import partition_costs, units_of
from ..plan.partition import Split, SplitAt, replan
from ..plan.materialize import meta_model, tensor_names
from .move import build_many, held_handles, install, new_optimizer, restore_handles, warm
from .sync import LocalMerge

__all__ = ["recut", "Rebalancer"]


def recut(pipe, cut, copy_of: bool = False, before_commit=None) -> float:
    """Re-cut ``pipe`` as ``cut``: a balance for a ``Split`` (``[3, 3, 2]``), the points for a ``SplitAt``
    (``SplitAt("h.2", "h.4")`` or the names); the seconds it took. See [Note: re-cutting a pipeline].
    ``copy_of``: ``pipe`` is a copy of a replicated pipeline whose every copy is re-cut alike
    (:meth:`rpcmp.master.replicas.Replicated.recut`). ``before_commit()``: called once the new parts hold their
    values and the old ones are still there (the snapshot of the new cut: [Note: a re-cut and its snapshot]);
    where it fails, the re-cut is undone."""
    old_specs, kind = pipe.specs, pipe.specs[0].kind
    if kind not in ("slice", "traced"):
        raise JobError(f"recut: only a Split or a SplitAt pipeline can be re-cut (a cut that can move); this job's "
                       f"stages are {type(pipe.job.stages).__name__}")
    if not copy_of and not isinstance(pipe.sync, LocalMerge):
        raise JobError("recut: this pipeline is one copy of a replicated one: re-cut it with Replicated.recut(cut), "
                       "which re-cuts every copy alike")
    cut = _checked(old_specs, cut)
    start = time.perf_counter()
    if kind == "traced" and not old_specs[0].graphs:  # a plan that cannot carry the graphs (rpcmp.plan.shipped):
        # the owners trace the new cut while the master does (a plan that can carries the new cut's graphs)
        warm(sorted(set(pipe.owners) - {current().me}), dataclasses.replace(old_specs[0], cut=cut))
    specs = replan(pipe.job, old_specs, cut)
    if len(specs) != len(old_specs):
        raise JobError(f"recut: {cut!r} gives {len(specs)} stages; this pipeline has {len(old_specs)} owners")
    # A traced stage that keeps its bounds may send its values on to other stages than before: all are built again.
    same = [kind == "slice" and (a.start, a.stop) == (b.start, b.stop) for a, b in zip(old_specs, specs)]
    if all(same) or (kind == "traced" and specs[0].cut == old_specs[0].cut):
        return 0.0
    old_pid, optims = pipe.pid, {r.owner().name: r for r in (pipe.optimizer.remote_optimizers if pipe.optimizer else [])}
    pipe.pid, pipe.specs = current().next_pipeline_id(), specs
    owners = list(pipe.owners)
    wait_all([rpc.rpc_async(owners[k], owner_move.rekey, args=(old_pid, pipe.pid, k)) for k in range(len(specs)) if same[k]])
    handles = held_handles(pipe)
    try:
        built = build_many(pipe, {k: pipe.places[k] for k in range(len(specs)) if not same[k]}, owners)
        wait_all([rpc.rpc_async(owners[k], owner_move.gather_stage,
                                args=(pipe.pid, k, old_pid, _sources(old_specs, specs[k], owners), set(optims),
                                      _aliases(pipe.job)))
                  for k in built])
        for k, b in built.items():
            install(pipe, k, pipe.places[k], b)
        new_optimizer(pipe, optims, {owners[k] for k in built})
        if before_commit is not None:
            before_commit()
    except Exception:  # an owner could not build or fill its new part, or was lost: the pipeline stays as it was cut
        restore_handles(pipe, handles)
        _undo(pipe, old_pid, owners, same)
        pipe.pid, pipe.specs = old_pid, old_specs
        raise
    # the old parts, and their snapshots here and on the buddies (the new cut's are whole by now)
    _settle([rpc.rpc_async(o, stage.release, args=(old_pid,)) for o in sorted(set(owners))])
    return time.perf_counter() - start


# [Note: a re-cut and its snapshot]
# With spares, every stage's snapshot (and its buddy's copy) is of the pipeline as it is cut: after a
# re-cut, a loss is recovered from the new cut's snapshot only. When that snapshot was taken after the
# re-cut, beside the next step, an owner lost before it had landed ended the run ("no snapshot holds
# the lost stages"). Now the re-cut takes it before it lets the old parts go (``before_commit``), and
# waits until every buddy holds its copy: a loss before that undoes the re-cut (the old parts, their
# optimizer state untouched, and their snapshots are all still there) and the spare takes over from
# the old cut's snapshot; a loss after it recovers from the new one. Nothing in between.


def _undo(pipe, old_pid: int, owners: list[str], same: list[bool]) -> None:
    """A re-cut that failed before the old parts were dropped: the kept parts take their old key again, and the
    new parts go with their snapshots and the buddies' copies of them. An owner lost meanwhile fails its calls;
    the rest are undone all the same (the next step meets the loss, and with spares recovers from it: the
    snapshots are of the pipeline as it was cut)."""
    _settle([rpc.rpc_async(owners[k], owner_move.rekey, args=(pipe.pid, old_pid, k)) for k in range(len(owners)) if same[k]])
    _settle([rpc.rpc_async(o, stage.release, args=(pipe.pid,)) for o in sorted(set(owners))])


def _settle(futs) -> None:
    try:
        wait_all(futs)
    except Exception:  # noqa: BLE001 - a lost owner: see _undo
        pass


def _checked(specs, cut) -> tuple[str, ...] | list[int]:
    """``cut`` as ``replan`` takes it (the points of a traced split, the balance of a ``Split``), or an error
    saying what fits."""
    if specs[0].kind == "traced":
        points = cut.points if isinstance(cut, SplitAt) else cut
        if isinstance(points, str) or not all(isinstance(p, str) for p in points) or len(points) != len(specs) - 1:
            raise JobError(f"recut: expected {len(specs) - 1} split points (submodule names, as SplitAt takes them: "
                           f"{list(specs[0].cut)} now), got {cut!r}")
        return tuple(points)
    if isinstance(cut, SplitAt) or len(cut) != len(specs) or sum(cut) != specs[0].total or min(cut) < 1:
        raise JobError(f"recut: expected {len(specs)} positive layer counts adding up to {specs[0].total}, got {cut!r}")
    return [int(b) for b in cut]


def _aliases(job) -> dict[str, tuple[str, ...]]:
    """Each name of a parameter the model holds under several names (a tied head) -> all of its names:
    a stage may hold it under a name its old holder did not."""
    return {n: tuple(group) for group in tensor_names(meta_model(job)).values() if len(group) > 1 for n in group}


def _sources(old_specs, spec, owners: list[str]) -> dict[str, list[int]]:
    """The old stages (by process) that held some tensor of ``spec``: the layers that overlap for a ``Split``;
    any stage of a traced split (each sends what it has of the names asked for)."""
    out: dict[str, list[int]] = {}
    for j, old in enumerate(old_specs):
        if spec.kind == "traced" or (old.start < spec.stop and spec.start < old.stop):
            out.setdefault(owners[j], []).append(j)
    return out


class Rebalancer:
    """``Job(rebalance=True)``: see [Note: re-cutting a pipeline]."""

    def __init__(self, pipe, warmup: int = 5, window: int = 5, gain: float = 0.05, before_commit=None):
        self.pipe, self.warmup, self.window, self.gain = pipe, warmup, window, gain
        self.before_commit = before_commit  # what each re-cut calls before the old parts go (see recut)
        self.measured = getattr(pipe, "pipes", [pipe])[0]  # with replicas, the first copy: they work alike
        stages = pipe.job.stages
        self.units = units_of(meta_model(pipe.job), None if isinstance(stages, Split) else pipe.specs[0].cut)
        self.had = {self.balance}
        self.since: tuple[int, list[dict]] | None = None
        self.decided: str | None = None  # what the last window decided

    @property
    def balance(self) -> tuple[int, ...]:
        return self.units.balance(self.pipe.specs)

    def after_step(self, step: int) -> str | None:
        """Measure, and re-cut when it pays; returns what it did, or None."""
        if step < self.warmup:
            return None
        if self.since is None:
            stats = self._stats()
            self.since = None if stats is None else (step, stats)
            return None
        if step - self.since[0] < self.window:
            return None
        stats, (_, before) = self._stats(), self.since
        self.since = None
        if stats is None:
            return None
        busy = _busy(before, stats, self.measured.owners)
        balance, now, then = self.propose(busy)
        if balance is None:
            self.decided = (f"kept balance {list(self.balance)} after step {step}: no cut it has not had predicts the "
                            f"slowest stage {self.gain:.0%} faster ({now:.3f} s of work per window)")
            return None
        before = self.balance
        self.had.add(balance)
        cut, kept = self.units.cut(balance), f"kept balance {list(before)} after step {step}: the re-cut to {list(balance)}"
        try:  # where it fails the pipeline is as it was: training goes on with it
            took, lost = unless_lost(lambda: self.pipe.recut(cut) if self.before_commit is None
                                     else self.pipe.recut(cut, self.before_commit), self._owners())
        except RpcmpError as exc:  # refused, every owner answering
            self.decided = f"{kept} failed: {str(exc).splitlines()[0][:300]}"
            return self.decided
        if lost:
            self.had.discard(balance)  # a cut that may still pay once the lost owner is replaced
            self.decided = f"{kept} failed: {', '.join(lost)} was lost meanwhile (the next step meets it)"
            return self.decided
        self.decided = (f"re-cut after step {step}: balance {list(before)} -> {list(balance)}{self._at(balance)} "
                        f"(slowest stage predicted "
                        f"{then:.3f} s of work per window instead of {now:.3f} s) in {took:.2f} s")
        return self.decided

    def _stats(self) -> list | None:
        """The stages' figures now; None where an owner was lost meanwhile: the next step meets the loss (and,
        with spares, recovers from it), and the measurement starts again after it."""
        return unless_lost(self.measured.stats, self._owners())[0]

    def _owners(self) -> list[str]:
        """Every owner of the pipeline's stages, of every copy."""
        return sorted({o for p in getattr(self.pipe, "pipes", [self.pipe]) for o in p.owners})

    def _at(self, balance: tuple[int, ...]) -> str:
        """Where a SplitAt is cut for ``balance``: its points, as the log says them."""
        return f", cut at {', '.join(self.units.cut(balance))}" if self.units.names else ""

    def propose(self, busy: list[float]) -> tuple[tuple[int, ...] | None, float, float]:
        """The balance to re-cut to (None: keep this one), the slowest stage's busy time now and predicted."""
        costs, i = [], 0
        for n, t in zip(self.balance, busy):
            w = self.units.weights[i:i + n]
            costs += [t * x / sum(w) for x in w]
            i += n
        balance = tuple(partition_costs(costs, len(busy)))
        sums, i = [], 0
        for n in balance:
            sums.append(sum(costs[i:i + n]))
            i += n
        now, then = max(busy), max(sums)
        if balance in self.had or then > (1 - self.gain) * now:
            return None, now, then
        return balance, now, then


def _busy(before: list[dict], after: list[dict], owners: list[str]) -> list[float]:
    """Each stage's work between two ``stats()``: its owner's CPU time where it has the process alone."""
    alone = [owners.count(o) == 1 for o in owners]
    return [(b["process_cpu_s"] - a["process_cpu_s"]) if solo else (b["compute_s"] - a["compute_s"])
            for a, b, solo in zip(before, after, alone)]

