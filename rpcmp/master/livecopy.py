"""A lost owner of one copy of a replicated pipeline, rebuilt from a live copy:
``Job(replicas=R, spares=K)``.

[Note: recovery from a live copy]
The copies of a stage are identical after every step, so when an owner of copy r dies, the
stages it held are on R - 1 other processes already, up to date: nothing needs a snapshot and
no step is lost. When a step fails because an owner died, the master asks every process whether
it answers; with exactly one lost owner and a spare, it

1. has every surviving owner forget the failed step, unless the step stands (below): its
   stages' buffers and its generators return to the step's start (see [Note: a step marked,
   to be run again] in :mod:`rpcmp.owner.live`);
2. builds the lost stages on the spare (empty: every value is copied in) and fills each from
   the same stage of a source copy, owner to owner, by name: parameters, every buffer,
   optimizer state and fields, and the generators of that process, which are the lost one's
   (the copies seed and draw alike); routes copy r to the spare and gives it a new
   DistributedOptimizer there (as :mod:`rpcmp.master.move` does);
3. has the copies of each rebuilt stage average in a new gloo (NCCL) process group, met through
   the launch's store under a prefix of its own: ``new_group`` over the world would wait for
   every rank of the world, the dead one too;
4. hands the trainer the position of the failed step, which runs again on the same batch, or
   the step's loss when it stands.

[Note: a step some copies took]
The copies meet (:class:`~rpcmp.master.replicas.ReplicaSync`) and average their gradients
before any of them steps, so a loss before that point leaves every parameter and optimizer
state as it was: the step runs again (1.). But each copy then steps on its own, and an owner
lost after the average (inside its optimizer step, say) fails its copy's step while the other
copies take theirs, and its own copy's other owners may have stepped or not. Running the
step again would step those copies twice. So the master notes which copies ended their step
(``Replicated.taken``) and which got past the average (``ReplicaReduce.reached``):

- some copy took the step: the step stands; a copy that took it, other than the lost owner's,
  is the source, the lost stages come from it, and every stage of every copy that did not end
  its step takes the source's values too (parameters, buffers, optimizer state, and on the
  master its scheduler and loss scale); the step's loss is the copies' mean from their meeting.
  When only the lost owner's own copy took it, no live copy holds that state: the error stands;
- none did: the step runs again from a copy that never got past the average, and every copy
  that did takes that copy's values; with no such copy (every copy may have stepped, none
  ended) the error stands.

Either way the run equals an uninterrupted one. The run says one line for it. So too for an owner
lost while a resumed run's copies read its checkpoint (:func:`rpcmp.master.recovery.read_resumed`): the
other copies have read it by the time the loss is known, generators restored first. With two lost
owners, or no spare, the error stands and the run ends as it always did. A spare lost while it takes
over is replaced by the next, which does 1. to 4. again.
"""
from __future__ import annotations

import sys
import time

import torch.distributed.rpc as rpc

from ..core.futures import wait_all
from ..core.health import loss_cause, unresponsive
from ..core.served import current
from ..owner import live
from ..owner import move as owner_move
from .move import new_optimizer
from .recovery import RolledBack, cannot_replace, install_rebuilt, rebuild_on_spare, spare_lost

__all__ = ["LiveCopies"]


class LiveCopies:
    """The master's side of spares for a :class:`~rpcmp.master.replicas.Replicated` pipeline."""

    def __init__(self, replicated, spares: list[str]):
        self.rep, self.spares = replicated, spares  # the engine's list: a drain takes from it too
        for pipe in replicated.pipes:
            pipe.sync.mark = True

    def settle(self) -> None:
        """Nothing to wait for before a step: the copies are the source (see the Note)."""

    def recover(self, error: BaseException, position: tuple[int, int, int], in_step: bool = True,
                redo: str = "its checkpoint skipped", first: tuple[float, str] | None = None) -> RolledBack:
        """Rebuild the stages of the owner whose loss failed the step at ``position`` (or, not ``in_step``, the
        checkpoint save after the step before it) from a live copy, or re-raise ``error`` (see [Note: recovery
        from a live copy]). A spare lost while it takes over is replaced by the next (``first``: when the first
        try began, and the owner it replaced)."""
        start, pipes = first[0] if first else time.perf_counter(), self.rep.pipes
        owners = {o for p in pipes for o in p.owners}
        lost = unresponsive(sorted(owners | set(self.spares)), timeout=3.0)
        silent = [s for s in self.spares if s in lost]
        self.spares[:] = [s for s in self.spares if s not in lost]
        owners_lost = sorted(owners & set(lost))
        r = next((i for i, p in enumerate(pipes) if owners_lost and owners_lost[0] in p.owners), 0)
        source, refill, stood = self._plan(r, in_step)
        why = cannot_replace(owners_lost, self.spares, silent) or (None if source is not None else (
            "no live copy holds the failed step's state: every copy may have changed its stages in it, and none "
            "other than the lost owner's took it whole"))
        if why:
            if owners_lost:
                print(f"rpcmp: not recovered in place: {why}; the run ends", file=sys.stderr, flush=True)
            raise error
        gone, spare = owners_lost[0], self.spares.pop(0)
        current().lost.add(gone)
        pipe, source = pipes[r], pipes[source]
        stages = [k for k, o in enumerate(pipe.owners) if o == gone]
        try:
            if in_step and not stood:  # between steps the survivors' buffers and generators are already the step's
                wait_all([rpc.rpc_async(o, live.unmark, args=(p.pid,))
                          for p in pipes for o in sorted(set(p.owners) - {gone})])
            self._rebuild(pipe, source, gone, spare, stages, refill=r in refill)
            for q in sorted(set(refill) - {r}):
                self._refill(pipes[q], source, range(len(source.owners)))
                new_optimizer(pipes[q], {}, set())  # each local optimizer takes the state that came
            self._regroup(stages)
        except Exception as exc:  # noqa: BLE001 - the spare's own loss is recovered from as the owner's was
            if not spare_lost(spare, gone, [o for p in pipes for o in p.owners], exc):
                raise
            return self.recover(error, position, in_step, redo, first=first or (start, gone))
        self.rep.label_stages()
        self.rep.meeting.reset()
        names = ", ".join(f"{k} ({pipe.specs[k].name})" for k in stages)
        what = (f"step {position[0] + 1} stood: replica {self.rep.pipes.index(source)} had taken it" if stood
                else f"step {position[0] + 1} runs again" if in_step else redo)
        who = first[1] if first else gone
        return RolledBack(position, f"recovered: {who} was lost ({loss_cause(error, who)}); replica {r} stage {names} "
                                    f"rebuilt on {spare} "
                                    f"from the live copy on {', '.join(source.owners[k] for k in stages)}; no step "
                                    f"lost ({what}){self._refilled(refill, r)}; "
                                    f"{time.perf_counter() - start:.2f} s",
                          stood=self.rep.meeting.mean.item() if stood else None)

    def _plan(self, r: int, in_step: bool) -> tuple[int | None, list[int], bool]:
        """For a loss in copy ``r``: the copy to take the state from (None: none can), the copies whose
        surviving stages take it too, and whether the failed step stands (see [Note: a step some copies took])."""
        copies = len(self.rep.pipes)
        if not in_step:  # every copy took the last step
            return (r + 1) % copies, [], False
        taken = sorted(self.rep.taken)
        if taken:  # not from copy r itself, whose lost stage took the step with the process that held it
            others = [q for q in taken if q != r]
            return (others[0] if others else None), [q for q in range(copies) if q not in taken], True
        reached = [q for q, p in enumerate(self.rep.pipes) if p.sync.reached]
        sources = [q for q in ((r + j) % copies for j in range(1, copies)) if q not in reached]
        return (sources[0] if sources else None), reached, False

    @staticmethod
    def _refilled(refill: list[int], r: int) -> str:
        others = [q for q in refill if q != r]
        parts = ([f"replica {r}'s other stages"] if r in refill else []) + [f"replica {q}" for q in others]
        return f"; {' and '.join(parts)} retaken from the same copy" if parts else ""

    def _rebuild(self, pipe, source, gone: str, spare: str, stages: list[int], refill: bool) -> None:
        """Build ``stages`` of ``pipe`` on ``spare`` and fill them from ``source``'s copies; with ``refill``,
        the surviving stages of ``pipe`` take ``source``'s values as well."""
        old_optims = {r.owner().name: r for r in pipe.optimizer.remote_optimizers if r.owner().name != gone}
        built = rebuild_on_spare(pipe, gone, spare, stages, empty=True)
        self._refill(pipe, source, stages, built=True)
        if refill:
            self._refill(pipe, source, [k for k in range(len(pipe.owners)) if k not in stages])
        install_rebuilt(pipe, built, old_optims, spare)

    @staticmethod
    def _refill(pipe, source, stages, built: bool = False) -> None:
        """Stages ``stages`` of ``pipe`` take the values of ``source``'s copies, owner to owner, by name (their
        optimizer state waits for the pipeline's next optimizer), and the pipeline the master's part (scheduler,
        fp16 loss scale). Stages ``built`` just now take the figures counted too and, the first, the generators
        (the process's, not the stage's); a surviving stage keeps its figures and its process's generators,
        which drew as the source's did."""
        theirs = {r.owner().name: r for r in source.optimizer.remote_optimizers}
        for n, k in enumerate(stages):
            rpc.rpc_sync(pipe.owners[k], owner_move.take_stage, args=(pipe.pid, k, source.owners[k],
                                                                     source.owners[k] in theirs, built and n == 0,
                                                                     source.pid, built))
        if source.scheduler is not None:
            pipe.load_scheduler_state(source.scheduler_state())
        if source.loss_scale:
            pipe.loss_scale = source.loss_scale

    def _regroup(self, stages: list[int]) -> None:
        """The copies of each rebuilt stage average in a new process group (see the Note)."""
        self.rep.regroup(stages)
