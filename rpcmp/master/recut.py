"""Re-cut a ``Split`` pipeline while it trains: ``pipe.recut([3, 3, 2])``, and ``Job(rebalance=True)``,
which re-cuts by itself when the stages it measures are out of balance.

[Note: re-cutting a pipeline]
Between two steps, every stage whose layers change is built again on its owner (the same
process: a re-cut moves layers, not stages), empty, and takes each tensor it now holds from
the old stage that held it, by the unsplit model's name (parameters, every buffer, optimizer
state): the keys of a resume under another split, from memory instead of files. A stage whose
layers stay is kept as it is. The re-cut pipeline has a new id on every process, so the old
stages and the new ones never mix while tensors travel; the old ones are dropped after, and a
new DistributedOptimizer takes over the old local optimizers' state (as :mod:`rpcmp.master.move`
does). The math is the unsplit model's before and after, so a run with a re-cut equals one
without (dropout aside: a layer that changes process draws its masks from the other process's
generator).

``Job(rebalance=True)`` (:class:`Rebalancer`): after a warm-up, it measures each stage's busy
time over a window of steps (its owner's CPU time when the stage has the process to itself,
its forward time otherwise), spreads it over the stage's layers by their parameter counts,
and cuts those layer costs as evenly as it can (:func:`rpcmp.plan.balance.partition_costs`).
It re-cuts when the predicted slowest stage is at least 5 % faster, then measures again;
it never returns to a balance it has had.
"""
from __future__ import annotations

import dataclasses
import time

import torch.distributed.rpc as rpc

from ..core.futures import wait_all
from ..core.served import current
from ..errors import JobError
from ..owner import move as owner_move
from ..plan.balance import partition_costs
from ..plan.partition import Split, plan_stages
from ..plan.materialize import meta_model
from .move import build_on, install, new_optimizer
from .sync import LocalMerge

__all__ = ["recut", "Rebalancer"]


def recut(pipe, balance: list[int]) -> float:
    """Re-cut ``pipe`` (a ``Split``) into ``balance``; the seconds it took. See [Note: re-cutting a pipeline]."""
    old_specs, balance = pipe.specs, [int(b) for b in balance]
    if not isinstance(pipe.job.stages, Split):
        raise JobError(f"recut: only a Split pipeline can be re-cut (its layers are an nn.Sequential); this job's "
                       f"stages are {type(pipe.job.stages).__name__}")
    if not isinstance(pipe.sync, LocalMerge):
        raise JobError("recut: a pipeline with replicas cannot be re-cut yet")
    if len(balance) != len(old_specs) or sum(balance) != old_specs[0].total or min(balance) < 1:
        raise JobError(f"recut: expected {len(old_specs)} positive layer counts adding up to {old_specs[0].total}, "
                       f"got {balance}")
    specs = plan_stages(dataclasses.replace(pipe.job, stages=Split(balance)), None)
    same = [(a.start, a.stop) == (b.start, b.stop) for a, b in zip(old_specs, specs)]
    if all(same):
        return 0.0
    start = time.perf_counter()
    old_pid, optims = pipe.pid, {r.owner().name: r for r in (pipe.optimizer.remote_optimizers if pipe.optimizer else [])}
    pipe.pid, pipe.specs = current().next_pipeline_id(), specs
    owners = list(pipe.owners)
    wait_all([rpc.rpc_async(owners[k], owner_move.rekey, args=(old_pid, pipe.pid, k)) for k in range(len(specs)) if same[k]])
    built = {k: build_on(pipe, k, pipe.places[k], owners) for k in range(len(specs)) if not same[k]}
    wait_all([rpc.rpc_async(owners[k], owner_move.gather_stage,
                            args=(pipe.pid, k, old_pid, _sources(old_specs, specs[k], owners), optims)) for k in built])
    wait_all([rpc.rpc_async(owners[k], owner_move.drop_stage, args=(old_pid, k)) for k in built])
    for k, b in built.items():
        install(pipe, k, pipe.places[k], b)
    new_optimizer(pipe, optims, {owners[k] for k in built})
    return time.perf_counter() - start


def _sources(old_specs, spec, owners: list[str]) -> dict[str, list[int]]:
    """The old stages (by process) that held some layer of ``spec``."""
    out: dict[str, list[int]] = {}
    for j, old in enumerate(old_specs):
        if old.start < spec.stop and spec.start < old.stop:
            out.setdefault(owners[j], []).append(j)
    return out


class Rebalancer:
    """``Job(rebalance=True)``: see [Note: re-cutting a pipeline]."""

    def __init__(self, pipe, warmup: int = 5, window: int = 5, gain: float = 0.05):
        self.pipe, self.warmup, self.window, self.gain = pipe, warmup, window, gain
        seq = meta_model(pipe.job)
        self.weights = [max(1, sum(p.numel() for p in layer.parameters())) for layer in seq]
        self.had = {self.balance}
        self.since: tuple[int, list[dict]] | None = None
        self.decided: str | None = None  # what the last window decided

    @property
    def balance(self) -> tuple[int, ...]:
        return tuple(s.stop - s.start for s in self.pipe.specs)

    def after_step(self, step: int) -> str | None:
        """Measure, and re-cut when it pays; returns what it did, or None."""
        if step < self.warmup:
            return None
        if self.since is None:
            self.since = (step, self.pipe.stats())
            return None
        if step - self.since[0] < self.window:
            return None
        busy = _busy(self.since[1], self.pipe.stats(), self.pipe.owners)
        self.since = None
        balance, now, then = self.propose(busy)
        if balance is None:
            self.decided = (f"kept balance {list(self.balance)} after step {step}: no cut it has not had predicts the "
                            f"slowest stage {self.gain:.0%} faster ({now:.3f} s of work per window)")
            return None
        before = self.balance
        took = recut(self.pipe, list(balance))
        self.had.add(balance)
        self.decided = (f"re-cut after step {step}: balance {list(before)} -> {list(balance)} (slowest stage predicted "
                        f"{then:.3f} s of work per window instead of {now:.3f} s) in {took:.2f} s")
        return self.decided

    def propose(self, busy: list[float]) -> tuple[tuple[int, ...] | None, float, float]:
        """The balance to re-cut to (None: keep this one), the slowest stage's busy time now and predicted."""
        costs = []
        for spec, t in zip(self.pipe.specs, busy):
            w = self.weights[spec.start:spec.stop]
            costs += [t * x / sum(w) for x in w]
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

