"""A lost owner of one copy of a replicated pipeline, rebuilt from a live copy:
``Job(replicas=R, spares=K)``.

[Note: recovery from a live copy]
The copies of a stage are identical after every step, so when an owner of copy r dies, the
stages it held are on R - 1 other processes already, up to date: nothing needs a snapshot and
no step is lost. When a step fails because an owner died, the master asks every process whether
it answers; with exactly one lost owner and a spare, it

1. has every surviving owner forget the failed step: its stages' buffers and its generators
   return to the step's start (see [Note: a step marked, to be run again] in
   :mod:`rpcmp.owner.live`); no parameter or optimizer state moved (the copies meet before
   their optimizer step, and a failed copy aborts the meeting);
2. builds the lost stages on the spare (empty: every value is copied in) and fills each from
   the same stage of the next copy, owner to owner, by name: parameters, every buffer,
   optimizer state and fields, and the generators of that process, which are the lost one's
   (the copies seed and draw alike); routes copy r to the spare and gives it a new
   DistributedOptimizer there (as :mod:`rpcmp.master.move` does);
3. has the copies of each rebuilt stage average in a new gloo (NCCL) process group, met through
   the launch's store under a prefix of its own: ``new_group`` over the world would wait for
   every rank of the world, the dead one too;
4. hands the trainer the position of the failed step, which runs again on the same batch.

The run says one line for it. With two lost owners, or no spare, the error stands and the run
ends as it always did.
"""
from __future__ import annotations

import sys
import time

import torch.distributed.rpc as rpc

from ..core.futures import wait_all
from ..core.health import unresponsive
from ..core.served import current
from ..owner import live
from ..owner import move as owner_move
from .recovery import RolledBack, cannot_replace, install_rebuilt, rebuild_on_spare

__all__ = ["LiveCopies"]


class LiveCopies:
    """The master's side of spares for a :class:`~rpcmp.master.replicas.Replicated` pipeline."""

    def __init__(self, replicated, spares: list[str]):
        self.rep, self.spares, self.regroups = replicated, spares, 0  # the engine's list: a drain takes from it too
        for pipe in replicated.pipes:
            pipe.sync.mark = True

    def settle(self) -> None:
        """Nothing to wait for before a step: the copies are the source (see the Note)."""

    def recover(self, error: BaseException, position: tuple[int, int, int], in_step: bool = True,
                redo: str = "its checkpoint skipped") -> RolledBack:
        """Rebuild the stages of the owner whose loss failed the step at ``position`` (or, not ``in_step``, the
        checkpoint save after the step before it) from a live copy, or re-raise ``error`` (see [Note: recovery
        from a live copy])."""
        start, pipes = time.perf_counter(), self.rep.pipes
        owners = {o for p in pipes for o in p.owners}
        lost = unresponsive(sorted(owners | set(self.spares)), timeout=3.0)
        self.spares[:] = [s for s in self.spares if s not in lost]
        owners_lost = sorted(owners & set(lost))
        why = cannot_replace(owners_lost, self.spares)
        if why:
            if owners_lost:
                print(f"rpcmp: not recovered in place: {why}; the run ends", file=sys.stderr, flush=True)
            raise error
        gone, spare = owners_lost[0], self.spares.pop(0)
        current().lost.add(gone)
        r = next(i for i, p in enumerate(pipes) if gone in p.owners)
        pipe, source = pipes[r], pipes[(r + 1) % len(pipes)]
        stages = [k for k, o in enumerate(pipe.owners) if o == gone]
        if in_step:  # between steps the survivors' buffers and generators are already the step's
            wait_all([rpc.rpc_async(o, live.unmark, args=(p.pid,)) for p in pipes for o in sorted(set(p.owners) - {gone})])
        self._rebuild(pipe, source, gone, spare, stages)
        self._regroup(stages)
        self.rep.label_stages()
        self.rep.meeting.reset()
        names = ", ".join(f"{k} ({pipe.specs[k].name})" for k in stages)
        return RolledBack(position, f"recovered: {gone} was lost ({type(error).__name__}: "
                                    f"{str(error).splitlines()[0][:60]}); replica {r} stage {names} rebuilt on {spare} "
                                    f"from the live copy on {', '.join(source.owners[k] for k in stages)}; no step "
                                    f"lost ({f'step {position[0] + 1} runs again' if in_step else redo}"
                                    f"); {time.perf_counter() - start:.2f} s")

    def _rebuild(self, pipe, source, gone: str, spare: str, stages: list[int]) -> None:
        """Build ``stages`` of ``pipe`` on ``spare`` and fill them from ``source``'s copies."""
        old_optims = {r.owner().name: r for r in pipe.optimizer.remote_optimizers if r.owner().name != gone}
        theirs = {r.owner().name: r for r in source.optimizer.remote_optimizers}
        built = rebuild_on_spare(pipe, gone, spare, stages, empty=True)
        for n, k in enumerate(stages):  # the generators once: they are the process's, not the stage's
            rpc.rpc_sync(spare, owner_move.take_stage, args=(pipe.pid, k, source.owners[k],
                                                            theirs.get(source.owners[k]), n == 0, source.pid))
        install_rebuilt(pipe, built, old_optims, spare)

    def _regroup(self, stages: list[int]) -> None:
        """The copies of each rebuilt stage average in a new process group (see the Note)."""
        self.regroups += 1
        seconds = max(60.0, self.rep.job.hang_timeout or 0)
        futs = []
        for k in stages:
            prefix = f"rpcmp/regroup/{current().attempt}/{self.regroups}/{k}/"
            futs += [rpc.rpc_async(p.owners[k], live.regroup, args=(k, prefix, i, len(self.rep.pipes),
                                                                   p.places[k].device, seconds))
                     for i, p in enumerate(self.rep.pipes)]
        wait_all(futs)
