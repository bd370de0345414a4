"""Micro-batch schedules as data.

A :class:`Plan` says everything the executor (:mod:`rpcmp.master.executor`) does differently from
one schedule to another: the loss on the gathered batch or per micro-batch, when each
micro-batch enters the pipeline, and the order in which micro-batch gradients are added
together (every micro-batch has a distributed-autograd context of its own). It is built
without processes (:func:`make_plan`), printed by ``rpcmp plan --schedule S -m M`` and
checked by unit tests; the executor runs any plan. Why each schedule is what it is:
[Note: one context per micro-batch] in :mod:`rpcmp.master.pipeline`.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from enum import Enum

__all__ = ["Plan", "make_plan", "SCHEDULES", "Schedule", "Loss"]


class Schedule(str, Enum):
    OVERLAP = "overlap"
    ONE_F_ONE_B = "1f1b"
    GPIPE = "gpipe"


class Loss(str, Enum):
    """Where the loss is computed."""
    GATHERED = "gathered"  # once, on the whole batch's output, when every micro-batch's has arrived
    MICRO_BATCH = "micro-batch"  # per micro-batch, each weighted by its share


SCHEDULES = tuple(s.value for s in Schedule)  # the names Job.schedule and --schedule accept


@dataclass(frozen=True)
class Plan:
    """What one optimizer step of a schedule does with ``microbatches`` micro-batches over ``stages`` stages."""

    name: Schedule
    microbatches: int
    stages: int
    loss: Loss
    # micro-batch i enters the pipeline at once (None) or when micro-batch admit_after[i]'s gradients are merged
    admit_after: tuple[int | None, ...]
    # (i, into): micro-batch i's gradients are added into micro-batch ``into``'s context, one pair after the other
    merges: tuple[tuple[int, int], ...]

    @property
    def in_flight(self) -> int:
        """Most micro-batches that hold activations on a stage at once."""
        waiting = [i for i, a in enumerate(self.admit_after) if a is not None]
        return self.microbatches if not waiting else min(waiting)

    def rows(self) -> list[tuple[str, str, str, str]]:
        """One row per micro-batch: (micro-batch, enters, its backward, its gradients)."""
        into = dict(self.merges)
        rows = []
        for i, after in enumerate(self.admit_after):
            enters = "at once" if after is None else f"when {after}'s gradients are merged"
            backward = "when every output has arrived" if self.loss is Loss.GATHERED else "as soon as its output arrives"
            grads = "its context is the step's" if i not in into else f"added into {into[i]}'s, after {i - 1}'s"
            rows.append((str(i), enters, backward, grads))
        return rows


@functools.lru_cache(maxsize=64)  # a plan is frozen: one per (schedule, M, S), not one per step
def make_plan(name: str, microbatches: int, stages: int) -> Plan:
    """The plan of schedule ``name`` for ``microbatches`` micro-batches over ``stages`` stages."""
    if name not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {name!r}")
    name = Schedule(name)
    if microbatches < 1 or stages < 1:
        raise ValueError(f"a plan needs at least one micro-batch and one stage, got {microbatches} and {stages}")
    m = microbatches
    merges = tuple((i, 0) for i in range(1, m))
    if name is Schedule.GPIPE:
        return Plan(name, m, stages, Loss.GATHERED, (None,) * m, merges)
    if name is Schedule.OVERLAP:
        return Plan(name, m, stages, Loss.MICRO_BATCH, (None,) * m, merges)
    # 1f1b: micro-batch i enters when i - S has left every stage, so at most S hold activations
    return Plan(name, m, stages, Loss.MICRO_BATCH, tuple(i - stages if i >= stages else None for i in range(m)), merges)
