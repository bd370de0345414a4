"""How a pipeline's gradients come together before its optimizer step: the one decision that
differs between a single pipeline and one copy of R (see [Note: replicas of a pipeline]).

:class:`LocalMerge` (one copy): each micro-batch's gradients are added into the step's target
context on its owner. :class:`ReplicaReduce` (copy ``index`` of R): the owners merge and start
averaging with the other copies as each backward leaves them, and the copies meet before the
step on the mean loss. The pipeline holds one of them and never asks which.
"""
from __future__ import annotations

import torch

from ..core.futures import call_each, raise_failures
from ..owner import grads, live

__all__ = ["LocalMerge", "ReplicaReduce"]


def _merged(pipe, told: list[str], ctx_ids: list[int], i: int, ran: bool) -> tuple[str, ...]:
    """Micro-batch ``i`` has done its whole backward (``ran``: it had one) and every one before it has
    been merged: say so to the owners that cannot learn it themselves (``told``), and to every owner of
    parameters for the last micro-batch or one without a backward; return once they have merged it, with the
    owners that took the optimizer step in the backward (rpcmp/owner/stepping.py)."""
    owners = pipe.param_owners if i == len(ctx_ids) - 1 or not ran else told
    said = raise_failures(call_each(owners, grads.reduce_merged, (pipe.pid, i, ctx_ids[:i + 1])))
    return tuple(o for o, stepped in zip(owners, said) if stepped is True)


class LocalMerge:
    """One pipeline: nothing to meet, nothing to average; the owners merge the micro-batches'
    gradients as each backward leaves them (see [Note: a pipeline's merges where its gradients are
    made] in rpcmp/owner/reduce.py)."""

    def __init__(self):
        self.told: list[str] = []  # owners told of each micro-batch's end; the others, of the last one's only
        self.arming: list[str] = []  # owners that will take this step's optimizer step in its backward if they can

    def begin(self, pipe, first_seq: int, count: int, steps: bool = False) -> None:
        """``steps``: the owners take the optimizer step in the backward where they can (see [Note: a step steps
        where its gradients are made] in rpcmp/owner/stepping.py)."""
        self.told, self.arming = [], []
        if count > 1:
            said = call_each(pipe.param_owners, grads.begin_merge, (pipe.pid, first_seq, count, steps))
            self.told = [o for o, (needs, _) in zip(pipe.param_owners, said) if needs]
            self.arming = [o for o, (_, arms) in zip(pipe.param_owners, said) if arms]

    def merge(self, pipe, ctx_ids: list[int], i: int, into: int, ran: bool = True) -> tuple[str, ...]:
        """Micro-batch ``i``'s gradients are in context ``ctx_ids[into]`` on every owner once this returns; the
        owners that took the step in the backward, after the last micro-batch."""
        return _merged(pipe, self.told, ctx_ids, i, ran)

    def before_step(self, pipe, ctx_id: int, loss: torch.Tensor) -> torch.Tensor | None:
        """The loss the step's policy decides on; None: this copy leaves the decision to another."""
        return loss

    def settle(self, pipe, wait: bool) -> None:
        pass


class ReplicaReduce:
    """Copy ``index`` of R: its owners average every stage's gradients with the other copies'."""

    def __init__(self, index: int, meeting):
        self.index, self.meeting = index, meeting  # meeting: the rpcmp.master.replicas.ReplicaSync of the copies
        self.mark = False  # with spares: every owner marks the step's start (see [Note: a step marked, to be run again])
        self.reached = False  # this step's gradients are averaged: from here on the optimizer may change the stages
        self.told: list[str] = []  # as LocalMerge's

    arming = ()  # the copies average every gradient before the step: none is taken in the backward

    def begin(self, pipe, first_seq: int, count: int, steps: bool = False) -> None:
        """The owners learn the step's micro-batches before they arrive (see [Note: the average overlaps
        the backward] in rpcmp/owner/reduce.py)."""
        fn = live.begin if self.mark else grads.begin_reduce
        owners = sorted(set(pipe.owners)) if self.mark else pipe.param_owners
        needs = call_each(owners, fn, (pipe.pid, first_seq, count))
        self.told = [o for o, n in zip(owners, needs) if n and o in pipe.param_owners]

    def merge(self, pipe, ctx_ids: list[int], i: int, into: int, ran: bool = True) -> tuple[str, ...]:
        """The owners merge as each backward leaves them and start the average when the last has."""
        return _merged(pipe, self.told, ctx_ids, i, ran)

    def before_step(self, pipe, ctx_id: int, loss: torch.Tensor) -> torch.Tensor | None:
        loss = self.meeting.meet(self.index, loss.detach().float())  # every copy's backward is done
        raise_failures(call_each(pipe.param_owners, grads.average_grads, (pipe.pid, ctx_id)))
        self.reached = True
        # The copies decide alike on the same mean loss; only the first says so (a warning, an error).
        if self.index and not torch.isfinite(loss).all():
            return None
        return loss

    def settle(self, pipe, wait: bool) -> None:
        """After a failed step of a copy: its stages take part in the step's all_reduce all the same."""
        try:
            call_each(pipe.param_owners, grads.settle_reduce, (pipe.pid, wait))
        except Exception:  # noqa: BLE001 - an owner that is gone; the step's own error is the one to report
            pass
