"""The owner's side of a lost copy's stage rebuilt from a live copy (``Job(replicas=R, spares=K)``;
the master's side: :mod:`rpcmp.master.livecopy`).

[Note: a step marked, to be run again]
The copies of a stage hold the same parameters and optimizer state after every step, and the
same generators (each process seeds alike and draws alike: the copies see shares of one size).
A step that fails before the copies have met and averaged leaves the parameters and the
optimizer alone (one that fails later: see [Note: a step some copies took] in
:mod:`rpcmp.master.livecopy`), but its forwards have moved what a forward moves: BatchNorm's
running statistics and the generators (dropout). So at the start of each step every owner marks
them (:func:`begin`: a copy of the stages' buffers, which are small, and of the process's
generator states); after a loss every surviving owner returns to its mark (:func:`unmark`), and
the same step runs again on the same batch: no step is lost or trained twice.
"""
from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from ..core.served import current
from ..core.store import launch_store
from . import grads
from .state import rng_state, set_rng_state

__all__ = ["begin", "unmark", "regroup"]


def begin(pid: int, first_seq: int, count: int) -> bool:
    """A step of a copy begins: mark its buffers and generators, then start the step's average
    (:func:`rpcmp.owner.grads.begin_reduce`, whose answer this is)."""
    served = current()
    with torch.no_grad():
        buffers = {h.spec.index: {n: b.detach().clone() for n, b in h.module.named_buffers()}
                   for h in served.hosts_of(pid)}
    served.marks[pid] = (buffers, rng_state())
    return grads.begin_reduce(pid, first_seq, count)


def unmark(pid: int) -> None:
    """Forget a failed step here: the buffers and generators of its start; the step's average is over."""
    served = current()
    buffers, rng = served.marks[pid]
    with torch.no_grad():
        for host in served.hosts_of(pid):
            with host.lock:  # a forward of the failed step still running here finishes first
                for name, b in host.module.named_buffers():
                    b.copy_(buffers[host.spec.index][name])
            host.reduce = None
    set_rng_state(rng)


def regroup(index: int, prefix: str, rank: int, size: int, device: str, seconds: float) -> None:
    """The copies of stage ``index`` average in a new process group (rank ``rank`` of ``size``),
    met through the launch's store under ``prefix``: not ``new_group`` over the world, which waits
    for every rank of the world, the lost one too."""
    store = dist.PrefixStore(prefix, launch_store(seconds))
    cls = dist.ProcessGroupNCCL if device.startswith("cuda") else dist.ProcessGroupGloo
    group = cls(store, rank, size, timeout=timedelta(seconds=seconds)) if cls is dist.ProcessGroupGloo \
        else cls(store, rank, size)
    served = current()
    if served.stage_groups is None:
        served.stage_groups = {}
    served.stage_groups[index] = group
