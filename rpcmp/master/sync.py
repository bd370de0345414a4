"""How a pipeline's gradients come together before its optimizer step: the one decision that
differs between a single pipeline and one copy of R (see [Note: replicas of a pipeline]).

:class:`LocalMerge` (one copy): each micro-batch's gradients are added into the step's target
context on its owner. :class:`ReplicaReduce` (copy ``index`` of R): the owners merge and start
averaging with the other copies as each backward leaves them, and the copies meet before the
step on the mean loss. The pipeline holds one of them and never asks which.
"""
from __future__ import annotations

import torch
import torch.distributed.rpc as rpc

from ..core.futures import raise_failures, wait_all
from ..owner import live, stage

__all__ = ["LocalMerge", "ReplicaReduce"]


class LocalMerge:
    """One pipeline: nothing to meet, nothing to average."""

    def begin(self, pipe, first_seq: int, count: int) -> None:
        pass

    def merge(self, pipe, ctx_ids: list[int], i: int, into: int) -> None:
        """Add context ``ctx_ids[i]``'s gradients into ``ctx_ids[into]`` on every owner: by RPC on the
        others, by a call on this one (a stage on the master: an RPC to itself costs two messages a
        micro-batch for nothing)."""
        me = rpc.get_worker_info().name
        args = (pipe.pid, ctx_ids[into], ctx_ids[i])
        futs = [rpc.rpc_async(o, stage.merge_grads, args=args) for o in pipe.param_owners if o != me]
        if me in pipe.param_owners:
            stage.merge_grads(*args)
        raise_failures(wait_all(futs))

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

    def begin(self, pipe, first_seq: int, count: int) -> None:
        """The owners learn the step's micro-batches before they arrive (see [Note: the average overlaps
        the backward] in rpcmp/owner/reduce.py)."""
        fn = live.begin if self.mark else stage.begin_reduce
        owners = sorted(set(pipe.owners)) if self.mark else pipe.param_owners
        wait_all([rpc.rpc_async(o, fn, args=(pipe.pid, first_seq, count)) for o in owners])

    def merge(self, pipe, ctx_ids: list[int], i: int, into: int) -> None:
        """The owners merge as each backward leaves them and start the average when the last has."""
        raise_failures(wait_all([rpc.rpc_async(o, stage.reduce_merged, args=(pipe.pid, i, ctx_ids[:i + 1]))
                                 for o in pipe.param_owners]))

    def before_step(self, pipe, ctx_id: int, loss: torch.Tensor) -> torch.Tensor | None:
        loss = self.meeting.meet(self.index, loss.detach().float())  # every copy's backward is done
        raise_failures(wait_all([rpc.rpc_async(o, stage.average_grads, args=(pipe.pid, ctx_id)) for o in pipe.param_owners]))
        self.reached = True
        # The copies decide alike on the same mean loss; only the first says so (a warning, an error).
        if self.index and not torch.isfinite(loss).all():
            return None
        return loss

    def settle(self, pipe, wait: bool) -> None:
        """After a failed step of a copy: its stages take part in the step's all_reduce all the same."""
        try:
            wait_all([rpc.rpc_async(o, stage.settle_reduce, args=(pipe.pid, wait)) for o in pipe.param_owners])
        except Exception:  # noqa: BLE001 - an owner that is gone; the step's own error is the one to report
            pass
